"""The batched sampler (engine/sampler.py) on its own: the tokens it draws follow the
distribution temperature, top-k and top-p leave (top-p by the torch reference and by the CPU
kernel, tests/test_nucleus.py checking their nuclei; rows with neither by the torch ops and by
the CPU draw kernel, kernels/draw.cpp, which only those rows reach), never a token of
probability 0, the same token for the same seed wherever the row sits, and an error for a row
that is not a distribution. tests/test_sampling.py checks it end to end on a model.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from isoserve.engine import sampler
from isoserve.engine.nucleus import nucleus_weights
from isoserve.engine.sampler import BLOCK, TOP_K_WIDTHS, sample
from isoserve.kernels import cpu_ops
from isoserve.engine.sampling_params import SamplingParams
from isoserve.engine.sequence import Sequence
from tiny_models import HAS_AVX2, HAS_AVX512

# kernels/draw.cpp is built exactly where the CPU has AVX-512 (16 lanes) or AVX2 and FMA (8)
HAS_DRAW = HAS_AVX512 or HAS_AVX2

DRAWS = 4000


def _seqs(n: int, **params) -> list[Sequence]:
    return [Sequence(f"r{i}", i, [1], SamplingParams(max_tokens=8, **params), 0) for i in range(n)]


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def _draw_counts(logits: torch.Tensor, draws: int = DRAWS, draw=None, **params) -> torch.Tensor:
    """How often each token came out of `draws` rows of the same logits, unseeded."""
    torch.manual_seed(0)
    tokens, _ = sample(logits.expand(draws, -1).contiguous(), _seqs(draws, **params), _argmax, nucleus_weights, draw)
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1])


def test_the_draw_kernel_is_built_where_the_cpu_has_avx512_or_avx2():
    """kernels/draw.cpp needs AVX-512, or AVX2 and FMA (-march=native): elsewhere the sampler's
    torch ops draw the plain rows, and the kernel refuses to run rather than return nothing."""
    kernels = cpu_ops()
    assert kernels.has_temperature_draw == HAS_DRAW
    if not kernels.has_temperature_draw:
        with pytest.raises(RuntimeError, match="AVX2 and FMA or AVX-512"):
            kernels.temperature_draw(torch.zeros(1, 4), torch.ones(1), torch.zeros(1, dtype=torch.float64))
    else:  # what the sampler never passes is refused, not drawn from
        with pytest.raises(RuntimeError, match="temperature is not positive"):
            kernels.temperature_draw(torch.zeros(1, 4), torch.zeros(1), torch.zeros(1, dtype=torch.float64))
        with pytest.raises(RuntimeError, match=r"u is not in \[0, 1\)"):
            kernels.temperature_draw(torch.zeros(1, 4), torch.ones(1), torch.ones(1, dtype=torch.float64))


# The plain rows' draw: the sampler's torch ops, and the CPU kernel where this CPU builds it.
DRAW_PATHS = ["torch ops"] + (["kernel"] if HAS_DRAW else [])


def _draw_path(name: str):
    return None if name == "torch ops" else cpu_ops().temperature_draw


def _expected(logits: torch.Tensor, temperature: float, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """The distribution in float64, the definition: temperature, top-k (ties with the k-th stay
    in), then the smallest prefix of the sorted probabilities whose mass reaches top_p."""
    scaled = logits.double() / temperature
    if top_k > 0:
        scaled = scaled.masked_fill(scaled < scaled.topk(top_k).values[-1], float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    values, order = probs.sort(descending=True)
    keep = values.cumsum(-1) - values < top_p
    keep[0] = True
    kept = torch.zeros_like(probs).scatter_(-1, order, values * keep)
    return kept / kept.sum()


def _assert_follows(counts: torch.Tensor, expected: torch.Tensor) -> None:
    """Every token drawn has probability > 0, and each token's count lies within 5 standard
    deviations of its expectation (a sampler off by a block, a token or a factor fails this)."""
    n = int(counts.sum())
    assert not bool(((counts > 0) & (expected == 0)).any()), "drew a token of probability 0"
    mean = expected * n
    sd = (expected * (1 - expected) * n).sqrt()
    worst = ((counts.double() - mean).abs() - 5 * sd - 1).max()
    assert worst <= 0, f"counts {counts.tolist()[:16]} against expected {mean.tolist()[:16]}"


def _spread_logits(vocab: int, likely: dict[int, float]) -> torch.Tensor:
    """-inf everywhere (probability 0) but at the given tokens, which hold these logits."""
    logits = torch.full((1, vocab), float("-inf"))
    for token, value in likely.items():
        logits[0, token] = value
    return logits


@pytest.mark.parametrize("path", DRAW_PATHS)
# Within a block, whole blocks, a padded last block; 1003 also ends in a partial vector after
# whole ones (3 logits of the kernel's 8 lanes on AVX2, 11 of its 16 on AVX-512) holding the
# two likely tokens vocab - 2 and vocab - 1.
@pytest.mark.parametrize("vocab", [7, BLOCK * 3, 1000, 1003])
def test_draws_follow_softmax_over_tokens_in_different_blocks(vocab, path):
    likely = {0: 0.0, 1: 1.0, vocab // 2: 0.5, vocab - 2: 1.5, vocab - 1: -0.5}
    logits = _spread_logits(vocab, likely)
    for temperature in (1.0, 0.5):
        _assert_follows(_draw_counts(logits, draw=_draw_path(path), temperature=temperature),
                        _expected(logits[0], temperature))


@pytest.mark.parametrize("path", DRAW_PATHS)
def test_a_bfloat16_row_is_sampled_from_its_float32_values(path):
    logits = (torch.randn(1, 3 * BLOCK, generator=torch.Generator().manual_seed(1)) * 2).to(torch.bfloat16)
    _assert_follows(_draw_counts(logits, draw=_draw_path(path), temperature=0.7), _expected(logits[0].float(), 0.7))


def _plain_draw(path: str, logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The rows' tokens at targets u by one draw path (the torch ops as the sampler runs them)."""
    if path == "kernel":
        return cpu_ops().temperature_draw(logits, temperature, u)
    return sampler._inverse_cdf(torch.softmax(logits / temperature[:, None], -1), u)


@pytest.mark.parametrize("path", DRAW_PATHS)
def test_the_draw_takes_the_token_whose_span_holds_the_target(path):
    """32 rows of a 49,152-token vocabulary (a third of the logits -inf), 20 draws each at seeded
    targets: every token taken is right to ~1e-7 of the exact float64 distribution (the target
    falls in its span), never a -inf logit, the same for a row drawn alone, and the kernel's
    token is the torch ops' in at least 99.9% of draws (here all 640: a rounding's difference
    would have to land within ~1e-7 of a boundary)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(32, 49152, generator=g) * 3
    logits[:, ::3] = float("-inf")
    temperature = torch.rand(32, generator=g) * 1.5 + 0.2
    exact = torch.softmax(logits.double() / temperature.double()[:, None], -1).cumsum(-1)
    agree = 0
    for _ in range(20):
        u = torch.rand(32, generator=g, dtype=torch.float64)
        tokens = _plain_draw(path, logits, temperature, u)
        agree += int((tokens == _plain_draw("torch ops", logits, temperature, u)).sum())
        assert bool(torch.isfinite(logits.gather(1, tokens[:, None])).all())
        end = exact.gather(1, tokens[:, None])[:, 0]
        start = torch.where(tokens > 0, exact.gather(1, (tokens - 1).clamp(min=0)[:, None])[:, 0], 0.0)
        assert bool(((start - 1e-7 <= u) & (u < end + 1e-7)).all())
        alone = _plain_draw(path, logits[7:8].clone(), temperature[7:8].clone(), u[7:8].clone())
        assert int(alone[0]) == int(tokens[7])
    assert agree >= 0.999 * 20 * 32


def test_only_rows_with_neither_top_k_nor_top_p_reach_the_draw():
    """A spy in the kernel's place, drawing as the torch ops do: it gets exactly the plain rows
    (top_k 0, -1 or the whole vocabulary, top_p 1), in order, with their temperatures; the
    greedy, top-p, masked top-k and candidate top-k rows go their own ways."""
    vocab = 1000
    params = [dict(temperature=0), dict(temperature=1.0), dict(temperature=1.0, top_p=0.8),
              dict(temperature=0.7, top_k=300), dict(temperature=0.9, top_k=10),
              dict(temperature=0.6, top_k=vocab), dict(temperature=1.3, top_k=0), dict(temperature=0.8, top_k=-1)]
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(4))
    seen = []

    def spy(rows, temperature, u):
        seen.append((rows.clone(), temperature.clone()))
        return _plain_draw("torch ops", rows, temperature, u)

    seqs = [Sequence(f"r{i}", i, [1], SamplingParams(seed=i, **p), 0) for i, p in enumerate(params)]
    tokens, _ = sample(logits, seqs, _argmax, nucleus_weights, spy)
    [(rows, temperature)] = seen
    plain = [1, 5, 6, 7]
    assert torch.equal(rows, logits[plain])
    assert temperature.tolist() == pytest.approx([params[r]["temperature"] for r in plain])
    # The same tokens as with no draw at all: the spy draws as the torch ops do.
    assert tokens == sample(logits, seqs, _argmax, nucleus_weights, None)[0]


@pytest.mark.parametrize("path", DRAW_PATHS)
def test_the_draw_at_the_ends_of_the_mass(path):
    """u = 0 takes the first token of any weight; u at its largest (1 - 2^-53) the last, not the
    -inf logits after it, whose blocks add nothing to the running sum."""
    logits = torch.full((2, 1000), float("-inf"))
    logits[:, 3], logits[:, 600] = 0.5, 1.0
    u = torch.tensor([0.0, 1 - 2.0**-53], dtype=torch.float64)
    assert _plain_draw(path, logits, torch.ones(2), u).tolist() == [3, 600]


def test_top_k_keeps_the_k_most_likely_and_ties_with_the_kth():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0, 2.5, -1.0]])
    counts = _draw_counts(logits, temperature=1.0, top_k=3)
    _assert_follows(counts, _expected(logits[0], 1.0, top_k=3))
    assert set(counts.nonzero().flatten().tolist()) == {0, 2, 3, 5}  # 2.0 twice: both stay


@pytest.mark.parametrize("top_k,top_p", [(10, 1.0), (10, 0.6), (100, 1.0), (100, 0.9)])
def test_a_small_top_k_is_drawn_from_its_candidates_as_from_the_whole_vocabulary(top_k, top_p):
    """k below a candidate width (TOP_K_WIDTHS): drawn among the most likely tokens only, with
    the distribution the masked vocabulary gives, in float32 and in bfloat16 (ties abound)."""
    assert top_k < TOP_K_WIDTHS[0] or top_k < TOP_K_WIDTHS[1]
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(1, 1000, generator=torch.Generator().manual_seed(top_k)) * 1.5).to(dtype)
        expected = _expected(logits[0].float(), 0.8, top_k=top_k, top_p=top_p)
        _assert_follows(_draw_counts(logits, temperature=0.8, top_k=top_k, top_p=top_p), expected)


def test_ties_with_the_kth_value_past_the_candidates_are_drawn_too():
    """300 tokens share the 5th-largest logit: the 64 candidates cannot hold them, so the row is
    drawn over the whole vocabulary, every tie allowed."""
    logits = torch.full((1, 2000), -10.0)
    logits[0, :4] = torch.tensor([3.0, 2.5, 2.0, 1.5])
    logits[0, 1000:1300] = 1.0
    counts = _draw_counts(logits, temperature=1.0, top_k=5)
    _assert_follows(counts, _expected(logits[0], 1.0, top_k=5))
    assert int((counts[1000:1300] > 0).sum()) > TOP_K_WIDTHS[0]


def _nucleus_logits(vocab: int, size: int) -> torch.Tensor:
    """A row whose 0.9-nucleus holds most of `size` likely tokens: they hold ~92% of the mass,
    each a little less likely than the one before (no ties: tests/test_nucleus.py checks how a
    prefix cuts through them), the rest spread thinly, in shuffled positions."""
    logits = torch.zeros(vocab, dtype=torch.float64)
    logits[:size] = math.log(0.92 / size) - math.log(0.08 / (vocab - size)) + torch.linspace(0.3, 0, size)
    return logits[torch.randperm(vocab, generator=torch.Generator().manual_seed(size))][None].float()


@pytest.mark.parametrize("size", [40, 1000, 6000])
@pytest.mark.parametrize("nucleus", ["reference", "kernel"])
def test_top_p_draws_from_the_smallest_prefix(size, nucleus):
    """Nuclei of a few to thousands of tokens, by the torch reference and by the CPU kernel
    (tests/test_nucleus.py checks the nuclei themselves)."""
    find = nucleus_weights if nucleus == "reference" else cpu_ops().nucleus_rows
    logits = _nucleus_logits(8192, size)
    expected = _expected(logits[0], 1.0, top_p=0.9)
    assert 0.8 * size < int((expected > 0).sum()) < size
    # The prefix ends clear of top_p (float32 and float64 running sums agree on where).
    values = torch.softmax(logits[0].double(), -1).sort(descending=True).values.cumsum(-1)
    assert float((values - 0.9).abs().min()) > 1e-5
    draws = 2000 if size > 1000 else DRAWS
    torch.manual_seed(0)
    tokens, _ = sample(logits.expand(draws, -1).contiguous(), _seqs(draws, temperature=1.0, top_p=0.9), _argmax, find)
    counts = torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1])
    assert not bool(((counts > 0) & (expected == 0)).any())
    if size == 40:
        _assert_follows(counts, expected)
    else:  # too many tokens to count each: the drawn ones spread over the nucleus
        assert int((counts > 0).sum()) > 0.5 * min(int((expected > 0).sum()), int(counts.sum()))


def test_the_kernel_and_the_reference_draw_the_same_tokens():
    logits = torch.cat([_nucleus_logits(8192, 6000), _nucleus_logits(8192, 40), _nucleus_logits(8192, 1000)])
    seqs = [Sequence(f"r{i}", i, [1], SamplingParams(temperature=t, top_p=p, seed=i), 0)
            for i, (t, p) in enumerate([(1.0, 0.9), (0.7, 0.5), (1.3, 0.95)])]
    for _ in range(20):
        by_reference = sample(logits, seqs, _argmax, nucleus_weights)[0]
        assert sample(logits, seqs, _argmax, cpu_ops().nucleus_rows)[0] == by_reference
        for seq in seqs:
            seq.output_token_ids.append(0)  # the next token's seed


def test_rows_of_different_parameters_and_widths_in_one_batch():
    """Each row is drawn with its own parameters, whatever path its neighbours take."""
    logits = torch.cat([_nucleus_logits(8192, 6000), _nucleus_logits(8192, 40),
                        _spread_logits(8192, {5: 0.0, 4000: 1.0}), _nucleus_logits(8192, 1000)])
    params = [dict(temperature=1.0, top_p=0.9), dict(temperature=1.0, top_p=0.9), dict(temperature=0),
              dict(temperature=0.8, top_k=1000)]
    seqs = [Sequence(f"r{i}", i, [1], SamplingParams(**p), 0) for i, p in enumerate(params)]
    torch.manual_seed(0)
    for _ in range(50):
        tokens, _ = sample(logits, seqs, _argmax)
        for row, (token, p) in enumerate(zip(tokens, params)):
            assert _expected(logits[row], p.get("temperature") or 1.0, p.get("top_k", -1),
                             p.get("top_p", 1.0))[token] > 0 or p["temperature"] == 0
        assert tokens[2] == 4000


@pytest.mark.parametrize("path", DRAW_PATHS)
@pytest.mark.parametrize("params", [
    [SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=0.9, top_p=0.8, seed=8)],
    [SamplingParams(temperature=1.0, top_k=20, seed=7), SamplingParams(temperature=0.9, top_k=200, top_p=0.8, seed=8)],
    [SamplingParams(temperature=0.6, seed=7), SamplingParams(temperature=1.2, top_k=3000, seed=8)],
])
def test_a_seed_draws_the_same_token_alone_and_in_any_batch(params, path):
    draw = _draw_path(path)
    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(3))
    alone = [sample(logits[i:i + 1], [Sequence("a", 0, [1], p, 0)], _argmax, nucleus_weights, draw)[0][0]
             for i, p in zip((0, 1), params)]
    others = _seqs(4, temperature=1.0)
    torch.manual_seed(123)
    mixed, _ = sample(torch.cat([logits[2:4], logits[0:1], logits[4:6], logits[1:2]]),
                      others[:2] + [Sequence("a", 0, [1], params[0], 0)] + others[2:]
                      + [Sequence("b", 0, [1], params[1], 0)], _argmax, nucleus_weights, draw)
    assert [mixed[2], mixed[5]] == alone


@pytest.mark.parametrize("path", DRAW_PATHS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "all -inf"])
def test_a_row_that_is_no_distribution_is_refused(bad, path):
    logits = torch.zeros(2, 300)
    if bad == "all -inf":
        logits[1] = float("-inf")
    else:
        logits[1, 17] = bad
    with pytest.raises(ValueError, match="cannot sample"):
        sample(logits, _seqs(2, temperature=1.0), _argmax, nucleus_weights, _draw_path(path))


@settings(max_examples=200, deadline=None)
@given(weights=st.lists(st.one_of(st.just(0.0), st.floats(1e-30, 1.0)), min_size=1, max_size=700),
       u=st.floats(0.0, 1.0, exclude_max=True))
@example(weights=[1.0, 3.2307932869470025e-10], u=0.9999999999999999)  # the 3e-10 lost in its block's sum
def test_inverse_cdf_takes_the_position_whose_span_holds_the_target(weights, u):
    w = torch.tensor([weights], dtype=torch.float32)
    if not bool((w > 0).any()):
        with pytest.raises(ValueError):
            sampler._inverse_cdf(w, torch.tensor([u], dtype=torch.float64))
        return
    pos = int(sampler._inverse_cdf(w, torch.tensor([u], dtype=torch.float64))[0])
    assert weights[pos] > 0  # never a position of weight 0, even where rounding ends a block
    running = w[0].double().cumsum(0)
    target = u * float(running[-1])
    before = float(running[pos - 1]) if pos else 0.0
    # Blocks are summed in float32 (to ~1e-7 of the block: 1 + 3e-10 is 1), the running sum
    # inside a block in float64: the two round apart by up to that much.
    slack = 1e-6 * float(running[-1])
    assert before - slack <= target < float(running[pos]) + slack
