"""Token selection: greedy rows in one vectorized argmax, sampled rows one by one with their
own parameters. Logprobs are those of the model's distribution (before temperature, top-k
and top-p), as OpenAI-compatible servers report them."""
from __future__ import annotations

from typing import Callable

import torch

from isoserve.engine.sequence import Sequence, TokenLogprob


def _row_generator(seq: Sequence) -> torch.Generator | None:
    """A seeded request draws token i from a generator keyed by (seed, i), so the same seed gives
    the same tokens wherever each token is sampled (a prefill worker samples the first one)."""
    if seq.params.seed is None:
        return None
    g = torch.Generator()
    g.manual_seed((seq.params.seed * 1_000_003 + len(seq.output_token_ids)) % (2**63))
    return g


def _filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    logits = logits / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        drop[..., 0] = False  # a top_p below float32's smallest value would otherwise drop it too
        sorted_probs[drop] = 0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs


def sample(logits: torch.Tensor, seqs: list[Sequence], argmax: Callable[[torch.Tensor], torch.Tensor],
           ) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: [N, vocab] in the model's dtype, one row per sequence to sample. Greedy rows
    take `argmax` (the model's ops pick it: a fused kernel on CPU); rows sampled or asking for
    logprobs are converted to float32 first, as the distribution is computed in float32."""
    tokens = argmax(logits)
    for row, seq in enumerate(seqs):
        p = seq.params
        if not p.greedy:
            # On the CPU: a seeded torch.Generator lives there, and only these rows need it.
            probs = _filtered_probs(logits[row].float().cpu(), p.temperature, p.top_k, p.top_p)
            tokens[row] = torch.multinomial(probs, 1, generator=_row_generator(seq))[0]
    token_list = tokens.tolist()
    want = [s.params.logprobs is not None for s in seqs]
    logprobs: list[TokenLogprob | None] = [None] * len(seqs)
    if any(want):
        rows = [i for i, w in enumerate(want) if w]
        lp = torch.log_softmax(logits[rows].float(), dim=-1)
        k = max(seqs[i].params.logprobs for i in rows)
        top_v, top_i = lp.topk(max(k, 1), dim=-1)
        for j, i in enumerate(rows):
            kk = seqs[i].params.logprobs
            logprobs[i] = TokenLogprob(
                token_id=token_list[i], logprob=float(lp[j, token_list[i]]),
                top=list(zip(top_i[j, :kk].tolist(), top_v[j, :kk].tolist())))
    return token_list, logprobs
