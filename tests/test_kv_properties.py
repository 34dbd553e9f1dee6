"""Property tests of the KV pool, the page allocator and the read guard, and engine-level checks
that every page's writer/epoch/fill stays right through prefill chunks, decodes, preemption,
errors and aborts, and that every page comes back.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from isoserve import LLM, SamplingParams
from isoserve.engine.scheduler import Scheduler
from isoserve.engine.sequence import Sequence, Status
from isoserve.errors import ContextLengthExceeded, KVIsolationViolation
from isoserve.kv.allocator import OutOfPages, PageAllocator
from isoserve.kernels import cpu_ops
from isoserve.kv.guard import ReadCheck, check_reads
from isoserve.kv.pool import UNWRITTEN, KVPool
from isoserve.model.config import ModelConfig

# A hand-made model shape: two layers, GQA-like (2 query heads, 1 KV head), tiny head_dim.
CONFIG = ModelConfig(architecture="llama", vocab_size=64, hidden_size=16, intermediate_size=32,
                     num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-5,
                     rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=True)


# ---- pool + allocator: a stateful model ----------------------------------------------------

class PoolMachine(RuleBasedStateMachine):
    """Owners take, grow, write and release pages; a plain-Python model says what must hold."""

    @initialize(num_pages=st.integers(1, 12), page_size=st.integers(1, 6))
    def setup(self, num_pages, page_size):
        self.pool = KVPool(CONFIG, num_pages, page_size, torch.float32)
        self.alloc = PageAllocator(self.pool)
        self.owners: dict[int, list[int]] = {}     # live owner tag -> pages it holds
        self.epoch_of: dict[int, int] = {}         # held page -> epoch it got at allocation
        self.written: dict[int, tuple[int, int]] = {}  # held page -> (writer, filled)
        self.seen_epochs: set[int] = set()
        self.last_epoch = [0] * num_pages
        self.released: list[list[int]] = []        # page lists already given back
        self.next_tag = 1

    # -- rules
    @rule(n=st.integers(1, 5))
    def allocate(self, n):
        tag, self.next_tag = self.next_tag, self.next_tag + 1
        if self._take(n):
            self.owners[tag] = self._last_pages

    @precondition(lambda self: self.owners)
    @rule(data=st.data(), n=st.integers(1, 3))
    def grow(self, data, n):
        """An owner grows past its last page, as the scheduler asks (`after` its last page); the
        hint may also name another owner's page, a free page or none in the pool: whatever it
        names, only free pages come back."""
        tag = data.draw(st.sampled_from(sorted(self.owners)))
        after = data.draw(st.one_of(st.just(self.owners[tag][-1]), st.integers(-2, self.pool.num_pages + 1)))
        if self._take(n, after):
            self.owners[tag] += self._last_pages

    def _take(self, n, after=None) -> bool:
        free_before = self.alloc.num_free
        if n > free_before:
            with pytest.raises(OutOfPages):
                self.alloc.allocate(n, after)
            assert self.alloc.num_free == free_before
            return False
        free = {p for p in range(self.pool.num_pages) if not self.alloc.is_allocated(p)}
        pages, epochs = self.alloc.allocate(n, after)
        assert len(pages) == len(set(pages)) == len(epochs) == n
        assert not any(p in self.epoch_of for p in pages), "a page went to two live owners"
        # Runs: each page is the one after the page before it (`after` for the first) where that
        # one was free, so a sequence's pages lie one after another in the pool where they can.
        for before, page in zip([after, *pages], pages):
            if before is not None and before + 1 in free:
                assert page == before + 1, (after, pages, sorted(free))
            free.discard(page)
        # Fresh epochs: never seen before, and larger than every earlier epoch of that page.
        assert not self.seen_epochs & set(epochs) and len(set(epochs)) == n
        for p, e in zip(pages, epochs):
            assert e > self.last_epoch[p]
            self.last_epoch[p] = e
            self.epoch_of[p] = e
            self.written[p] = (UNWRITTEN, 0)
            assert int(self.pool.writer[p]) == UNWRITTEN and int(self.pool.filled[p]) == 0
        self.seen_epochs |= set(epochs)
        self._last_pages = pages
        return True

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def write(self, data):
        """Some owners append KV to some of their pages, stamped in one call as the runner does."""
        size = self.pool.page_size
        tags = data.draw(st.lists(st.sampled_from(sorted(self.owners)), min_size=1, unique=True))
        pages, writers, ends = [], [], []
        for tag in tags:
            page = data.draw(st.sampled_from(self.owners[tag]))
            writer, filled = self.written[page]
            start = filled if writer == tag else 0  # the first write of a page starts at slot 0
            if start == size:
                continue
            end = data.draw(st.integers(start + 1, size))
            kept = self.pool.read_page(page, start)  # [layers, 2, kv_heads, start, head_dim]
            new = torch.empty(*kept.shape[:3], end - start, kept.shape[4])
            new[:, 0], new[:, 1] = float(tag), -float(tag)  # K and V of this writer
            self.pool.write_page(page, torch.cat([kept, new], dim=3))
            pages.append(page), writers.append(tag), ends.append(end)
            self.written[page] = (tag, end)
        if pages:
            self.pool.stamp_writes(torch.tensor(pages), torch.tensor(writers), torch.tensor(ends))

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def release(self, data):
        tag = data.draw(st.sampled_from(sorted(self.owners)))
        pages = self.owners.pop(tag)
        free_before = self.alloc.num_free
        self.alloc.free(pages)
        assert self.alloc.num_free == free_before + len(pages)  # exactly the pages it held
        assert not any(self.alloc.is_allocated(p) for p in pages)
        for p in pages:
            del self.epoch_of[p], self.written[p]
        self.released.append(pages)

    @precondition(lambda self: self.released)
    @rule(data=st.data())
    def release_again(self, data):
        """Freeing pages twice is refused, and a refused free changes nothing, even when the
        list also names pages that are legitimately held."""
        stale = data.draw(st.sampled_from(self.released))
        stale_free = [p for p in stale if not self.alloc.is_allocated(p)]
        if not stale_free:
            return  # every page of that list has a new owner: not a double free any more
        live = [p for pages in self.owners.values() for p in pages]
        extra = data.draw(st.lists(st.sampled_from(live), unique=True)) if live else []
        bad = data.draw(st.permutations(extra + stale_free[:1]))
        free_before = self.alloc.num_free
        with pytest.raises(RuntimeError):
            self.alloc.free(list(bad))
        assert self.alloc.num_free == free_before
        assert all(self.alloc.is_allocated(p) for p in live)

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def release_listing_a_page_twice(self, data):
        tag = data.draw(st.sampled_from(sorted(self.owners)))
        pages = self.owners[tag]
        twice = data.draw(st.permutations(pages + [data.draw(st.sampled_from(pages))]))
        free_before = self.alloc.num_free
        with pytest.raises(RuntimeError):
            self.alloc.free(list(twice))
        assert self.alloc.num_free == free_before
        assert all(self.alloc.is_allocated(p) for p in pages)

    # -- invariants
    @invariant()
    def owners_are_disjoint_and_account_for_every_page(self):
        held = [p for pages in self.owners.values() for p in pages]
        assert len(held) == len(set(held))
        allocated = {p for p in range(self.pool.num_pages) if self.alloc.is_allocated(p)}
        assert allocated == set(held)
        assert self.alloc.num_free == self.pool.num_pages - len(held)
        assert self.alloc.num_used == len(held)
        # The free list is exactly the pages not allocated, each once.
        assert set(self.alloc._free) == set(range(self.pool.num_pages)) - allocated

    @invariant()
    def held_pages_carry_their_epoch_writer_and_fill(self):
        for p, epoch in self.epoch_of.items():
            writer, filled = self.written[p]
            assert int(self.pool.epoch[p]) == epoch
            assert (int(self.pool.writer[p]), int(self.pool.filled[p])) == (writer, filled)
            if filled:  # the slots counted as written hold that writer's KV, in every layer
                kv = self.pool.read_page(p, filled)
                assert kv.shape[3] == filled
                assert torch.all(kv[:, 0] == float(writer)) and torch.all(kv[:, 1] == -float(writer))


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)


@given(page_size=st.integers(1, 64), tokens=st.integers(1, 10_000))
def test_pool_capacity_is_whole_pages_read_from_the_tensor(page_size, tokens):
    num_pages = KVPool.pages_for(CONFIG, page_size, torch.float32, kv_tokens=tokens)
    assert num_pages == math.ceil(tokens / page_size)
    pool = KVPool(CONFIG, num_pages, page_size, torch.float32, "meta")
    assert pool.capacity_tokens == num_pages * page_size >= tokens
    assert pool.nbytes == num_pages * KVPool.page_bytes(CONFIG, page_size, torch.float32)


@pytest.mark.parametrize("wide, narrow, value_bytes", [(torch.float32, torch.bfloat16, 2),
                                                        (torch.bfloat16, torch.float8_e4m3fn, 1)],
                         ids=["bfloat16 under float32", "float8 against bfloat16"])
@given(page_size=st.integers(1, 64), budget=st.integers(1, 2_000_000))
def test_a_pool_of_half_the_bytes_holds_twice_the_tokens_of_a_memory_budget(wide, narrow, value_bytes,
                                                                           page_size, budget):
    """--kv-dtype bfloat16 under a float32 model, and float8_e4m3fn against bfloat16: a budget
    in bytes buys whole pages of the narrower slots, twice as many (give or take the page the
    wider division rounds off), and a slot holds `value_bytes` a value."""
    wide_pages = KVPool.pages_for(CONFIG, page_size, wide, kv_memory_bytes=budget)
    narrow_pages = KVPool.pages_for(CONFIG, page_size, narrow, kv_memory_bytes=budget)
    assert narrow_pages in (2 * wide_pages, 2 * wide_pages + 1)
    assert narrow_pages * KVPool.page_bytes(CONFIG, page_size, narrow) <= budget
    if narrow_pages:
        pool = KVPool(CONFIG, narrow_pages, page_size, narrow, "meta")
        assert pool.slot_bytes == CONFIG.kv_bytes_per_token(value_bytes) and pool.nbytes <= budget


def test_a_float8_pool_moves_its_bytes_whole_and_scrubs_to_zero():
    """A float8 pool's pages cross a transfer as their own bytes, NaN codes included, into a
    float8 pool only (a bfloat16 one refuses them before writing); scrubbing zeroes them."""
    from isoserve.disagg.manifest import TransferRejected, build_manifest, verify_transfer, write_transfer
    from isoserve.engine.sequence import Sequence

    def sequence(pool, tag):  # a prompt of 7 tokens in pages 1 and 0
        return Sequence("r", tag, list(range(7)), SamplingParams(), 0, output_token_ids=[1], pages=[1, 0],
                        page_epochs=[int(pool.epoch[1]), int(pool.epoch[0])], num_computed=7)

    sender = KVPool(CONFIG, 2, 4, torch.float8_e4m3fn)
    sender.kv.view(torch.uint8).copy_(torch.arange(sender.kv.numel(), dtype=torch.int64).remainder(256)
                                      .to(torch.uint8).view(sender.kv.shape))
    manifest, frames = build_manifest(sender, sequence(sender, 1), None, 0.0)
    assert manifest.kv_dtype == "float8_e4m3fn"
    refusing = KVPool(CONFIG, 2, 4, torch.bfloat16)
    with pytest.raises(TransferRejected) as refused:
        verify_transfer(manifest, frames, sequence(refusing, 2), refusing)
    assert refused.value.reason == "kv_dtype" and not refusing.kv.any()
    receiver = KVPool(CONFIG, 2, 4, torch.float8_e4m3fn)
    seq = sequence(receiver, 2)
    verify_transfer(manifest, frames, seq, receiver)
    write_transfer(manifest, frames, seq, receiver)
    as_bytes = lambda t: t.view(torch.uint8)  # noqa: E731 (NaN codes compare as bytes)
    assert torch.equal(as_bytes(receiver.read_page(1, 4)), as_bytes(sender.read_page(1, 4)))
    assert torch.equal(as_bytes(receiver.read_page(0, 3)), as_bytes(sender.read_page(0, 3)))
    receiver.scrub([1])
    assert not as_bytes(receiver.kv[:, :, :, 1]).any() and as_bytes(receiver.kv[:, :, :, 0, :3]).any()


def test_float8_is_a_kv_dtype_for_bfloat16_and_float32_models_on_the_cpu_only():
    """--kv-dtype float8_e4m3fn (or fp8, fp8_e4m3) under --dtype bfloat16 or float32 on a CPU;
    refused under float16, on CUDA, and as a model's own dtype, each with a message that says
    what to use."""
    from isoserve.config import parse_kv_dtype, resolve_dtypes

    for name in ("float8_e4m3fn", "fp8", "fp8_e4m3"):
        for model in ("bfloat16", "float32"):
            assert parse_kv_dtype(name, model) == torch.float8_e4m3fn
            assert resolve_dtypes(model, name) == (model, "float8_e4m3fn")
    with pytest.raises(ValueError, match="needs a bfloat16 or float32 model"):
        parse_kv_dtype("fp8", "float16")
    with pytest.raises(ValueError, match="CPU's kernels only"):
        parse_kv_dtype("fp8", "bfloat16", "cuda")
    with pytest.raises(ValueError, match="KV cache dtype"):
        parse_kv_dtype("auto", "fp8")


def test_a_transfer_between_pools_of_different_dtypes_is_refused_before_any_write():
    """The manifest names the sender's pool dtype: a decode worker started with another
    --kv-dtype refuses the bytes (they would be another shape of number), and writes nothing."""
    from isoserve.disagg.manifest import Manifest, TransferRejected, build_manifest, verify_transfer, write_transfer
    from isoserve.engine.sequence import Sequence

    def sequence(pool, tag):  # a prompt of 7 tokens in pages 1 and 0
        return Sequence("r", tag, list(range(7)), SamplingParams(), 0, output_token_ids=[1], pages=[1, 0],
                        page_epochs=[int(pool.epoch[1]), int(pool.epoch[0])], num_computed=7)

    sender = KVPool(CONFIG, 2, 4, torch.float32)
    sender.kv.normal_()
    manifest, frames = build_manifest(sender, sequence(sender, 1), None, 0.0)
    assert manifest.kv_dtype == "float32"
    older = Manifest.from_wire({k: v for k, v in manifest.to_wire().items() if k != "kv_dtype"})
    with pytest.raises(TransferRejected) as refused:  # a sender that does not say: refused too
        verify_transfer(older, frames, sequence(sender, 2), KVPool(CONFIG, 2, 4, torch.float32))
    assert refused.value.reason == "kv_dtype"
    for dtype in (torch.bfloat16, torch.float32):
        receiver = KVPool(CONFIG, 2, 4, dtype)
        seq = sequence(receiver, 2)
        if dtype == torch.bfloat16:
            with pytest.raises(TransferRejected) as refused:
                verify_transfer(manifest, frames, seq, receiver)
            assert refused.value.reason == "kv_dtype"
            assert not receiver.kv.any() and not receiver.writer.any()
            continue
        verify_transfer(manifest, frames, seq, receiver)
        write_transfer(manifest, frames, seq, receiver)
        assert torch.equal(receiver.read_page(1, 4), sender.read_page(1, 4))
        assert torch.equal(receiver.read_page(0, 3), sender.read_page(0, 3))


# ---- the read guard ------------------------------------------------------------------------

@st.composite
def guarded_batch(draw):
    """Sequences that each wrote a prefix of their own pages and read part of it."""
    page_size = draw(st.integers(1, 6))
    specs = []
    for _ in range(draw(st.integers(1, 4))):
        written = draw(st.integers(0, 20))
        read = draw(st.integers(0, written))
        extra = draw(st.integers(0 if written else 1, 2))  # pages allocated for writes to come
        specs.append((written, read, -(-written // page_size) + extra))
    return page_size, specs


def _build(page_size, specs, chunking: st.DataObject):
    pool = KVPool(CONFIG, sum(n for _, _, n in specs), page_size, torch.float32)
    alloc = PageAllocator(pool)
    # A stale owner of every page first: the new owners must never pass on its writes.
    stale, _ = alloc.allocate(pool.num_pages)
    pool.stamp_writes(torch.tensor(stale), torch.full((len(stale),), 999), torch.full((len(stale),), page_size))
    alloc.free(stale)
    rows = []
    for i, (written, read, n) in enumerate(specs):
        pages, epochs = alloc.allocate(n)
        tag = 10 + i
        done = 0
        while done < written:  # append the prefix in chunks, stamping like the runner
            end = chunking.draw(st.integers(done + 1, written))
            touched = range(done // page_size, (end - 1) // page_size + 1)
            pool.stamp_writes(torch.tensor([pages[j] for j in touched]), torch.full((len(touched),), tag),
                              torch.tensor([min(page_size, end - j * page_size) for j in touched]))
            done = end
        rows.append((tag, pages, epochs, read))
    check = ReadCheck(tags=[r[0] for r in rows], tables=[list(r[1]) for r in rows],
                      epochs=[list(r[2]) for r in rows], read_before=[r[3] for r in rows])
    return pool, check


# Both ways of finding failing pages: tensor ops (the reference) and the fused kernel.
GUARD_IMPLEMENTATIONS = {"torch": lambda: None, "kernel": cpu_ops}


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_guard_kernel_and_tensor_reference_flag_the_same_pages(data):
    """Arbitrary pool fields and page tables, ids outside the pool, empty tables and any
    read_before included: the kernel's check and the tensor version agree cell for cell."""
    from isoserve.kv.guard import failing_pages_torch
    page_size = data.draw(st.sampled_from([1, 2, 4, 16]))
    num_pages = data.draw(st.integers(1, 12))
    pool = KVPool(CONFIG, num_pages, page_size, torch.float32)
    small = st.integers(0, 3)
    pool.writer[:] = torch.tensor(data.draw(st.lists(small, min_size=num_pages, max_size=num_pages)))
    pool.epoch[:] = torch.tensor(data.draw(st.lists(small, min_size=num_pages, max_size=num_pages)))
    pool.filled[:] = torch.tensor(data.draw(st.lists(st.integers(0, page_size), min_size=num_pages,
                                                     max_size=num_pages)), dtype=torch.int32)
    rows = data.draw(st.integers(1, 4))
    tables = [data.draw(st.lists(st.integers(-2, num_pages + 1), max_size=5)) for _ in range(rows)]
    check = ReadCheck(tags=[data.draw(small) for _ in range(rows)], tables=tables,
                      epochs=[[data.draw(small) for _ in t] for t in tables],
                      read_before=[data.draw(st.integers(-3, 6 * page_size)) for _ in range(rows)])
    expected = sorted(failing_pages_torch(pool, check))
    found = sorted(tuple(p) for p in cpu_ops().check_reads(
        pool.writer, pool.epoch, pool.filled, check.tags, check.tables, check.epochs,
        check.read_before, page_size))
    assert found == expected


@pytest.mark.parametrize("impl", GUARD_IMPLEMENTATIONS)
@settings(max_examples=300, deadline=None)
@given(batch=guarded_batch(), data=st.data())
def test_guard_passes_sequences_reading_their_own_writes(impl, batch, data):
    pool, check = _build(*batch, data)
    assert check_reads(pool, check, GUARD_IMPLEMENTATIONS[impl]()) == []


@pytest.mark.parametrize("impl", GUARD_IMPLEMENTATIONS)
@settings(max_examples=400, deadline=None)
@given(batch=guarded_batch(), data=st.data(),
       kind=st.sampled_from(["writer", "pool_epoch", "expected_epoch", "filled", "overread", "outside"]))
def test_guard_fails_exactly_the_row_whose_read_changed(impl, batch, data, kind):
    page_size, specs = batch
    pool, check = _build(page_size, specs, data)
    needed = lambda row, col: max(0, min(page_size, int(check.read_before[row]) - col * page_size))
    valid_cells = [(r, c) for r in range(len(specs)) for c in range(len(check.tables[r]))]
    if kind in ("writer", "filled"):
        cells = [(r, c) for r, c in valid_cells if needed(r, c) > 0]
    elif kind == "overread":  # read one slot or more past what the row wrote, within its pages
        cells = [(r, 0) for r, (w, _, n) in enumerate(specs) if w < n * page_size]
    else:
        cells = valid_cells
    assume(cells)
    row, col = data.draw(st.sampled_from(cells))
    page = check.tables[row][col]
    tag = check.tags[row]
    if kind == "writer":
        others = [int(t) for t in check.tags if int(t) != tag] + [UNWRITTEN, 999]
        pool.writer[page] = data.draw(st.sampled_from(others))
    elif kind == "pool_epoch":  # the page was released and allocated again since
        pool.epoch[page] += data.draw(st.integers(1, 5))
    elif kind == "expected_epoch":
        check.epochs[row][col] += data.draw(st.sampled_from([-1, 1, 7]))
    elif kind == "outside":  # a page id that is not in the pool at all
        page = data.draw(st.sampled_from([-1, pool.num_pages, pool.num_pages + 5]))
        check.tables[row][col] = page
    elif kind == "filled":
        pool.filled[page] = data.draw(st.integers(0, needed(row, col) - 1))
    else:
        written, _, n = specs[row]
        check.read_before[row] = data.draw(st.integers(written + 1, n * page_size))
        page = None
    violations = check_reads(pool, check, GUARD_IMPLEMENTATIONS[impl]())
    assert [v.row for v in violations] == [row]
    v = violations[0]
    assert v.expected_tag == tag
    if page is not None:
        assert v.pages == [page]
    else:
        assert v.pages and all(p in check.tables[row] for p in v.pages)
    # The kernel and the reference name the same pages with the same facts.
    assert violations == check_reads(pool, check, None)


# ---- the engine keeps page metadata right and returns every page ----------------------------

TINY_POOL = dict(kv_tokens=64, page_size=4, max_batched_tokens=16, max_num_seqs=4)


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", **TINY_POOL)


def _assert_page_metadata(engine) -> None:
    """Every running sequence's pages: its epochs, its writer over exactly its computed tokens,
    UNWRITTEN beyond; no page shared; waiting sequences hold nothing."""
    pool, size = engine.pool, engine.pool.page_size
    held = []
    for seq in engine.scheduler.running:
        assert len(seq.pages) == len(seq.page_epochs) >= -(-seq.num_computed // size)
        for j, (page, epoch) in enumerate(zip(seq.pages, seq.page_epochs)):
            filled = max(0, min(size, seq.num_computed - j * size))
            assert engine.allocator.is_allocated(page) and int(pool.epoch[page]) == epoch
            assert int(pool.filled[page]) == filled
            assert int(pool.writer[page]) == (seq.tag if filled else UNWRITTEN)
        held += seq.pages
    for seq in engine.scheduler.waiting:
        assert seq.pages == [] and seq.num_computed == 0
    assert len(held) == len(set(held)) == engine.allocator.num_used


def test_a_growing_sequence_takes_the_page_after_its_last_where_it_is_free(tiny_llama_dir):
    """Three prompts of one page each take pages 0, 1 and 2; the second ends at its first token
    and gives page 1 back. The first then grows into page 1, after its page 0, not into the
    oldest free page (3), which the third, after its page 2, takes: each sequence's pages one
    after another in the pool, where the decode kernel's reads follow them."""
    engine = LLM(str(tiny_llama_dir), dtype="float32", **TINY_POOL).engine
    for rid, max_tokens in (("a", 6), ("b", 1), ("c", 6)):
        engine.add_request(rid, [5, 6, 7, 8], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    engine.step()  # the three prompts; "b" ends with its first token
    assert [engine.requests[r].pages for r in ("a", "c")] == [[0], [2]] and "b" not in engine.requests
    engine.step()  # each writes its fifth token: a page more
    assert [engine.requests[r].pages for r in ("a", "c")] == [[0, 1], [2, 3]]


@settings(max_examples=200, deadline=None)
@given(page_size=st.integers(1, 4), num_pages=st.integers(4, 16), budget=st.integers(1, 24),
       data=st.data())
def test_scheduler_fills_its_token_budget_through_preemptions(page_size, num_pages, budget, data):
    """The scheduler alone, steps simulated: every step schedules at most the token budget, each
    running sequence at most once, and leaves budget unused only where every running sequence
    has all its uncomputed tokens scheduled and the next waiting one lacks pages, also in steps
    where a preemption took back a chunk scheduled earlier in that step."""
    capacity = num_pages * page_size
    lengths = data.draw(st.lists(st.tuples(st.integers(1, capacity - 1), st.integers(1, 6)),
                                 min_size=1, max_size=8))
    pool = KVPool(CONFIG, num_pages, page_size, torch.float32)
    allocator = PageAllocator(pool)
    scheduler = Scheduler(allocator, page_size, max_num_seqs=8, max_batched_tokens=budget)
    for i, (prompt, new) in enumerate(lengths):
        new = min(new, capacity - prompt)  # each fits the pool alone, so all of them finish
        scheduler.add(Sequence(request_id=str(i), tag=i + 1, prompt_token_ids=[1] * prompt,
                               params=SamplingParams(max_tokens=new), arrival=i))
    preempting_steps = 0
    for _ in range(10_000):
        if not scheduler.has_work():
            break
        preemptions = scheduler.num_preemptions
        chunks = scheduler.schedule()
        preempting_steps += scheduler.num_preemptions > preemptions
        scheduled = sum(c.num_tokens for c in chunks)
        assert 0 < scheduled <= budget
        assert len({id(c.seq) for c in chunks}) == len(chunks)
        assert all(c.seq.status is Status.RUNNING and c.num_tokens <= c.seq.num_uncomputed for c in chunks)
        if scheduled < budget:  # budget left: nothing more could have been scheduled
            given_all = {id(c.seq) for c in chunks if c.num_tokens == c.seq.num_uncomputed}
            assert all(id(s) in given_all for s in scheduler.running)
            if scheduler.waiting and len(scheduler.running) < scheduler.max_num_seqs:
                head = scheduler.waiting[0]  # admission stopped for want of pages only
                n = min(head.num_uncomputed, budget - scheduled)
                assert -(-(head.num_computed + n) // page_size) > allocator.num_free
        for c in chunks:  # the step: KV computed, a token after each chunk that reaches the end
            seq = c.seq
            seq.num_computed += c.num_tokens
            if seq.num_computed == seq.num_tokens:
                seq.output_token_ids.append(1)
                if len(seq.output_token_ids) == seq.params.max_tokens:
                    seq.status = Status.FINISHED
                    scheduler.finish(seq)
                    allocator.free(seq.pages)
    assert not scheduler.has_work() and allocator.num_free == num_pages
    event(f"steps with a preemption: {min(preempting_steps, 3)}")


def test_a_preemption_in_a_step_gives_the_taken_chunk_budget_to_the_next_sequence():
    """B, the newest, is scheduled first (an older A was preempted once and so runs after it);
    A's next token needs a page and none is free, so B is preempted and its chunk taken back.
    The budget B's token held goes to what comes next: B again, from the queue, with 2 tokens."""
    pool = KVPool(CONFIG, 4, 2, torch.float32)
    allocator = PageAllocator(pool)
    scheduler = Scheduler(allocator, 2, max_num_seqs=8, max_batched_tokens=3)
    params = SamplingParams(max_tokens=4)
    a = Sequence(request_id="a", tag=1, prompt_token_ids=[1] * 4, params=params, arrival=0)
    b = Sequence(request_id="b", tag=2, prompt_token_ids=[1] * 3, params=params, arrival=1)
    for seq in (b, a):  # running in this order; each has a token to decode
        seq.pages, seq.page_epochs = allocator.allocate(2)
        seq.num_computed = seq.num_tokens
        seq.output_token_ids.append(1)
        scheduler.add_running(seq)
    assert allocator.num_free == 0
    chunks = scheduler.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in chunks] == [("a", 1), ("b", 2)]
    assert scheduler.num_preemptions == 1 and b.num_computed == 0 and len(a.pages) == 3


def _assert_idle(engine) -> None:
    assert engine.allocator.num_free == engine.pool.num_pages
    assert not engine.requests and not engine.scheduler.has_work()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 24), st.integers(0, 6)),
                         min_size=1, max_size=6),
       seed=st.integers(0, 2**16))
def test_engine_page_metadata_is_right_after_every_step(tiny_llm, requests, seed):
    engine = tiny_llm.engine
    limit_of = engine.prompt_limit
    gen = torch.Generator().manual_seed(seed)
    arrivals = sorted(((at, i, n, m) for i, (n, m, at) in enumerate(requests)), key=lambda r: r[0])
    step = 0
    unfinished: dict[str, int] = {}  # request id -> max_tokens
    while arrivals or engine.has_work():
        while arrivals and arrivals[0][0] <= step:
            _, i, n, m = arrivals.pop(0)
            rid = f"prop-{i}"
            ids = torch.randint(0, engine.model_config.vocab_size, (n,), generator=gen).tolist()
            params = SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
            if n > limit_of(m):  # prompt + max_tokens over the 64-token pool
                with pytest.raises(ContextLengthExceeded):
                    engine.add_request(rid, ids, params)
                continue
            engine.add_request(rid, ids, params)
            unfinished[rid] = m
        for out in engine.step():
            if out.finished:
                assert out.error is None and out.finish_reason == "length"
                assert out.num_output_tokens == unfinished.pop(out.request_id)
        _assert_page_metadata(engine)
        step += 1
    assert not unfinished
    _assert_idle(engine)


def test_no_page_leaks_after_batches_preemption_and_errors(tiny_llm):
    engine = tiny_llm.engine
    prompts = [[(7 * i + j) % 1000 + 3 for j in range(10 + 5 * i)] for i in range(6)]
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    before = engine.scheduler.num_preemptions
    first = tiny_llm.generate(prompts, greedy)
    assert engine.scheduler.num_preemptions > before, "the 64-token pool was meant to preempt"
    _assert_idle(engine)
    # Preemption recomputes: the same tokens as each request alone.
    assert [r.token_ids for r in first] == [tiny_llm.generate([p], greedy)[0].token_ids for p in prompts]
    _assert_idle(engine)
    # A batch refused because one prompt can never fit: the others were queued and are gone.
    with pytest.raises(ContextLengthExceeded):
        tiny_llm.generate(prompts[:3] + [list(range(3, 70))] + prompts[3:], greedy)
    _assert_idle(engine)
    # Sampled requests with stop conditions, mixed with greedy ones.
    sampled = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=3, stop=["e"])
    tiny_llm.generate(prompts, [sampled, greedy] * 3)
    _assert_idle(engine)


def test_abort_and_guard_violation_end_only_their_request_and_return_pages(tiny_llm):
    engine = tiny_llm.engine
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompts = {name: [(31 * k + 5 * j) % 900 + 3 for j in range(9)] for k, name in enumerate("abc")}
    alone = {name: tiny_llm.generate([ids], greedy)[0].token_ids for name, ids in prompts.items()}
    seqs = {name: engine.add_request(f"g-{name}", ids, greedy) for name, ids in prompts.items()}
    outputs: dict[str, list] = {name: [] for name in prompts}

    def run_step():
        for out in engine.step():
            outputs[out.request_id[2:]].append(out)
        _assert_page_metadata(engine)

    while not all(s.status is Status.RUNNING and s.num_computed > 0 for s in seqs.values()):
        run_step()
    violations = engine.stats.counters["guard_violations"]
    # KV that "a" has already computed now looks written by "b" (stale KV from another request).
    page = seqs["a"].pages[0]
    engine.pool.writer[page] = seqs["b"].tag
    assert engine.abort("g-c")
    run_step()
    assert seqs["a"].finished and isinstance(seqs["a"].error, KVIsolationViolation)
    assert str(page) in seqs["a"].error.message
    assert engine.stats.counters["guard_violations"] == violations + 1
    assert seqs["c"].finished and seqs["c"].finish_reason == "abort"
    while engine.has_work():
        run_step()
    assert outputs["a"][-1].finished and outputs["a"][-1].finish_reason == "error"
    assert outputs["c"][-1].finish_reason == "abort"
    b_tokens = [t for out in outputs["b"] for t in out.new_token_ids]
    assert b_tokens == alone["b"] and outputs["b"][-1].finish_reason == "length"
    _assert_idle(engine)
