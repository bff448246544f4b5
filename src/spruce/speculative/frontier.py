"""One draft step's bookkeeping (DESIGN §1.1): expand the K frontier nodes into K*K children and keep the
best K as the next frontier.

Inputs per request b: frontier scores f_scores [K] (cumulative draft probability of each frontier node),
their candidate indices f_cand [K], and the draft's top-K under each frontier node, p / ids [K, K]. Child
c = i*K + j (frontier node i, its j-th choice) gets
    token  = to_target[ids[i, j]]           (the draft-to-target vocabulary map)
    score  = f_scores[i] * p[i, j]          (the product of probabilities along its path)
    parent = f_cand[i]
and is written at candidate index `offset + c`; with `write_roots` the frontier itself (the step-0 nodes)
is also written at candidate indices [0, K). The next frontier is the K children with the best scores
(ties: the lower child index), with `slot` = the frontier node each came from (to gather its hidden state
and ancestor mask).

`expand_frontier` runs one Triton program per request on the GPU; `expand_frontier_reference` is the torch
version (CPU, and the oracle of the tests). Both write into the caller's candidate buffers in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spruce.ops.fused import _use_triton
from spruce.ops.triton_support import tl, triton


@dataclass
class Frontier:
    tokens: torch.Tensor  # [bs, K] int64 target ids
    scores: torch.Tensor  # [bs, K] float32
    cand: torch.Tensor  # [bs, K] int64 candidate index
    slot: torch.Tensor  # [bs, K] int64 index of the previous frontier node each one expands


def expand_frontier_reference(p, ids, to_target, f_tokens, f_scores, f_cand, cand_tokens, cand_scores,
                              cand_parents, offset: int, write_roots: bool) -> Frontier:
    """p, ids [bs*K, K]; f_* [bs, K]; writes cand_*[:, offset:offset+K*K]; returns the new frontier."""
    bs, k = f_scores.shape
    if write_roots:
        cand_tokens[:, :k] = f_tokens
        cand_scores[:, :k] = f_scores
    child_tokens = to_target[ids].view(bs, k * k)
    child_scores = (f_scores[:, :, None] * p.view(bs, k, k)).view(bs, k * k)
    cand_tokens[:, offset:offset + k * k] = child_tokens
    cand_scores[:, offset:offset + k * k] = child_scores
    cand_parents[:, offset:offset + k * k] = f_cand.repeat_interleave(k, dim=1)
    scores, best = child_scores.topk(k, dim=-1)  # [bs, K]
    return Frontier(tokens=child_tokens.gather(1, best), scores=scores, cand=offset + best,
                    slot=torch.div(best, k, rounding_mode="floor"))


@triton.jit(do_not_specialize=["offset"])
def _expand_frontier_kernel(p_ptr, ids_ptr, map_ptr, f_tokens_ptr, f_scores_ptr, f_cand_ptr, cand_tokens,
                            cand_scores, cand_parents, cand_stride, offset, out_tokens, out_scores, out_cand,
                            out_slot, K: tl.constexpr, BLOCK: tl.constexpr, WRITE_ROOTS: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    if WRITE_ROOTS:
        r = tl.arange(0, BLOCK)
        tl.store(cand_tokens + b * cand_stride + r, tl.load(f_tokens_ptr + b * K + r, mask=r < K), mask=r < K)
        tl.store(cand_scores + b * cand_stride + r, tl.load(f_scores_ptr + b * K + r, mask=r < K), mask=r < K)
    c = tl.arange(0, BLOCK)  # child index i*K + j
    valid = c < K * K
    node = c // K
    p = tl.load(p_ptr + b * K * K + c, mask=valid, other=0.0)
    ids = tl.load(ids_ptr + b * K * K + c, mask=valid, other=0)
    tokens = tl.load(map_ptr + ids, mask=valid, other=0)
    scores = tl.load(f_scores_ptr + b * K + node, mask=valid, other=0.0) * p
    parents = tl.load(f_cand_ptr + b * K + node, mask=valid, other=0)
    out = b * cand_stride + offset + c
    tl.store(cand_tokens + out, tokens, mask=valid)
    tl.store(cand_scores + out, scores, mask=valid)
    tl.store(cand_parents + out, parents, mask=valid)
    scores = tl.where(valid, scores, -1.0)  # scores are >= 0: padding never wins
    for i in tl.static_range(K):
        best = tl.max(scores, axis=0)
        where = tl.min(tl.where(scores == best, c, BLOCK), axis=0)  # lowest child index among equals
        tl.store(out_scores + b * K + i, best)
        tl.store(out_tokens + b * K + i, tl.sum(tl.where(c == where, tokens, 0), axis=0))
        tl.store(out_cand + b * K + i, (offset + where).to(tl.int64))
        tl.store(out_slot + b * K + i, (where // K).to(tl.int64))
        scores = tl.where(c == where, -2.0, scores)


def expand_frontier(p, ids, to_target, f_tokens, f_scores, f_cand, cand_tokens, cand_scores, cand_parents,
                    offset: int, write_roots: bool = False) -> Frontier:
    """See the module docstring. p, ids [bs*K, K] (the draft's top-K under each frontier node, draft ids);
    to_target [draft vocab] int64; f_* [bs, K]; cand_* [bs, M] written in place."""
    bs, k = f_scores.shape
    if not _use_triton(p) or bs == 0:
        return expand_frontier_reference(p, ids, to_target, f_tokens, f_scores, f_cand, cand_tokens, cand_scores,
                                         cand_parents, offset, write_roots)
    for buf in (cand_tokens, cand_scores, cand_parents):
        if buf.stride(1) != 1 or buf.stride(0) != cand_tokens.stride(0):
            raise ValueError(f"candidate buffers must share a row stride with unit column stride, got "
                             f"{buf.stride()} vs {cand_tokens.stride()}")
    dev = p.device
    tokens = torch.empty(bs, k, dtype=torch.int64, device=dev)  # [bs, K]
    scores = torch.empty(bs, k, dtype=torch.float32, device=dev)
    cand = torch.empty(bs, k, dtype=torch.int64, device=dev)
    slot = torch.empty(bs, k, dtype=torch.int64, device=dev)
    _expand_frontier_kernel[(bs,)](
        p.contiguous(), ids.contiguous(), to_target, f_tokens.contiguous(), f_scores.contiguous(),
        f_cand.contiguous(), cand_tokens, cand_scores, cand_parents, cand_tokens.stride(0), offset, tokens, scores,
        cand, slot, K=k, BLOCK=triton.next_power_of_2(k * k), WRITE_ROOTS=write_roots,
    )
    return Frontier(tokens=tokens, scores=scores, cand=cand, slot=slot)
