"""Top-p nuclei (engine/nucleus.py, kernels/nucleus.cpp): each row keeps the smallest prefix of
its probabilities sorted descending (equal ones in position order) whose mass reaches top_p,
checked against exact rational sums; the CPU kernel gives the torch reference's bits; a row
that is no distribution keeps nothing; the kernel refuses what it cannot read.
"""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

from isoserve.engine.nucleus import nucleus_weights
from isoserve.kernels import cpu_ops

VOCAB = 49_152  # the default model's


@pytest.fixture(scope="module")
def kernel():
    # No skip: the suite runs where `make install` built the kernels; failing to build is a defect.
    return cpu_ops().nucleus_rows


def _exact_nucleus(row: list[float], top_p: float) -> tuple[set[int], Fraction]:
    """The positions the definition keeps, in exact arithmetic, and how close top_p came to a
    prefix's mass (rounding may decide a prefix that ends within a hair of top_p)."""
    order = sorted(range(len(row)), key=lambda j: (-row[j], j))
    p, before, kept, nearest = Fraction(top_p), Fraction(0), set(), None
    for rank, j in enumerate(order):
        if rank and before >= p:
            break
        kept.add(j)
        before += Fraction(row[j])
        gap = abs(before - p)
        nearest = gap if nearest is None else min(nearest, gap)
    return {j for j in kept if row[j] > 0}, nearest


def _kept(weights: torch.Tensor, probs: torch.Tensor) -> set[int]:
    assert torch.equal(weights[weights > 0], probs[weights > 0])  # a kept token keeps its value
    return set(weights.nonzero().flatten().tolist())


def _distributions() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, VOCAB, generator=g) * 2.5
    sparse = torch.where(torch.rand(4, 1000, generator=g) < 0.9, float("-inf"), torch.randn(4, 1000, generator=g))
    return {
        "spread": torch.softmax(logits, -1),                    # nuclei of thousands of tokens
        "peaked": torch.softmax(logits * 4, -1),                 # of a few
        "uniform": torch.full((3, VOCAB), 1 / VOCAB),            # one key holds every token
        "ties": torch.softmax(torch.randint(0, 4, (4, VOCAB), generator=g).float(), -1),
        "zeros": torch.softmax(sparse, -1),                      # most tokens of probability 0
        "tiny": torch.softmax(torch.randn(5, 3, generator=g), -1),
    }


@pytest.mark.parametrize("top_p", [1e-30, 0.25, 0.5, 0.9, 0.95, 0.999, 1.0])
def test_each_row_keeps_its_smallest_sorted_prefix_reaching_top_p(kernel, top_p):
    for name, probs in _distributions().items():
        p = torch.full((len(probs),), top_p)
        weights = nucleus_weights(probs, p)
        assert torch.equal(kernel(probs, p), weights), name
        for row in range(len(probs)):
            want, nearest = _exact_nucleus(probs[row].tolist(), float(p[row]))  # top_p as float32
            if nearest is not None and nearest < Fraction(1, 10**12):
                continue  # a prefix ends within rounding of top_p: either answer is honest
            assert _kept(weights[row], probs[row]) == want, (name, row)


def test_ties_at_the_edge_go_in_position_order(kernel):
    probs = torch.tensor([[0.1, 0.2, 0.2, 0.2, 0.2, 0.1]])
    uniform = torch.full((1, 1000), 1 / 1024)  # one key, 1000 ties: the first 256 reach a quarter
    for find in (nucleus_weights, kernel):
        for top_p, kept in ((0.2, {1}), (0.3, {1, 2}), (0.55, {1, 2, 3}), (0.85, {1, 2, 3, 4, 0})):
            assert _kept(find(probs, torch.tensor([top_p]))[0], probs[0]) == kept
        assert _kept(find(uniform, torch.tensor([0.25]))[0], uniform[0]) == set(range(256))


def test_the_most_likely_token_always_stays(kernel):
    probs = torch.softmax(torch.randn(4, 500, generator=torch.Generator().manual_seed(1)), -1)
    # Below every probability: float32's smallest, and 0, which is what a request's top_p of
    # 1e-46 becomes in float32 (it once emptied the nucleus).
    p = torch.tensor([1e-45, 1e-45, 0.0, 0.0])
    for weights in (nucleus_weights(probs, p), kernel(probs, p)):
        assert (weights > 0).sum(-1).tolist() == [1] * 4
        assert torch.equal(weights.argmax(-1), probs.argmax(-1))


def test_a_top_p_above_the_rows_total_keeps_every_likely_token(kernel):
    """As where a row's float32 probabilities sum to a little less than a top_p near 1."""
    probs = torch.full((1, 3), 0.333333)
    probs[0, 2] = 0.0  # the total is 0.666666, and a token of probability 0 stays out
    for weights in (nucleus_weights(probs, torch.tensor([1.0])), kernel(probs, torch.tensor([1.0]))):
        assert _kept(weights[0], probs[0]) == {0, 1}


def test_every_row_takes_its_own_top_p_and_keys(kernel):
    probs = torch.cat([d[:2] for d in _distributions().values() if d.shape[-1] == VOCAB])
    p = torch.linspace(0.05, 1.0, len(probs))
    weights = nucleus_weights(probs, p)
    assert torch.equal(kernel(probs, p), weights)
    for row in range(len(probs)):
        alone = nucleus_weights(probs[row:row + 1], p[row:row + 1])
        assert torch.equal(alone[0], weights[row])


def test_a_keys_mass_is_exact_so_positions_do_not_change_the_nucleus(kernel):
    """The kernel sums a key's masses in any order (two tables, even and odd positions): a key's
    float32 values are multiples of one unit, so their float64 sums are exact (nucleus.cpp).
    A row of 49,152 distinct values in the key [0.5, 0.5625), 7 above it and 1,000 distinct
    small ones in [2^-7, 1.125 * 2^-7), float32's steps of 2^-30 there: with the edge among the
    small ones, the big key's whole
    mass sits in the sum before the edge, where a sum that rounds (float32's would drift by
    ~0.1 there, ten small tokens) would move the edge. Any order of the tokens gives the same
    nucleus, the reference's bits, and the exact one. 50,159 tokens are no multiple of the
    kernel's 16-wide vectors, so the last ones take its scalar tail."""
    g = torch.Generator().manual_seed(5)
    big = 0.5 + torch.randperm(1 << 20, generator=g)[:VOCAB].double() * 2.0**-24   # exact in float32
    above = torch.tensor([0.9, 0.8, 0.7, 0.65, 0.6, 0.59, 0.58], dtype=torch.float64)
    small = 2.0**-7 + torch.randperm(1 << 20, generator=g)[:1000].double() * 2.0**-30
    row = torch.cat([big, above, small]).float()[None]
    order = torch.randperm(row.shape[-1], generator=g)
    before_small = float(big.sum() + above.sum())
    for share in (0.1, 0.5, 0.9):
        p = torch.tensor([before_small + share * float(small.sum())])  # unnormalized weights
        weights = kernel(row, p)
        assert torch.equal(weights, nucleus_weights(row, p))
        assert torch.equal(kernel(row[:, order], p), weights[:, order])
        want, nearest = _exact_nucleus(row[0].tolist(), float(p[0]))
        assert nearest > Fraction(1, 10**9) and _kept(weights[0], row[0]) == want


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_row_that_is_no_distribution_keeps_nothing(kernel, bad):
    probs = torch.tensor([[0.5, 0.25, 0.25], [0.5, bad, 0.5], [0.0, 0.0, 0.0]])
    p = torch.full((3,), 0.9)
    for weights in (nucleus_weights(probs, p), kernel(probs, p)):
        assert torch.equal(weights[1:], torch.zeros(2, 3))
        assert _kept(weights[0], probs[0]) == {0, 1, 2}


def test_negative_zero_is_a_probability_of_zero(kernel):
    probs = torch.tensor([[0.75, -0.0, 0.25, 0.0]])
    for weights in (nucleus_weights(probs, torch.tensor([1.0])), kernel(probs, torch.tensor([1.0]))):
        assert _kept(weights[0], probs[0]) == {0, 2}


@settings(max_examples=300, deadline=None)
@given(row=st.lists(st.one_of(st.sampled_from([0.0, -0.0, 0.125, 0.25, 0.5, 1e-45, 1e-40]),
                              st.floats(2.0**-40, 1.0, width=32), st.floats(0.0, 2.0**-120, width=32)),
                    min_size=1, max_size=300),
       top_p=st.floats(2.0**-20, 1.0, width=32))
def test_any_weights_and_top_p(kernel, row, top_p):
    """Unnormalized weights too (keys and sums do not need a total of 1), with zeros, -0.0 and
    subnormals, whose key is the lowest."""
    probs = torch.tensor([row], dtype=torch.float32)
    assume(float(probs.sum()) > 0)
    p = torch.tensor([top_p], dtype=torch.float32)
    weights = nucleus_weights(probs, p)
    assert torch.equal(kernel(probs, p), weights)
    want, nearest = _exact_nucleus(probs[0].tolist(), float(p[0]))
    total = sum(Fraction(v) for v in probs[0].tolist())
    assume(nearest is None or nearest > Fraction(1, 10**9))
    assume(abs(total - Fraction(float(p[0]))) > Fraction(1, 10**9))  # top_p not within rounding of the total
    assert _kept(weights[0], probs[0]) == want


def test_a_nan_top_p_is_refused(kernel):
    probs, p = torch.tensor([[0.5, 0.3, 0.2]]), torch.tensor([float("nan")])
    with pytest.raises(ValueError, match="NaN"):
        nucleus_weights(probs, p)
    with pytest.raises(RuntimeError, match="NaN"):
        kernel(probs, p)


@pytest.mark.parametrize("probs,top_p,message", [
    (torch.zeros(2, 8, dtype=torch.float64), torch.ones(2), "probs"),
    (torch.zeros(8, 2).t(), torch.ones(2), "probs"),
    (torch.zeros(2, 8), torch.ones(3), "top_p"),
    (torch.zeros(2, 8), torch.ones(2, dtype=torch.float64), "top_p"),
])
def test_the_kernel_refuses_what_it_cannot_read(kernel, probs, top_p, message):
    with pytest.raises(RuntimeError, match=message):
        kernel(probs, top_p)


def test_the_kernel_refuses_rows_too_long_for_exact_key_masses(kernel):
    # Past 2^29 tokens a key's float64 mass could round, and then depend on the order of the
    # additions. torch.empty leaves the 2 GiB untouched: the length is refused before any read.
    probs = torch.empty(1, (1 << 29) + 1)
    with pytest.raises(RuntimeError, match="at most 2"):
        kernel(probs, torch.ones(1))
