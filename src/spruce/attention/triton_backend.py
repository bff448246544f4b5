"""The `triton` attention backend: the GPU fast path, same contract as the torch reference.

Every phase runs the same two kernels: `store_kv` then `paged_attention_kernel` (paged prefix + tree scratch
in one online softmax), plus `merge_splits_kernel` when the kv range is split across programs. No host
synchronisation: the grid depends only on host ints of the ForwardBatch (batch size, max query tokens per
request, max kv length), which are fixed per CUDA-graph bucket.
"""

from __future__ import annotations

import math

import torch

from spruce.attention.backend import AttentionBackend
from spruce.attention.metadata import ForwardBatch
from spruce.attention.triton_kernels.paged_attention import merge_splits_kernel, paged_attention_kernel
from spruce.attention.triton_kernels.store_kv import store_kv, token_rows_contiguous
from spruce.ops.triton_support import triton

BLOCK_N = 32
MAX_SPLITS = 16
MIN_KV_PER_SPLIT = 256


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


class TritonAttention(AttentionBackend):
    name = "triton"

    def __init__(self, page_size: int):
        super().__init__(page_size)
        self._sms: int | None = None

    def num_splits(self, programs: int, max_kv_len: int, device: torch.device) -> int:
        """Split the kv range when the grid alone would leave most SMs idle (a power of two <= MAX_SPLITS)."""
        if self._sms is None:
            self._sms = _num_sms(device)
        want = min(math.ceil(2 * self._sms / max(programs, 1)), math.ceil(max_kv_len / MIN_KV_PER_SPLIT), MAX_SPLITS)
        return 1 if want <= 1 else triton.next_power_of_2(want)

    def forward(self, q, k, v, k_cache, v_cache, scratch_start, batch: ForwardBatch, page_table, scale):
        t = batch.num_tokens
        if t == 0:
            return torch.empty_like(q)
        store_kv(k, v, k_cache, v_cache, batch.out_slots)
        _, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        block_m = 16 if batch.max_q_len <= 16 else 32
        num_q_blocks = triton.cdiv(max(batch.max_q_len, 1), block_m)
        grid0 = batch.batch_size * num_q_blocks
        splits = self.num_splits(grid0 * num_heads, batch.max_kv_len, q.device)
        q = token_rows_contiguous(q)  # a view of the fused qkv stays a view
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, Hq, D] contiguous
        if splits > 1:
            part_o = torch.empty(splits, t, num_heads, head_dim, dtype=torch.float32, device=q.device)
            part_lse = torch.empty(splits, t, num_heads, dtype=torch.float32, device=q.device)
        else:
            part_o = part_lse = out  # unused
        precision = "ieee" if q.dtype == torch.float32 else "tf32"
        paged_attention_kernel[(grid0, num_heads, splits)](
            q, out, k_cache, v_cache, page_table, batch.req_rows, batch.qo_indptr, batch.kv_lens, batch.tree_mask,
            part_o, part_lse, num_q_blocks, t, q.stride(0), page_table.stride(0), scratch_start, scale * 1.4426950408889634,
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim), PAGE_SIZE=self.page_size, SCRATCH_WIDTH=batch.scratch_width,
            MASK_WORDS=batch.tree_mask.shape[1], NUM_SPLITS=splits, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
            DOT_PRECISION=precision, num_warps=4,
        )
        if splits > 1:
            merge_splits_kernel[(t, num_heads)](part_o, part_lse, out, t, NUM_HEADS=num_heads, HEAD_DIM=head_dim,
                                                BLOCK_D=triton.next_power_of_2(head_dim), NUM_SPLITS=splits)
        return out
