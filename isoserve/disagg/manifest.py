"""The KV transfer from a prefill worker to a decode worker: what is sent, and how the
receiver decides whether to accept it (DESIGN invariants 4 and 5).

The sender describes each page it sends (position in the request, filled slots, its own
writer tag and epoch, checksum of the bytes). The receiver trusts none of it for what the
prompt is: it compares the manifest with the prompt length the router gave it, recomputes
each checksum, checks that its own destination pages have not changed epoch, and only then
writes the bytes itself, stamped with its own tag for the request.
"""
from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass

import crc32c
import numpy as np
import torch

from isoserve import failpoints
from isoserve.config import dtype_name
from isoserve.engine.sequence import Sequence
from isoserve.kv.pool import KVPool


class TransferRejected(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason  # short label, used as a metric label
        self.detail = detail


@dataclass
class PageRecord:
    index: int     # place of the page in the request's page list: tokens index*page_size ...
    filled: int    # slots carried
    writer: int    # the sender's writer tag (for logs; the receiver stamps its own)
    epoch: int     # the sender's epoch (for logs)
    checksum: int  # crc32c of the page's payload frame


@dataclass
class Manifest:
    request_id: str
    num_tokens: int
    page_size: int
    pages: list[PageRecord]
    first_token: int
    first_logprob: dict | None  # first_token's, as wire.token_logprob_to_wire writes it
    sent_at: float
    # How many more transfers the sender is sending to this decode worker right after this one,
    # from the same prefill step: a scheduling hint (disagg/bursts.py), never trusted for
    # correctness; a transfer is verified alone, against its own reservation.
    following: int = 0
    # The sender's pool dtype ("bfloat16", "float32"): what the bytes mean. A manifest without
    # it (an older sender) reads "" and is refused like any other mismatch.
    kv_dtype: str = ""

    def to_wire(self) -> dict:
        return asdict(self)

    @classmethod
    def from_wire(cls, body: dict) -> "Manifest":
        pages = [PageRecord(**p) for p in body["pages"]]
        return cls(**{**body, "pages": pages})


def page_payload(pool: KVPool, page: int, filled: int) -> np.ndarray:
    """The bytes of a page's first `filled` slots (all layers, K and V), copied out once into the
    buffer zmq sends from; slots the request never wrote (stale KV of whoever held the page
    before) never leave the worker."""
    return pool.read_page(page, filled).cpu().view(torch.uint8).numpy().reshape(-1)


def checksum(buf) -> int:
    return crc32c.crc32c(memoryview(buf).cast("B"))


def build_manifest(pool: KVPool, seq: Sequence, first_logprob: dict | None, sent_at: float,
                   following: int = 0):
    """Manifest and payload frames for the KV of seq's prompt (seq.num_computed tokens)."""
    size = pool.page_size
    n = seq.num_computed
    records, frames = [], []
    for j in range(-(-n // size)):
        page, filled = seq.pages[j], min(size, n - j * size)
        frame = page_payload(pool, page, filled)
        records.append(PageRecord(j, filled, int(pool.writer[page]), int(pool.epoch[page]),
                                  checksum(frame)))
        frames.append(frame)
    first = seq.output_token_ids[0]
    return Manifest(seq.request_id, n, size, records, first, first_logprob, sent_at, following,
                    dtype_name(pool.kv.dtype)), frames


def verify_transfer(manifest: Manifest, frames: list, seq: Sequence, pool: KVPool, *,
                    check_coverage: bool = True, check_checksums: bool = True) -> None:
    """Raise TransferRejected unless this transfer may be written into seq's pages."""
    size = pool.page_size
    slot_bytes = pool.slot_bytes
    prompt_len = len(seq.prompt_token_ids)  # from the router, never from the sender
    if manifest.page_size != size:
        raise TransferRejected("page_size", f"sender pages hold {manifest.page_size} tokens, ours {size}")
    if manifest.kv_dtype != dtype_name(pool.kv.dtype):
        raise TransferRejected("kv_dtype", f"sender's KV is {manifest.kv_dtype}, our pool's {dtype_name(pool.kv.dtype)}")
    if len(frames) != len(manifest.pages):
        raise TransferRejected("frames", f"{len(frames)} payload frames for {len(manifest.pages)} pages")
    if check_coverage:
        expected_pages = -(-prompt_len // size)
        if manifest.num_tokens != prompt_len or len(manifest.pages) != expected_pages:
            raise TransferRejected("coverage", f"transfer covers {manifest.num_tokens} tokens in "
                                   f"{len(manifest.pages)} pages; the prompt has {prompt_len} tokens "
                                   f"in {expected_pages} pages")
        for j, rec in enumerate(manifest.pages):
            want = min(size, prompt_len - j * size)
            if rec.index != j or rec.filled != want:
                raise TransferRejected("coverage", f"page record {j} is (index {rec.index}, filled "
                                       f"{rec.filled}), expected (index {j}, filled {want})")
    for rec, frame in zip(manifest.pages, frames):
        # Needed to write at all, whatever the switches: a page we cannot place is never written.
        if not (0 <= rec.index < len(seq.pages)) or not (0 < rec.filled <= size) \
                or len(frame) != rec.filled * slot_bytes:
            raise TransferRejected("shape", f"page record {rec} does not fit the reserved pages")
    if check_checksums:
        for rec, frame in zip(manifest.pages, frames):
            if checksum(frame) != rec.checksum:
                raise TransferRejected("checksum", f"page {rec.index} bytes do not match its checksum")
    moved = pool.epoch[seq.pages] != torch.tensor(seq.page_epochs, dtype=torch.int64)
    if bool(moved.any()):
        raise TransferRejected("epoch", f"destination pages {torch.tensor(seq.pages)[moved].tolist()} "
                               "changed epoch since they were reserved")


def write_transfer(manifest: Manifest, frames: list, seq: Sequence, pool: KVPool) -> int:
    """Write verified pages into seq's pages, stamped with seq's tag. Returns bytes written."""
    layers, kv, heads, _, _, dim = pool.kv.shape
    written = 0
    pages, ends = [], []
    for rec, frame in zip(manifest.pages, frames):
        dest = seq.pages[rec.index]
        pool.write_page(dest, _as_tensor(frame, pool.kv.dtype).view(layers, kv, heads, rec.filled, dim))
        pages.append(dest)
        ends.append(rec.filled)
        written += len(frame)
    if pages and not failpoints.fire("decode.skip_tag_stamp"):
        if failpoints.fire("decode.stamp_whole_prompt"):  # "complete" taken to mean every page
            n = len(seq.prompt_token_ids)
            pages = seq.pages[:-(-n // pool.page_size)]
            ends = [min(pool.page_size, n - j * pool.page_size) for j in range(len(pages))]
        pool.stamp_writes(torch.tensor(pages), torch.full((len(pages),), seq.tag, dtype=torch.int64),
                          torch.tensor(ends))
    return written


def _as_tensor(frame, dtype: torch.dtype) -> torch.Tensor:
    """A read-only received buffer as a tensor, without copying it (it is only read from)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the buffer is read-only
        return torch.from_numpy(np.frombuffer(frame, dtype=np.uint8)).view(dtype)


def apply_transfer_faults(manifest: Manifest, frames: list) -> list[tuple[Manifest, list]]:
    """The sends a faulty sender would make instead of one honest (manifest, frames) send.
    Only reachable through failpoints; never changes the pool's own memory."""
    fp = failpoints.FAILPOINTS
    records = list(manifest.pages)
    frames = list(frames)
    if fp.fire("transfer.truncate") and len(records) > 1:
        keep = len(records) // 2
        records, frames = records[:keep], frames[:keep]
        manifest = Manifest(**{**manifest.__dict__, "num_tokens": sum(r.filled for r in records)})
    if fp.fire("transfer.drop_page") and len(records) > 1:
        del records[len(records) // 2], frames[len(frames) // 2]
    if fp.fire("transfer.reorder"):
        records.reverse()
        frames.reverse()
    if fp.fire("transfer.corrupt_bytes") and frames:
        bad = bytearray(memoryview(frames[0]).cast("B"))
        for i in range(0, len(bad), max(1, len(bad) // 64) | 1):  # odd: every byte of an element, exponents too
            bad[i] ^= 0x5A
        frames[0] = bad
    manifest = Manifest(**{**manifest.__dict__, "pages": records})
    copies = 2 if fp.fire("transfer.duplicate") else 1
    return [(manifest, frames)] * copies
