"""The waits that keep a burst of requests in one step (isoserve/disagg/bursts.py), on explicit
clocks. tests/test_serving.py checks the same through real workers."""
from __future__ import annotations

import pytest

from isoserve.disagg.bursts import GATHER_LIMIT, PromptGather, TransferBurst


def hold(g: PromptGather, now: float, *, idle: bool = True, tokens: int = 100, seqs: int = 1) -> float:
    return g.hold_s(now, idle=idle, waiting_tokens=tokens, waiting_seqs=seqs)


def test_a_gather_waits_until_arrivals_pause():
    g = PromptGather(quiet_s=0.02, max_tokens=4096, max_seqs=64)
    assert hold(g, 0.0) == 0.0  # nothing has arrived: nothing to hold
    g.arrived(1.000)
    assert hold(g, 1.005) == pytest.approx(0.015)
    g.arrived(1.010)  # another prompt: the quiet period starts again
    assert hold(g, 1.015, seqs=2) == pytest.approx(0.015)
    assert hold(g, 1.030, seqs=2) == 0.0  # 20 ms without an arrival: step
    assert hold(g, 1.031, seqs=2) == 0.0  # released until the next arrival


def test_a_gather_never_holds_the_first_prompt_past_its_limit():
    g = PromptGather(quiet_s=0.02, max_tokens=4096, max_seqs=64)
    t = 5.0
    g.arrived(t)
    limit = t + GATHER_LIMIT * 0.02
    while t < limit - 0.01:  # a steady trickle, never quiet for 20 ms
        t += 0.01
        g.arrived(t)
        assert hold(g, t, seqs=10) == pytest.approx(min(0.02, limit - t))
    assert hold(g, limit) == 0.0


@pytest.mark.parametrize("tokens, seqs", [(4096, 5), (300, 64)])
def test_a_full_step_of_prompts_starts_at_once(tokens, seqs):
    g = PromptGather(quiet_s=0.02, max_tokens=4096, max_seqs=64)
    g.arrived(0.0)
    assert hold(g, 0.001, tokens=tokens, seqs=seqs) == 0.0


def test_a_gather_holds_only_an_idle_worker_and_zero_turns_it_off():
    g = PromptGather(quiet_s=0.02, max_tokens=4096, max_seqs=64)
    g.arrived(0.0)
    assert hold(g, 0.001, idle=False) == 0.0  # a prompt mid-prefill: its next chunk goes on
    off = PromptGather(quiet_s=0.0, max_tokens=4096, max_seqs=64)
    off.arrived(0.0)
    assert hold(off, 0.0) == 0.0


def test_a_transfer_burst_holds_until_its_last_transfer_or_a_gap():
    b = TransferBurst(gap_s=0.05)
    assert b.hold_s(0.0) == 0.0
    b.received(following=3, now=1.0)
    assert b.hold_s(1.01) == pytest.approx(0.04)
    b.received(following=2, now=1.02)
    assert b.hold_s(1.03) == pytest.approx(0.04)  # counted from the latest transfer
    b.received(following=0, now=1.04)  # the last one: step at once
    assert b.hold_s(1.04) == 0.0
    b.received(following=5, now=2.0)  # a burst whose sender stops after its first transfer
    assert b.hold_s(2.049) > 0
    assert b.hold_s(2.05) == 0.0
    assert b.hold_s(2.06) == 0.0
