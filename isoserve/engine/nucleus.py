"""Top-p: each row's nucleus, found from the float32 bits of its probabilities, not by a sort.

The nucleus is the smallest prefix of the row sorted by descending probability (equal ones in
position order) whose mass reaches top_p; its first token always stays. Sorting is what made
top-p slow: the default model's 49,152 probabilities took torch ~1.8 ms a row to sort and 0.34
to take the 4,096 largest, and at temperature 1 a step's nuclei hold ~1,500 tokens at top_p 0.9
(~3,000 at 0.95) on prompts of random words. A batch-32 step then spent 16-24 ms choosing its
tokens, against ~27 ms for the model (docs/benchmarks.md, session 36).

Instead: a non-negative float32's bits order as its value does, so the bits shifted right by
KEY_SHIFT sort the probabilities into KEYS ranges, eight to a power of two, the highest key
holding the largest values. One pass sums each key's mass in float64 (exact: a key's values
are multiples of one unit, so the order of the additions does not matter, kernels/nucleus.cpp);
a running sum from the highest key down finds the key where the mass reaches top_p, the edge.
Every token of a higher key is in the nucleus and none of a lower one. Only the edge's tokens
are sorted, and each is kept while the mass before it (the higher keys' sum, then the edge's
tokens before it, in float64) stays under top_p.

`nucleus_weights` is the reference, in torch ops. The CPU kernel (kernels/nucleus.cpp, the
fused ops' `nucleus`) takes the same sums (the key masses exactly, the others in the same
order), so it gives the same bits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

KEY_SHIFT = 20
KEYS = 1 << (31 - KEY_SHIFT)  # 2,048: every non-negative float32, inf and NaN included, has a key


def nucleus_weights(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[R, V] float32: each row's probabilities inside its nucleus, 0 outside. probs: [R, V]
    float32 and non-negative (a softmax's); top_p: [R] float32 at most 1, or inf to keep every
    token (one rounded to 0 keeps the most likely token; NaN is refused). A row whose mass is not finite and positive comes back all
    0, which the draw then refuses."""
    if bool(top_p.isnan().any()):  # no order of masses can say where it is reached
        raise ValueError("top_p is NaN")
    rows = probs.shape[0]
    # The mask makes -0.0 key 0, as +0.0 is.
    keys = (probs.view(torch.int32) >> KEY_SHIFT).bitwise_and_(KEYS - 1)
    mass = torch.zeros(rows, KEYS, dtype=torch.float64, device=probs.device)
    mass.scatter_add_(1, keys.long(), probs.double())
    from_top = mass.flip(-1).cumsum(-1)  # [R, KEYS]: the mass of the highest keys down to each
    total = from_top[:, -1:]
    # A top_p that float32 rounds to 0 still keeps the most likely token: at least the
    # smallest normal float64, above 0 and below any float32 probability.
    p = top_p.double().clamp(min=torch.finfo(torch.float64).tiny)[:, None]
    # The first key from the top where the mass reaches top_p. Where it never does (a top_p
    # near 1, the row's float32 values summing to a little less), KEYS: the edge falls below
    # every key and every token stays. (The first key where the mass reaches the row's total
    # would not do: mass below float64's resolution of the running sum, 1e-30 beside 1, leaves
    # that sum unchanged, and would be cut off.)
    reach = torch.searchsorted(from_top, p)
    above = torch.where(reach > 0, from_top.gather(1, (reach - 1).clamp_(min=0)), 0.0)
    # A row that is no distribution gets an edge above every key: nothing is kept.
    valid = torch.isfinite(total) & (total > 0)
    edge = torch.where(valid, KEYS - 1 - reach, KEYS).to(torch.int32)
    out = torch.where(keys > edge, probs, 0.0)
    r, c = (keys == edge).nonzero(as_tuple=True)
    if not len(r):
        return out
    # The edge's tokens, one padded row each, sorted by descending probability (stable: equal
    # ones stay in position order; the padding, -1, goes last).
    counts = torch.bincount(r, minlength=rows)
    slot = torch.arange(len(r), device=probs.device) - (counts.cumsum(0) - counts)[r]
    width = int(counts.max())
    values = torch.full((rows, width), -1.0, device=probs.device).index_put_((r, slot), probs[r, c])
    columns = torch.zeros((rows, width), dtype=torch.long, device=probs.device).index_put_((r, slot), c)
    values, order = torch.sort(values, dim=-1, descending=True, stable=True)
    columns = columns.gather(1, order)
    # The mass before each: the higher keys', then the edge's tokens before it, one by one.
    before = above + F.pad(values[:, :-1].clamp(min=0).double(), (1, 0)).cumsum(-1)
    keep = (before < p) & (values >= 0)
    kept_rows = torch.arange(rows, device=probs.device)[:, None].expand_as(keep)[keep]
    kept_columns = columns[keep]
    out[kept_rows, kept_columns] = probs[kept_rows, kept_columns]
    return out
