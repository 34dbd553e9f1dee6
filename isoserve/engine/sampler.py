"""Token selection: greedy rows in one vectorized argmax, sampled rows together in a few batched
tensor ops, each with its own temperature, top-k, top-p and seed. Logprobs are those of the
model's distribution (before temperature, top-k and top-p), as OpenAI-compatible servers
report them.

A sampled row draws one uniform number u (from its seeded generator, else torch's global one)
and takes the token where u * (its distribution's mass) falls in the running sum of the
probabilities: inverse-CDF sampling, which is what torch.multinomial does for one sample, but
for every row at once. One multinomial call per row took ~0.87 ms on a 49,152-token vocabulary
(and a top-p sort of the whole vocabulary 2.1 ms more), 28 ms of a 46 ms batch-32 decode step
at temperature 1; the batched draw takes ~2 ms for the 32 rows (docs/benchmarks.md). Top-p
finds each row's nucleus without sorting its vocabulary (engine/nucleus.py). Rows with neither
top-k nor top-p, OpenAI's defaults, go to one CPU kernel where it is built (kernels/draw.cpp:
the same draw, each row read from memory once, ~1 ms a batch-32 step less).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from isoserve.engine.nucleus import nucleus_weights
from isoserve.engine.sequence import Sequence, TokenLogprob

# The running sum is taken in two levels, block sums then the sums inside the chosen block, both
# in float64: a float32 running sum over a whole vocabulary drifts by ~1e-5 (and up to 3e-3),
# enough to misweight every token whose probability is that small.
BLOCK = 256
# A row with a top-k below one of these is drawn from that many most likely tokens (its k and
# their ties) without a softmax over the whole vocabulary: a row's width follows from its own k,
# so its draw never depends on the rows beside it.
TOP_K_WIDTHS = (64, 256)

# probs [R, V] float32 on the CPU, top_p [R] float32 -> the probabilities inside each nucleus
# (engine/nucleus.py's reference, or the CPU kernel that gives its bits).
Nucleus = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# logits [R, V] float32, temperature [R] float32, u [R] float64, all contiguous on the CPU ->
# [R] tokens of softmax(logits / temperature) at u of each row's mass, -1 for a row that is no
# distribution (kernels/draw.cpp): the rows with neither top-k nor top-p, without the torch
# ops' passes over the whole block. Its weights round differently from torch's softmax, so a
# draw within ~1e-7 of a boundary between two tokens may take the other.
Draw = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _row_generator(seq: Sequence) -> torch.Generator | None:
    """A seeded request draws token i from a generator keyed by (seed, i), so the same seed gives
    the same tokens wherever each token is sampled (a prefill worker samples the first one)."""
    if seq.params.seed is None:
        return None
    g = torch.Generator()
    g.manual_seed((seq.params.seed * 1_000_003 + len(seq.output_token_ids)) % (2**63))
    return g


def _uniforms(seqs: list[Sequence]) -> torch.Tensor:
    """[R] float64 in [0, 1): a seeded row's from its own generator (so its draw does not depend
    on the rows beside it), the others' from torch's global generator."""
    u = torch.rand(len(seqs), dtype=torch.float64)
    for row, seq in enumerate(seqs):
        g = _row_generator(seq)
        if g is not None:
            u[row] = torch.rand((), generator=g, dtype=torch.float64)
    return u


def _temperatures(seqs: list[Sequence]) -> torch.Tensor:
    """[R, 1] float32: each row's temperature, to divide its logits by (bfloat16 / float32 is
    float32, so the division is also the one pass from the model's dtype)."""
    return torch.tensor([s.params.temperature for s in seqs], dtype=torch.float32)[:, None]


def _scaled_logits(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """[R, V] float32 logits / temperature (a new tensor), -inf outside each row's top-k (ties
    with the k-th value stay in)."""
    x = torch.div(logits, _temperatures(seqs))
    vocab = x.shape[-1]
    ks = [s.params.top_k for s in seqs]
    rows = [r for r, k in enumerate(ks) if 0 < k < vocab]
    if rows:
        top = torch.topk(x[rows], max(ks[r] for r in rows), dim=-1).values
        kth = top.gather(1, torch.tensor([ks[r] - 1 for r in rows])[:, None])
        part = x[rows]
        x[rows] = part.masked_fill_(part < kth, float("-inf"))
    return x


def _top_k_width(k: int, vocab: int) -> int | None:
    """The candidates a row with top-k k is drawn from (TOP_K_WIDTHS), or None: the whole
    vocabulary. Strictly more than k, so a tie with the k-th value that runs to the last
    candidate shows (and that row goes the whole-vocabulary way)."""
    if k <= 0:
        return None
    return next((w for w in TOP_K_WIDTHS if k < w < vocab), None)


def _draw_top_k(logits: torch.Tensor, seqs: list[Sequence], width: int, u: torch.Tensor,
                nucleus: Nucleus) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose top-k fits in `width` candidates: ([R] tokens, [R] False where a tie with the
    k-th value may reach past the candidates; that row's token is to be drawn again the whole
    vocabulary's way). Temperature, top-k (its ties), softmax and top-p over the candidates only
    (the same nucleus as over the masked vocabulary; the candidates come sorted, so equal ones
    keep topk's order): the same distribution as over the masked vocabulary."""
    # The candidates by the logits as they are: dividing by a positive temperature keeps their
    # order, and only the candidates are then scaled (in float32, as the whole vocabulary would be).
    raw, ids = torch.topk(logits, width, dim=-1)
    values = torch.div(raw, _temperatures(seqs))
    kth = values.gather(1, torch.tensor([s.params.top_k - 1 for s in seqs])[:, None])
    complete = values[:, -1] < kth[:, 0]
    probs = torch.softmax(values.masked_fill_(values < kth, float("-inf")), dim=-1)
    # A row without top-p keeps every candidate (top_p 1 could cut a tail that rounding puts past 1).
    top_p = torch.tensor([s.params.top_p if s.params.top_p < 1.0 else float("inf") for s in seqs],
                         dtype=torch.float32)
    return ids.gather(1, _inverse_cdf(nucleus(probs, top_p), u)[:, None])[:, 0], complete


def _select(t: torch.Tensor, rows) -> torch.Tensor:
    """t's rows: a mask over them, or their ascending, distinct indices (a list or a tensor);
    t itself (no copy) where they are all of its rows."""
    if isinstance(rows, torch.Tensor) and rows.dtype == torch.bool:
        every = bool(rows.all())
    else:
        every = len(rows) == len(t)
    return t if every else t[rows]


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[R] positions: in each row of non-negative weights [R, W], the first position whose
    running sum exceeds u * the row's total. A position of weight 0 is never chosen."""
    rows, width = weights.shape
    if width % BLOCK:
        weights = F.pad(weights, (0, BLOCK - width % BLOCK))
    blocks = weights.view(rows, -1, BLOCK)
    # Each block summed in float32 (torch sums by a cascade: exact to ~1e-7 of the block), the
    # blocks in turn in float64.
    ends = blocks.sum(-1).double().cumsum(-1)  # [R, blocks]: mass up to each block's end
    total = ends[:, -1]
    if not bool(torch.isfinite(total).all() and (total > 0).all()):
        raise ValueError("cannot sample: a row's probabilities are not finite or sum to 0")
    target = (u * total)[:, None]
    block = torch.searchsorted(ends, target, right=True).clamp_(max=ends.shape[1] - 1)  # [R, 1]
    start = torch.where(block > 0, ends.gather(1, (block - 1).clamp_(min=0)), 0.0)
    chosen = blocks.gather(1, block[:, :, None].expand(rows, 1, BLOCK))[:, 0]  # [R, BLOCK]
    within = torch.searchsorted(chosen.double().cumsum(-1), target - start, right=True)
    # Rounding can put the target at the very end of its block (the block's sum and its running
    # sum round differently): that is the block's last token of positive weight.
    last = (BLOCK - 1) - (chosen.flip(-1) > 0).to(torch.uint8).argmax(-1, keepdim=True)
    within = torch.where(within >= BLOCK, last, within)
    return (block * BLOCK + within)[:, 0]


def _draw(logits: torch.Tensor, seqs: list[Sequence], nucleus: Nucleus, draw: Draw | None) -> torch.Tensor:
    """[R] tokens sampled from the rows of logits [R, V], one per sequence."""
    u = _uniforms(seqs)
    tokens = torch.empty(len(seqs), dtype=torch.long)
    widths = [_top_k_width(s.params.top_k, logits.shape[-1]) for s in seqs]
    rest = [r for r, w in enumerate(widths) if w is None]
    for width in sorted(set(widths) - {None}):
        rows = [r for r, w in enumerate(widths) if w == width]
        drawn, complete = _draw_top_k(_select(logits, rows), [seqs[r] for r in rows], width, u[rows], nucleus)
        tokens[rows] = drawn
        rest += [r for r, ok in zip(rows, complete.tolist()) if not ok]
    if draw is not None:  # the plain rows, neither top-k nor top-p, by the kernel
        vocab = logits.shape[-1]
        plain = [r for r in rest if seqs[r].params.top_p >= 1.0 and not 0 < seqs[r].params.top_k < vocab]
        if plain:
            plain.sort()
            tokens[plain] = _draw_plain(_select(logits, plain), [seqs[r] for r in plain], u[plain], draw)
            rest = list(set(rest) - set(plain))
    if rest:
        rest.sort()
        tokens[rest] = _draw_vocabulary(_select(logits, rest), [seqs[r] for r in rest], u[rest], nucleus)
    return tokens


def _draw_plain(logits: torch.Tensor, seqs: list[Sequence], u: torch.Tensor, draw: Draw) -> torch.Tensor:
    """[R] tokens of softmax(logits / temperature) by the kernel, which reads each row from
    memory once: sample() of a batch-32 decode step at temperature 1 took 0.9-1.1 ms against
    1.8-2.0 by the torch ops (docs/benchmarks.md, session 38)."""
    tokens = draw(logits.float().contiguous(), _temperatures(seqs)[:, 0].contiguous(), u.contiguous())
    if bool((tokens < 0).any()):
        raise ValueError("cannot sample: a row's probabilities are not finite or sum to 0")
    return tokens


def _draw_vocabulary(logits: torch.Tensor, seqs: list[Sequence], u: torch.Tensor,
                     nucleus: Nucleus) -> torch.Tensor:
    """[R] tokens from rows of logits [R, V] over the whole vocabulary: temperature, top-k by
    masking, one softmax, then the inverse CDF (top-p rows over their nuclei only)."""
    weights = torch.softmax(_scaled_logits(logits, seqs), dim=-1)
    top_p = torch.tensor([s.params.top_p for s in seqs], dtype=torch.float32)
    in_nucleus = top_p < 1.0
    if in_nucleus.all():
        weights = nucleus(weights, top_p)
    elif in_nucleus.any():  # the others keep their whole distribution (the nucleus is ~30 us a row)
        weights[in_nucleus] = nucleus(weights[in_nucleus], top_p[in_nucleus])
    return _inverse_cdf(weights, u)  # row by row: one call serves both kinds


def sample(logits: torch.Tensor, seqs: list[Sequence], argmax: Callable[[torch.Tensor], torch.Tensor],
           nucleus: Nucleus = nucleus_weights, draw: Draw | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: [N, vocab] in the model's dtype, one row per sequence to sample. Greedy rows
    take `argmax`, top-p rows their nuclei from `nucleus`, and rows with neither top-k nor top-p
    `draw` where given (the model's ops pick all three: fused kernels on CPU); rows sampled or
    asking for logprobs are converted to float32 first, as the distribution is computed in
    float32."""
    sampled = [row for row, seq in enumerate(seqs) if not seq.params.greedy]
    if not sampled:
        tokens = argmax(logits)
    else:
        # On the CPU: a seeded torch.Generator lives there, and only these rows need it. The
        # argmax runs over the greedy rows only (0.18 ms for 32 rows of 49,152 on a 2-core Zen 4).
        tokens = torch.empty(len(seqs), dtype=torch.long)
        greedy = [row for row, seq in enumerate(seqs) if seq.params.greedy]
        if greedy:
            tokens[greedy] = argmax(_select(logits, greedy)).cpu()
        tokens[sampled] = _draw(_select(logits, sampled).cpu(), [seqs[r] for r in sampled], nucleus, draw)
    token_list = tokens.tolist()
    want = [s.params.logprobs is not None for s in seqs]
    logprobs: list[TokenLogprob | None] = [None] * len(seqs)
    if any(want):
        rows = [i for i, w in enumerate(want) if w]
        lp = torch.log_softmax(_select(logits, rows).float(), dim=-1)
        k = max(seqs[i].params.logprobs for i in rows)
        top_v, top_i = lp.topk(max(k, 1), dim=-1)
        for j, i in enumerate(rows):
            kk = seqs[i].params.logprobs
            logprobs[i] = TokenLogprob(
                token_id=token_list[i], logprob=float(lp[j, token_list[i]]),
                top=list(zip(top_i[j, :kk].tolist(), top_v[j, :kk].tolist())))
    return token_list, logprobs
