"""Trees on any backend: attention as (paged prefix) and (tree scratch), two partial attentions merged by LSE.

A query token's keys (the contract in `spruce.attention.metadata`) are two disjoint sets: the paged committed
prefix (positions 0 .. kv_lens[t]-1 of its row: a plain length, no other mask) and the scratch entries its
ancestor bits select. Softmax over their union is the log-sum-exp merge of the two softmaxes:

    with a = prefix, b = scratch, and per (token, head)  lse_x = log2 sum_{j in x} exp(s_j)   (s = scale q.k)
    lse = log2(2^lse_a + 2^lse_b),   o = (2^(lse_a - lse) o_a + 2^(lse_b - lse) o_b)

so the prefix half can be served by any library kernel that does plain paged attention (causal for EXTEND,
where kv_lens = position + 1, a shared length for the tree phases) and returns its LSE, the scratch half by a
small masked kernel, and one merge combines them (DESIGN §13). Page size and topk still never meet: the prefix
kernel never sees a tree, the scratch kernel never sees a page.

LSEs here are **base 2** (log2 of the sum of exp of the scaled scores), FlashInfer's convention for its
returned LSE and its `merge_state`, so a FlashInfer half can be merged with a torch half unchanged. A row that
sees nothing in a half has lse = -inf and output zeros there; a row that sees nothing at all merges to zeros
with lse = -inf (padding tokens produce zeros, as the contract requires).

Everything is float32 torch: the reference for such backends, and the `torch-split` backend's implementation.
MHA/GQA (query head h reads KV head h // (Hq / Hkv)) and MLA alike: for MLA pass the latent cache as one KV
head, `cache[:, None, :]`, and its value view `cache[:, None, :value_dim]`.
"""

from __future__ import annotations

import math

import torch

from spruce.attention import torch_backend
from spruce.attention.metadata import ForwardBatch
from spruce.attention.torch_backend import paged_slots, request_tokens, scratch_bits

LOG2E = 1.0 / math.log(2.0)


def merge_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                 lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions over disjoint key sets: (o [T, H, D], lse [T, H]), LSE base 2.

    Rows with lse = -inf in one half take the other half unchanged; in both, zeros and -inf."""
    lse_a, lse_b = lse_a.float(), lse_b.float()
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(torch.isfinite(top), top, 0.0)  # both halves empty: weights 2^-inf = 0
    w_a, w_b = torch.exp2(lse_a - top), torch.exp2(lse_b - top)
    total = w_a + w_b
    o = (w_a[..., None] * o_a.float() + w_b[..., None] * o_b.float()) / torch.where(total > 0, total, 1.0)[..., None]
    return o, top + torch.log2(total)  # log2(0) = -inf where both are empty


def attend_prefix(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                  page_table: torch.Tensor, page_size: int, scale: float, kv_start: torch.Tensor | None = None,
                  kv_stop: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query token over paged positions 0 .. kv_lens[t]-1 of its row, no other mask.

    q [T, Hq, D]; caches [slots, Hkv, D] / [slots, Hkv, Dv] (already holding the batch's new K/V).
    kv_start / kv_stop [bs] (optional): request b's tokens see only positions in [kv_start[b], kv_stop[b]) of
    that range (the two halves of a prefix split at a host-known length: FlashInfer's backend, DESIGN §13).
    Returns (o [T, Hq, Dv], lse [T, Hq]) in float32, LSE base 2."""
    pos = torch.arange(batch.max_kv_len, device=q.device)  # [Lp]
    rows = batch.req_rows
    slots = paged_slots(page_table, rows, pos[None, :].expand(rows.shape[0], -1), page_size)  # [bs, Lp]

    def mask(tok: torch.Tensor, exists: torch.Tensor) -> torch.Tensor:
        kv_lens = batch.kv_lens[tok].long().masked_fill(~exists, 0)  # [bs, mb]
        seen = pos[None, None, :] < kv_lens[:, :, None]  # [bs, mb, Lp]
        if kv_start is not None:
            seen &= pos[None, None, :] >= kv_start.long()[:, None, None]
        if kv_stop is not None:
            seen &= pos[None, None, :] < kv_stop.long()[:, None, None]
        return seen

    return _partial(q, k_cache, v_cache, batch, slots, mask, scale)


def attend_scratch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                   scratch_start: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query token over the scratch entries j of its row's block whose bit j is set in tree_mask[t].

    Same shapes as `attend_prefix`; a batch with scratch_width 0 sees nothing here (zeros, lse -inf)."""
    w, rows = batch.scratch_width, batch.req_rows
    slots = scratch_start + rows[:, None] * w + torch.arange(w, device=q.device)[None, :]  # [bs, W]

    def mask(tok: torch.Tensor, exists: torch.Tensor) -> torch.Tensor:
        return scratch_bits(batch.tree_mask[tok], w) & exists[:, :, None]  # [bs, mb, W]

    return _partial(q, k_cache, v_cache, batch, slots, mask, scale)


def _partial(q, k_cache, v_cache, batch: ForwardBatch, slots: torch.Tensor, mask_of, scale: float):
    """Masked float32 attention of every query token over its request's keys `slots` [bs, L], with its LSE."""
    t, heads, value_dim = batch.num_tokens, q.shape[1], v_cache.shape[-1]
    out = torch.zeros(t + 1, heads, value_dim, dtype=torch.float32, device=q.device)  # row T: missing tokens
    lse = torch.full((t + 1, heads), float("-inf"), dtype=torch.float32, device=q.device)
    num_keys = slots.shape[1]
    if t == 0 or batch.batch_size == 0 or batch.max_q_len == 0 or num_keys == 0:
        return out[:t], lse[:t]
    keys = k_cache[slots].float()  # [bs, L, Hkv, D]
    vals = v_cache[slots].float()  # [bs, L, Hkv, Dv]
    tok, exists = request_tokens(batch)  # [bs, m]
    block = max(1, torch_backend.SCORE_ELEMENTS // (batch.batch_size * heads * num_keys))
    for i0 in range(0, batch.max_q_len, block):
        blk_tok, blk_exists = tok[:, i0:i0 + block], exists[:, i0:i0 + block]  # [bs, mb]
        o, s = _attend_with_lse(q, keys, vals, mask_of(blk_tok, blk_exists), blk_tok, scale)
        dest = blk_tok.masked_fill(~blk_exists, t).reshape(-1)
        out[dest] = o.reshape(-1, heads, value_dim)
        lse[dest] = s.reshape(-1, heads)
    return out[:t], lse[:t]


def _attend_with_lse(q, keys, vals, mask, tok, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Query tokens `tok` [bs, mb] over keys [bs, L, Hkv, D] where mask [bs, mb, L]:
    (o [bs, mb, Hq, Dv], lse [bs, mb, Hq] base 2); rows with an empty mask get zeros and -inf."""
    bs, mb = tok.shape
    heads, kv_heads = q.shape[1], keys.shape[2]
    queries = q[tok].float().view(bs, mb, kv_heads, heads // kv_heads, -1)  # [bs, mb, Hkv, G, D]
    scores = torch.einsum("bmhgd,blhd->bhgml", queries, keys) * scale  # [bs, Hkv, G, mb, L]
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [bs, Hkv, G, mb], natural log; -inf where nothing is seen
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])  # empty rows: all 0
    out = torch.einsum("bhgml,blhd->bmhgd", probs, vals).reshape(bs, mb, heads, -1)
    return out, (lse * LOG2E).permute(0, 3, 1, 2).reshape(bs, mb, heads)
