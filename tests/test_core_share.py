"""Workers on one host share its cores (isoserve/disagg/cores.py): a busy worker takes the
cores of idle peers, the busy ones split them evenly, and a peer that died busy holds none.
The peers here are real processes on the same share file."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from isoserve.disagg.cores import CoreShare, create_share_file

PEER = textwrap.dedent("""
    import sys
    from isoserve.disagg.cores import CoreShare
    share = CoreShare(sys.argv[1], int(sys.argv[2]), cores=4)
    for line in sys.stdin:
        share.set_busy(line.strip() == "busy")
        print("ok", flush=True)
""")


class Peer:
    def __init__(self, path, slot):
        self.proc = subprocess.Popen([sys.executable, "-c", PEER, str(path), str(slot)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def set(self, state: str) -> None:
        self.proc.stdin.write(state + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ok"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def share_file(tmp_path):
    path = tmp_path / "cores.share"
    create_share_file(str(path), 3)
    return path


def test_busy_workers_split_the_cores_and_idle_ones_lend_theirs(share_file):
    me = CoreShare(str(share_file), 0, cores=4)
    peers = [Peer(share_file, 1), Peer(share_file, 2)]
    try:
        for p in peers:
            p.set("idle")
        assert me.threads() == 4            # alone: every core
        peers[0].set("busy")
        assert me.threads() == 2            # two busy: half each
        peers[1].set("busy")
        assert me.threads() == 1            # three busy on four cores: one each, never zero
        peers[0].set("idle")
        peers[1].set("idle")
        assert me.threads() == 4
    finally:
        for p in peers:
            p.kill()


def test_a_peer_that_died_busy_holds_no_cores(share_file):
    me = CoreShare(str(share_file), 0, cores=2)
    peer = Peer(share_file, 1)
    peer.set("busy")
    assert me.threads() == 1
    peer.kill()
    assert me.threads() == 2


def test_a_restarted_worker_clears_its_slot_and_slots_are_checked(share_file):
    peer = Peer(share_file, 1)
    try:
        peer.set("busy")
        me = CoreShare(str(share_file), 0, cores=2)
        assert me.threads() == 1
        # The same slot opened again (a restarted worker in this process) starts idle.
        again = CoreShare(str(share_file), 1, cores=2)
        assert me.threads() == 2 and again.threads() == 2
    finally:
        peer.kill()
    with pytest.raises(ValueError, match="slot 3"):
        CoreShare(str(share_file), 3)
