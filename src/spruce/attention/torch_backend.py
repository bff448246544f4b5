"""The reference attention backend: plain torch, obviously correct, CPU and GPU, eager only.

It follows the contract in `spruce.attention.metadata` literally: gather each token's paged keys by
position, gather its row's scratch block, build the mask (length mask | ancestor bits), softmax in float32.
"""

from __future__ import annotations

import torch

from spruce.attention.backend import AttentionBackend
from spruce.attention.metadata import ForwardBatch
from spruce.limits import MASK_WORD_BITS

TOKENS_PER_CHUNK = 128  # bounds the gathered [chunk, kv, H, D] tensors


def paged_slots(page_table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Slot ids of `positions` ([n, m]) in the pages of `rows` ([n]): [n, m] int64."""
    pages = page_table[rows[:, None], positions // page_size].long()
    return pages * page_size + positions % page_size


def scratch_bits(tree_mask: torch.Tensor, width: int) -> torch.Tensor:
    """Expand [T, words] int64 bitmasks into [T, width] bools (bit j of word j // 64)."""
    j = torch.arange(width, device=tree_mask.device)
    words = tree_mask[:, j // MASK_WORD_BITS]  # [T, width]
    return ((words >> (j % MASK_WORD_BITS)) & 1).bool()


class TorchAttention(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, scratch_start, batch: ForwardBatch, page_table, scale):
        k_cache[batch.out_slots] = k.to(k_cache.dtype)
        v_cache[batch.out_slots] = v.to(v_cache.dtype)
        out = torch.zeros_like(q)
        for t0 in range(0, batch.num_tokens, TOKENS_PER_CHUNK):
            t1 = min(t0 + TOKENS_PER_CHUNK, batch.num_tokens)
            out[t0:t1] = self._attend(q[t0:t1], k_cache, v_cache, scratch_start, batch, t0, t1, page_table, scale)
        return out

    def _attend(self, q, k_cache, v_cache, scratch_start, batch, t0, t1, page_table, scale):
        rows = batch.token_rows[t0:t1]  # [n]
        n = t1 - t0
        pos = torch.arange(batch.max_kv_len, device=q.device)[None, :].expand(n, -1)  # [n, Lmax]
        slots = paged_slots(page_table, rows, pos, self.page_size)  # [n, Lmax]
        valid = pos < batch.kv_lens[t0:t1, None]  # [n, Lmax]
        w = batch.scratch_width
        if w > 0:
            sj = torch.arange(w, device=q.device)
            scratch = scratch_start + rows[:, None] * w + sj[None, :]  # [n, W]
            slots = torch.cat([slots, scratch], dim=1)
            valid = torch.cat([valid, scratch_bits(batch.tree_mask[t0:t1], w)], dim=1)
        keys = k_cache[slots].float()  # [n, L, Hkv, D]
        vals = v_cache[slots].float()
        group = q.shape[1] // keys.shape[2]
        keys = keys.repeat_interleave(group, dim=2)  # [n, L, Hq, D]
        vals = vals.repeat_interleave(group, dim=2)
        scores = torch.einsum("nhd,nlhd->nhl", q.float(), keys) * scale  # [n, Hq, L]
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with nothing to attend -> zeros
        return torch.einsum("nhl,nlhd->nhd", probs, vals).to(q.dtype)
