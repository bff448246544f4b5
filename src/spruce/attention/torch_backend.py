"""The reference attention backend: plain torch, obviously correct, CPU and GPU, eager only.

It follows the contract in `spruce.attention.metadata` with one batched masked attention per block of query
tokens: the batch is laid out as [bs, m] (request b, its i-th query token; m = max_q_len), each request's keys
(paged positions 0..max_kv_len-1 of its row, then its scratch block) are gathered once, every query token gets
one mask row over those keys (length mask | ancestor bits), and `scaled_dot_product_attention` runs in float32.
Request b's query tokens are qo_indptr[b] .. qo_indptr[b+1]-1 and its row is req_rows[b] (the builder gives
them token_rows == req_rows[b]; the triton backend reads the same grouping). Shapes come from the batch's host
ints only, so the backend never synchronises with the device. It reads the ForwardBatch directly: its `plan` is
the base class's no-op (DESIGN §13).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spruce.attention.backend import AttentionBackend
from spruce.attention.metadata import ForwardBatch, Phase
from spruce.attention.tree_mask import MASK_WORD_BITS
from spruce.errors import InvariantError

SCORE_ELEMENTS = 1 << 25  # bounds a query block's [bs, Hq, block, L] scores (and its [bs, block, L] mask)


def paged_slots(page_table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Slot ids of `positions` ([n, m]) in the pages of `rows` ([n]): [n, m] int64."""
    pages = page_table[rows[:, None], positions // page_size].long()
    return pages * page_size + positions % page_size


def scratch_bits(tree_mask: torch.Tensor, width: int) -> torch.Tensor:
    """Expand [..., words] int64 bitmasks into [..., width] bools (bit j of word j // 64)."""
    j = torch.arange(width, device=tree_mask.device)
    words = tree_mask[..., j // MASK_WORD_BITS]  # [..., width]
    return ((words >> (j % MASK_WORD_BITS)) & 1).bool()


def request_tokens(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Token index of request b's i-th query token, [bs, m] int64 (clamped into range), and whether it exists."""
    i = torch.arange(batch.max_q_len, device=batch.qo_indptr.device)
    start = batch.qo_indptr[:-1].long()[:, None]  # [bs, 1]
    tok = start + i[None, :]  # [bs, m]
    exists = tok < batch.qo_indptr[1:].long()[:, None]  # [bs, m]
    return tok.clamp(max=batch.num_tokens - 1), exists


def request_key_slots(batch: ForwardBatch, page_table: torch.Tensor, scratch_start: int,
                      page_size: int) -> torch.Tensor:
    """Pool slots of each request's candidate keys, [bs, L]: paged positions 0..max_kv_len-1, then scratch 0..W-1."""
    rows = batch.req_rows  # [bs]
    pos = torch.arange(batch.max_kv_len, device=rows.device)[None, :].expand(rows.shape[0], -1)  # [bs, Lp]
    slots = paged_slots(page_table, rows, pos, page_size)  # [bs, Lp]
    w = batch.scratch_width
    if w == 0:
        return slots
    scratch = scratch_start + rows[:, None] * w + torch.arange(w, device=rows.device)[None, :]  # [bs, W]
    return torch.cat([slots, scratch], dim=1)


def key_mask(batch: ForwardBatch, tok: torch.Tensor, exists: torch.Tensor, window: int | None = None,
             chunk: int | None = None) -> torch.Tensor:
    """[bs, mb, L] bool: query token tok[b, i] sees paged position p < kv_lens[tok] and scratch j with bit j set.

    `window` W (sliding-window attention): of the paged positions only those in (positions[tok] - W, ...]
    too, e.g. W = 4 at position 9: paged 6..9. Scratch entries (a tree's ancestors, all within the last
    speculative_num_steps + 1 positions) are not cut: the runner refuses trees as deep as the window.
    `chunk` C (chunked attention): only positions from C * floor(positions[tok] / C) on, e.g. C = 8 at
    position 9: 8..9; a tree's ancestors too (`scratch_positions`), since a chunk boundary may cut a tree."""
    pos = torch.arange(batch.max_kv_len, device=tok.device)
    kv_lens = batch.kv_lens[tok].long().masked_fill(~exists, 0)  # [bs, mb]
    mask = pos[None, None, :] < kv_lens[:, :, None]  # [bs, mb, Lp]
    if window is not None:
        mask &= pos[None, None, :] > (batch.positions[tok] - window)[:, :, None]
    first = None if chunk is None else torch.div(batch.positions[tok], chunk, rounding_mode="floor") * chunk
    if first is not None:
        mask &= pos[None, None, :] >= first[:, :, None]
    if batch.scratch_width == 0:
        return mask
    bits = scratch_bits(batch.tree_mask[tok], batch.scratch_width) & exists[:, :, None]  # [bs, mb, W]
    if first is not None:
        bits &= scratch_positions(batch)[:, None, :] >= first[:, :, None]
    return torch.cat([mask, bits], dim=2)


def scratch_positions(batch: ForwardBatch) -> torch.Tensor:
    """[bs, W] position of each request's scratch entries in a VERIFY batch, whose query token j of request b
    is scratch entry j (its tree node; the runner's verify layout); entries past the request's tokens get -1."""
    if batch.phase != Phase.VERIFY:
        raise InvariantError(f"chunked attention over a tree's scratch runs in VERIFY only, got {batch.phase.value}")
    j = torch.arange(batch.scratch_width, device=batch.positions.device)
    start, end = batch.qo_indptr[:-1].long()[:, None], batch.qo_indptr[1:].long()[:, None]  # [bs, 1]
    tok = (start + j[None, :]).clamp(max=max(batch.num_tokens - 1, 0))  # [bs, W]
    return torch.where(start + j[None, :] < end, batch.positions[tok], -1)


class TorchAttention(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, scratch_start, batch: ForwardBatch, page_table, scale,
                window: int | None = None, sinks: torch.Tensor | None = None, chunk: int | None = None):
        """`window` (sliding-window attention, key_mask) and `sinks` [Hq] (gpt-oss: one extra logit per head
        in every softmax's denominator, attending to nothing) are optional (BackendInfo.windows), as is `chunk`
        (chunked attention, Llama 4: BackendInfo.chunks)."""
        k_cache[batch.out_slots] = k.to(k_cache.dtype)
        v_cache[batch.out_slots] = v.to(v_cache.dtype)
        return self._attend_all(q, k_cache, v_cache, scratch_start, batch, page_table, scale, window, sinks, chunk)

    def forward_latent(self, q, latent, cache, value_dim, scratch_start, batch: ForwardBatch, page_table, scale):
        cache[batch.out_slots] = latent.to(cache.dtype)
        keys = cache[:, None, :]  # [slots, 1, Dk]: one KV head
        return self._attend_all(q, keys, keys[..., :value_dim], scratch_start, batch, page_table, scale)

    def _attend_all(self, q, k_cache, v_cache, scratch_start, batch: ForwardBatch, page_table, scale,
                    window: int | None = None, sinks: torch.Tensor | None = None, chunk: int | None = None):
        """Every query token of the batch over its keys in the (already written) caches: [T, Hq, Dv]."""
        num_keys = batch.max_kv_len + batch.scratch_width
        out_shape = (*q.shape[:2], v_cache.shape[-1])
        if batch.num_tokens == 0 or batch.batch_size == 0 or batch.max_q_len == 0 or num_keys == 0:
            return q.new_zeros(out_shape)
        slots = request_key_slots(batch, page_table, scratch_start, self.page_size)  # [bs, L]
        keys = k_cache[slots].float().transpose(1, 2)  # [bs, Hkv, L, D]
        vals = v_cache[slots].float().transpose(1, 2)  # [bs, Hkv, L, D]
        tok, exists = request_tokens(batch)  # [bs, m]
        out = q.new_zeros(batch.num_tokens + 1, *out_shape[1:])  # [T+1, Hq, Dv]
        block = max(1, SCORE_ELEMENTS // (batch.batch_size * q.shape[1] * num_keys))
        for i0 in range(0, batch.max_q_len, block):
            blk_tok, blk_exists = tok[:, i0:i0 + block], exists[:, i0:i0 + block]  # [bs, mb]
            mask = key_mask(batch, blk_tok, blk_exists, window, chunk)  # [bs, mb, L]
            att = self._attend(q, keys, vals, mask, blk_tok, scale, sinks)  # [bs, mb, Hq, D]
            dest = blk_tok.masked_fill(~blk_exists, batch.num_tokens)  # missing query tokens land in row T
            out[dest.reshape(-1)] = att.reshape(-1, *out_shape[1:]).to(q.dtype)
        return out[: batch.num_tokens]

    @staticmethod
    def _attend(q, keys, vals, mask, tok, scale, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Masked float32 attention of query tokens `tok` [bs, mb] over their request's keys: [bs, mb, Hq, Dv].

        A query token whose mask row is empty (padding) gets zeros. With `sinks` [Hq] each head's softmax has
        one more logit s in its denominator: out = sum_j e^x_j v_j / (sum_j e^x_j + e^s), i.e. the plain
        attention times sigmoid(lse - s), lse = log sum_j e^x_j.
        """
        queries = q[tok].float().transpose(1, 2)  # [bs, Hq, mb, D]
        gqa = queries.shape[1] != keys.shape[1]
        att = F.scaled_dot_product_attention(queries, keys, vals, attn_mask=mask[:, None], scale=scale,
                                             enable_gqa=gqa)  # [bs, Hq, mb, D]
        if sinks is not None:
            rep = queries.shape[1] // keys.shape[1]
            scores = queries @ keys.repeat_interleave(rep, dim=1).transpose(2, 3) * scale  # [bs, Hq, mb, L]
            lse = scores.masked_fill(~mask[:, None], float("-inf")).logsumexp(dim=-1)  # [bs, Hq, mb]
            att = att * torch.sigmoid(lse - sinks.float()[None, :, None])[..., None]
        seen = mask.any(dim=2)  # [bs, mb]
        return torch.where(seen[:, :, None, None], att.transpose(1, 2), 0.0)
