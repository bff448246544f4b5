"""The `triton` attention backend: the GPU fast path, same contract as the torch reference.

Every phase runs the same two kernels: `store_kv` then `paged_attention_kernel` (paged prefix + tree scratch
in one online softmax; requests of a few tokens under grouped-query attention with a kv head's query heads as
rows, PACK_GQA), plus `merge_splits_kernel` when the kv range is split across programs; decode without
scratch runs `grouped_decode_kernel` instead. MLA (latent) attention runs `store_latent_kernel` then
`mla_attention_kernel` (blocks of query heads sharing each latent tile), plus its merge. No host
synchronisation: the grid depends only on host ints of the ForwardBatch (batch size, max query tokens per
request, max kv length), which are fixed per CUDA-graph bucket. It reads the ForwardBatch directly: its `plan`
is the base class's no-op (DESIGN §13).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from spruce.attention.backend import CACHE_ROW_ALIGN_BYTES, AttentionBackend
from spruce.attention.metadata import ForwardBatch, Phase
from spruce.attention.triton_kernels.mla_attention import (merge_latent_splits_kernel, mla_attention_kernel,
                                                          store_latent)
from spruce.attention.triton_kernels.paged_attention import (grouped_decode_kernel, merge_splits_kernel,
                                                             paged_attention_kernel)
from spruce.attention.triton_kernels.store_kv import store_kv, token_rows_contiguous
from spruce.errors import InvariantError
from spruce.ops.triton_support import triton

BLOCK_N = 32
MAX_SPLITS = 16
MIN_KV_PER_SPLIT = 256
MLA_BLOCK_N = 32
PACK_GQA_MAX_Q_LEN = 16  # requests of at most this many query tokens pack their kv head's query heads as rows
MIN_DOT_WIDTH = 16  # tl.dot's smallest M, N and K on the device (the interpreter takes any)


def dot_width(n: int) -> int:
    """The tile width of a dimension of n values that a tl.dot multiplies over (masked past n): the next power of
    two, at least MIN_DOT_WIDTH; e.g. a draft head of dimension 8 in tiles of 16, DeepSeek's rope part of 64 in 64."""
    return max(MIN_DOT_WIDTH, triton.next_power_of_2(n))


@dataclass(frozen=True)
class GroupedDecodeConfig:
    """A launch of grouped_decode_kernel: keys per tile, warps, pipeline stages, the kernel's PREFETCH (tile i + 1
    loaded in the loop body) and FP16_DOT (an FP8 cache's tiles widened to float16 instead of the query's
    bfloat16), and the programs per SM its registers allow, which the kv splits aim to fill."""

    block_n: int
    num_warps: int
    num_stages: int = 3
    prefetch: bool = True
    fp16_dot: bool = False
    per_sm: int = 2


# decode with the query heads of a kv head as one tile (grouped_decode_kernel). The defaults are the fastest of
# GROUPED_CANDIDATES measured on an H200 (`python -m spruce.bench.decode_attention`, Llama-3.1-8B heads, 32k
# context, bs 1 and 8; bench/results/decode-attention-h200.json): a 16-bit cache reads 32 keys a tile on 4 warps,
# the next tile waiting in shared memory (4 stages), not in registers; an FP8 cache 128 keys a tile on 8 warps,
# widened to float16 (one conversion per pair of e4m3 values).
GROUPED_CONFIG_16BIT = GroupedDecodeConfig(block_n=32, num_warps=4, num_stages=4, prefetch=False)
GROUPED_CONFIG_FP8 = GroupedDecodeConfig(block_n=128, num_warps=8, num_stages=2, prefetch=False, fp16_dot=True)
# what `python -m spruce.bench.decode_attention` measures (the defaults above among them)
GROUPED_CANDIDATES = (
    GroupedDecodeConfig(block_n=32, num_warps=8),  # the next tile in registers (PREFETCH): ~125 registers on sm90
    GroupedDecodeConfig(block_n=64, num_warps=8),
    GroupedDecodeConfig(block_n=64, num_warps=8, fp16_dot=True),
    GroupedDecodeConfig(block_n=64, num_warps=4, fp16_dot=True),
    GroupedDecodeConfig(block_n=64, num_warps=8, num_stages=3, prefetch=False, fp16_dot=True),
    GROUPED_CONFIG_FP8,
    GROUPED_CONFIG_16BIT,
    # 4 warps without PREFETCH: the next tile waits in shared memory (cp.async), not in registers (16-bit: 79
    # registers on sm90, 4+ programs per SM; FP8 widened to float16: 126, 4 per SM): more splits, more in flight
    GroupedDecodeConfig(block_n=32, num_warps=4, num_stages=3, prefetch=False, per_sm=4),
    GroupedDecodeConfig(block_n=32, num_warps=4, num_stages=3, prefetch=False, fp16_dot=True, per_sm=4),
)
GROUPED_MAX_SPLITS = 64  # its grid has one program per kv head: bs 1 needs many splits to fill the SMs
MLA_MAX_SPLITS = 64  # MLA has few programs (heads share them): bs 1 decode needs many splits to fill the SMs
MLA_MIN_KV_PER_SPLIT = 64


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _split_partials(splits: int, t: int, num_heads: int, dim: int, out: torch.Tensor):
    """fp32 per-split outputs [splits, T, H, dim] and log2-sum-exps [splits, T, H] for a kv range split across
    programs (the merge kernel combines them); with one split the kernel writes `out` directly and these are
    unused placeholders."""
    if splits == 1:
        return out, out
    return (torch.empty(splits, t, num_heads, dim, dtype=torch.float32, device=out.device),
            torch.empty(splits, t, num_heads, dtype=torch.float32, device=out.device))


def check_row_alignment(cache: torch.Tensor) -> None:
    """InvariantError unless every row of `cache` ([slots, Dk]) starts on a CACHE_ROW_ALIGN_BYTES boundary (a
    misaligned row is a device fault in the middle of serving, not a wrong number); host ints only."""
    row_bytes = cache.stride(0) * cache.element_size()
    if row_bytes % CACHE_ROW_ALIGN_BYTES or cache.data_ptr() % CACHE_ROW_ALIGN_BYTES:
        raise InvariantError(f"latent cache rows of {row_bytes} bytes from address {cache.data_ptr():#x}: each "
                             f"row must start on a {CACHE_ROW_ALIGN_BYTES}-byte boundary (memory/kv_pool.py's "
                             f"latent_rows pads them)")


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


class TritonAttention(AttentionBackend):
    name = "triton"

    def __init__(self, page_size: int, limits=None, device=None):
        super().__init__(page_size, limits, device)
        self._sms: int | None = None
        self.grouped_config: GroupedDecodeConfig | None = None  # set: every grouped decode launch uses it

    def grouped_decode_config(self, cache_dtype: torch.dtype, q_dtype: torch.dtype) -> GroupedDecodeConfig:
        """The grouped decode launch for a cache of `cache_dtype` read by queries of `q_dtype`: `grouped_config`
        when set, else GROUPED_CONFIG_FP8 for a one-byte cache, GROUPED_CONFIG_16BIT otherwise. FP16_DOT only
        where the query is 16-bit (a float32 query keeps its float32 dot)."""
        cfg = self.grouped_config or (GROUPED_CONFIG_FP8 if cache_dtype.itemsize == 1 else GROUPED_CONFIG_16BIT)
        return replace(cfg, fp16_dot=cfg.fp16_dot and cache_dtype.itemsize == 1 and q_dtype.itemsize == 2)

    @property
    def captures_prefill(self) -> bool:
        """Its grid and kernels read the batch's device tensors and host sizes only (no plan)."""
        return True

    def sm_count(self, device: torch.device) -> int:
        if self._sms is None:
            self._sms = _num_sms(device)
        return self._sms

    def num_splits(self, programs: int, max_kv_len: int, device: torch.device) -> int:
        """Split the kv range when the grid alone would leave most SMs idle (a power of two <= MAX_SPLITS)."""
        want = min(math.ceil(2 * self.sm_count(device) / max(programs, 1)), math.ceil(max_kv_len / MIN_KV_PER_SPLIT), MAX_SPLITS)
        return 1 if want <= 1 else triton.next_power_of_2(want)

    def query_blocking(self, batch_size: int, max_rows: int, max_kv_len: int, num_heads: int,
                       device: torch.device, split: bool = True) -> tuple[int, int, int]:
        """(BLOCK_M, query blocks per request, kv splits) of the paged kernel for a batch whose requests have at
        most `max_rows` query rows (tokens; with PACK_GQA tokens x GROUP) for each of `num_heads` grid heads
        (query heads; with PACK_GQA kv heads): blocks of 16 rows for requests of at most 16, else 32; the kv
        range split as `num_splits` says (split=False: one). Each (BLOCK_M, split or not, packed or not) triple
        is a compiled variant (DecodeStrategy.warm_eager meets them all)."""
        block_m = 16 if max_rows <= 16 else 32
        num_q_blocks = triton.cdiv(max(max_rows, 1), block_m)
        splits = self.num_splits(batch_size * num_q_blocks * num_heads, max_kv_len, device) if split else 1
        return block_m, num_q_blocks, splits

    def paged_blocking(self, batch_size: int, max_q_len: int, max_kv_len: int, num_heads: int, num_kv_heads: int,
                       device: torch.device, split: bool = True) -> tuple[bool, int, int, int]:
        """(PACK_GQA, BLOCK_M, row blocks per request, kv splits) of the paged kernel for a batch: `packs_gqa`
        decides the rows (tokens, or tokens x GROUP) and the grid's heads (query heads, or kv heads), then
        `query_blocking` the blocks and splits."""
        pack = self.packs_gqa(max_q_len, num_heads, num_kv_heads)
        rows = max_q_len * (num_heads // num_kv_heads) if pack else max_q_len
        block_m, num_q_blocks, splits = self.query_blocking(batch_size, rows, max_kv_len,
                                                            num_kv_heads if pack else num_heads, device, split)
        return pack, block_m, num_q_blocks, splits

    @staticmethod
    def packs_gqa(max_q_len: int, num_heads: int, num_kv_heads: int) -> bool:
        """Whether the paged kernel takes a kv head's query heads as rows of one block (PACK_GQA): grouped-query
        attention and requests of at most PACK_GQA_MAX_Q_LEN tokens (tree verify, drafts, short extends), where
        a block of one head's tokens would be mostly empty and each K/V tile read once per query head."""
        return num_heads > num_kv_heads and num_heads % num_kv_heads == 0 and max_q_len <= PACK_GQA_MAX_Q_LEN

    def latent_blocking(self, batch_size: int, max_q_len: int, max_kv_len: int, num_heads: int,
                        device: torch.device, split: bool = True,
                        fp8_cache: bool = False) -> tuple[int, int, int, int]:
        """(BLOCK_M, num_warps, row blocks per request, kv splits) of the MLA kernel for a batch: a request's
        max_q_len * Hq query rows (token-major, head fastest) in blocks of `latent_block`'s size; the kv range split
        as `num_latent_splits` says (split=False: one)."""
        rows = max(max_q_len, 1) * num_heads
        block_m, num_warps, per_sm = self.latent_block(rows, fp8_cache)
        num_m_blocks = triton.cdiv(rows, block_m)
        splits = (self.num_latent_splits(batch_size * num_m_blocks, per_sm, max_kv_len, device) if split else 1)
        return block_m, num_warps, num_m_blocks, splits

    @staticmethod
    def latent_block(rows_per_request: int, fp8_cache: bool = False) -> tuple[int, int, int]:
        """(BLOCK_M, num_warps, programs per SM) of the MLA kernel for requests of `rows_per_request` query rows.

        Its fp32 acc is [BLOCK_M, Dv] (Dv = 512 for DeepSeek). 64 rows on 8 warps (one program per SM) load
        each latent tile once for 4x more rows than 16 rows on 4 warps (two per SM), which only suit requests
        of fewer rows (one decode token of 16 heads) that would leave most of a 64-row block empty.

        An FP8 cache always takes 16 rows on 4 warps: over FP8 tiles at Dk = 576 (tf32 dots: `attend_latent`),
        Triton 3.6 compiles the 64-row kernel into one that needs 305,408 bytes of shared memory with a float32
        query (an H200 has 232,448) and, with a bfloat16 query, one that returns NaN in a quarter of the outputs
        (test_gpu_mla_kernel_reads_an_fp8_cache_like_torch with 64-row blocks forced); the 16-row kernel matches
        torch on the device in every case of that test."""
        return (64, 8, 1) if rows_per_request >= 64 and not fp8_cache else (16, 4, 2)

    def num_latent_splits(self, programs: int, per_sm: int, max_kv_len: int, device: torch.device) -> int:
        """MLA kv splits: the largest power of two (<= MLA_MAX_SPLITS) that does not make the grid outgrow one
        wave of `per_sm` programs per SM; each split costs a write and a read of its fp32 [rows, Dv] output."""
        want = min(math.ceil(per_sm * self.sm_count(device) / max(programs, 1)), math.ceil(max_kv_len / MLA_MIN_KV_PER_SPLIT),
                   MLA_MAX_SPLITS)
        return 1 << (max(want, 1).bit_length() - 1)

    def forward(self, q, k, v, k_cache, v_cache, scratch_start, batch: ForwardBatch, page_table, scale,
                window: int | None = None, sinks: torch.Tensor | None = None, chunk: int | None = None):
        """`window` / `sinks` [Hq] / `chunk`: sliding-window attention, attention sinks, chunked attention (the
        torch backend's contract)."""
        if batch.num_tokens == 0:
            return torch.empty_like(q)
        if chunk is not None and batch.scratch_width and batch.phase != Phase.VERIFY:
            raise InvariantError(f"chunked attention over a tree's scratch runs in VERIFY only, got "
                                 f"{batch.phase.value}")
        store_kv(k, v, k_cache, v_cache, batch.out_slots)
        out, _ = self.attend(q, k_cache, v_cache, scratch_start, batch, page_table, scale, window=window,
                             sinks=sinks, chunk=chunk)
        return out

    def attend(self, q, k_cache, v_cache, scratch_start, batch: ForwardBatch, page_table, scale,
               kv_start: torch.Tensor | None = None, return_lse: bool = False, window: int | None = None,
               sinks: torch.Tensor | None = None, chunk: int | None = None):
        """Attention of the batch's tokens over their keys (the caches already hold the new K/V).

        kv_start [bs] int32 (optional): request b's paged keys start at kv_start[b] instead of 0, for a backend
        that serves [0, kv_start) with another kernel and merges (DESIGN §13). return_lse: also the log2-sum-exp
        of the scaled scores [T, Hq] float32 (-inf where a token saw nothing); the kv range is then not split.
        Returns (out [T, Hq, D] in q's dtype, lse or None)."""
        t = batch.num_tokens
        _, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[1]
        if (batch.max_q_len == 1 and not batch.scratch_width and kv_start is None and not return_lse
                and num_heads % num_kv_heads == 0):
            return self.attend_grouped_decode(q, k_cache, v_cache, batch, page_table, scale, window, sinks,
                                              chunk), None
        pack, block_m, num_q_blocks, splits = self.paged_blocking(
            batch.batch_size, batch.max_q_len, batch.max_kv_len, num_heads, num_kv_heads, q.device,
            split=not return_lse)
        grid_heads = num_kv_heads if pack else num_heads  # a block's rows: (token, head) pairs of a kv head; tokens
        grid0 = batch.batch_size * num_q_blocks
        q = token_rows_contiguous(q)  # a view of the fused qkv stays a view
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, Hq, D] contiguous
        lse = torch.empty(t, num_heads, dtype=torch.float32, device=q.device) if return_lse else None  # [T, Hq]
        part_o, part_lse = _split_partials(splits, t, num_heads, head_dim, out)
        precision = _dot_precision(q.dtype)
        paged_attention_kernel[(grid0, grid_heads, splits)](
            q, out, k_cache, v_cache, page_table, batch.req_rows, batch.qo_indptr, batch.kv_lens, batch.tree_mask,
            part_o, part_lse, kv_start if kv_start is not None else batch.kv_lens, lse if return_lse else out,
            num_q_blocks, t, splits, q.stride(0), page_table.stride(0), scratch_start, scale * 1.4426950408889634,
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
            BLOCK_D=dot_width(head_dim), PAGE_SIZE=self.page_size, SCRATCH_WIDTH=batch.scratch_width,
            MASK_WORDS=batch.tree_mask.shape[1], SPLIT_KV=splits > 1, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
            DOT_PRECISION=precision, HAS_KV_START=kv_start is not None, RETURN_LSE=return_lse,
            positions=batch.positions, window=window or 0, sinks=sinks if sinks is not None else out,
            HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None, chunk=chunk or 0,
            HAS_CHUNK=chunk is not None, PACK_GQA=pack, num_warps=4,
        )
        if splits > 1:
            merge_splits_kernel[(t, num_heads)](part_o, part_lse, out, t, splits, NUM_HEADS=num_heads,
                                                HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
                                                MAX_SPLITS=MAX_SPLITS, sinks=sinks if sinks is not None else out,
                                                HAS_SINKS=sinks is not None)
        return out, lse

    def grouped_splits(self, programs: int, max_kv_len: int, cfg: GroupedDecodeConfig, device: torch.device) -> int:
        """kv splits of a grouped decode launch of `programs` (request, kv head) pairs: enough to give every SM
        cfg.per_sm programs, at least MIN_KV_PER_SPLIT keys each, a power of two <= GROUPED_MAX_SPLITS; e.g. bs 8 x
        8 kv heads on 132 SMs at 2 per SM: 264 / 64 -> 5 -> 8 splits."""
        want = min(math.ceil(cfg.per_sm * self.sm_count(device) / max(programs, 1)),
                   math.ceil(max_kv_len / MIN_KV_PER_SPLIT), GROUPED_MAX_SPLITS)
        return 1 if want <= 1 else triton.next_power_of_2(want)

    def attend_grouped_decode(self, q, k_cache, v_cache, batch: ForwardBatch, page_table, scale,
                              window: int | None = None, sinks: torch.Tensor | None = None,
                              chunk: int | None = None):
        """`attend` for one query token per request and no scratch: each kv head's query heads in one tile
        (grouped_decode_kernel), the keys a token sees (all, or those of its window / chunk) split across up to
        GROUPED_MAX_SPLITS programs."""
        t = batch.num_tokens
        _, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[1]
        cfg = self.grouped_decode_config(k_cache.dtype, q.dtype)
        seen = min(batch.max_kv_len, window or batch.max_kv_len, chunk or batch.max_kv_len)  # keys a token sees
        splits = self.grouped_splits(batch.batch_size * num_kv_heads, seen, cfg, q.device)
        q = token_rows_contiguous(q)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, Hq, D]
        part_o, part_lse = _split_partials(splits, t, num_heads, head_dim, out)
        block_d = dot_width(head_dim)
        grouped_decode_kernel[(batch.batch_size, num_kv_heads, splits)](
            q, out, k_cache, v_cache, page_table, batch.req_rows, batch.qo_indptr, batch.kv_lens, part_o, part_lse,
            t, splits, q.stride(0), page_table.stride(0), scale * 1.4426950408889634, NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE_SIZE=self.page_size,
            BLOCK_H=dot_width(num_heads // num_kv_heads), SPLIT_KV=splits > 1,
            BLOCK_N=cfg.block_n, DOT_PRECISION=_dot_precision(q.dtype), PREFETCH=cfg.prefetch,
            FP16_DOT=cfg.fp16_dot, positions=batch.positions, window=window or 0,
            sinks=sinks if sinks is not None else out, HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None,
            chunk=chunk or 0, HAS_CHUNK=chunk is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if splits > 1:
            merge_splits_kernel[(t, num_heads)](part_o, part_lse, out, t, splits, NUM_HEADS=num_heads,
                                                HEAD_DIM=head_dim, BLOCK_D=block_d, MAX_SPLITS=GROUPED_MAX_SPLITS,
                                                sinks=sinks if sinks is not None else out,
                                                HAS_SINKS=sinks is not None)
        return out

    def forward_latent(self, q, latent, cache, value_dim, scratch_start, batch: ForwardBatch, page_table, scale):
        t = batch.num_tokens
        if t == 0:
            return q.new_empty(0, q.shape[1], value_dim)
        store_latent(latent, cache, batch.out_slots)
        out, _ = self.attend_latent(q, cache, value_dim, scratch_start, batch, page_table, scale)
        return out

    def attend_latent(self, q, cache, value_dim, scratch_start, batch: ForwardBatch, page_table, scale,
                      kv_start: torch.Tensor | None = None, return_lse: bool = False):
        """MLA attention of the batch's tokens over their latents (the cache already holds the new ones); the
        same `kv_start` / `return_lse` contract as `attend`. Returns (out [T, Hq, Dv], lse [T, Hq] or None)."""
        t = batch.num_tokens
        _, num_heads, key_dim = q.shape
        check_row_alignment(cache)
        block_m, num_warps, num_m_blocks, splits = self.latent_blocking(
            batch.batch_size, batch.max_q_len, batch.max_kv_len, num_heads, q.device, split=not return_lse,
            fp8_cache=cache.element_size() == 1)
        grid0 = batch.batch_size * num_m_blocks
        q = token_rows_contiguous(q)
        out = torch.empty(t, num_heads, value_dim, dtype=q.dtype, device=q.device)  # [T, Hq, Dv]
        lse = torch.empty(t, num_heads, dtype=torch.float32, device=q.device) if return_lse else None  # [T, Hq]
        part_o, part_lse = _split_partials(splits, t, num_heads, value_dim, out)
        # An FP8 cache's tiles are exact in tf32 (3 mantissa bits): its dots take tf32 whatever the query's dtype.
        # Triton 3.6 compiles the float32 ("ieee") dot over widened FP8 tiles at Dv = 512 into a kernel that returns
        # NaN in a quarter of the value columns on an H200 (test_gpu_mla_kernel_reads_an_fp8_cache_like_torch).
        precision = "tf32" if cache.element_size() == 1 else _dot_precision(q.dtype)
        mla_attention_kernel[(grid0, splits)](
            q, out, cache, page_table, batch.req_rows, batch.qo_indptr, batch.kv_lens, batch.tree_mask,
            part_o, part_lse, kv_start if kv_start is not None else batch.kv_lens, lse if return_lse else out,
            num_m_blocks, t, splits, q.stride(0), cache.stride(0), page_table.stride(0),
            batch.tree_mask.stride(0), scratch_start, scale * 1.4426950408889634,
            NUM_HEADS=num_heads, KEY_DIM=key_dim, VALUE_DIM=value_dim, BLOCK_DV=dot_width(value_dim),
            BLOCK_DR=dot_width(key_dim - value_dim), PAGE_SIZE=self.page_size,
            SCRATCH_WIDTH=batch.scratch_width, SPLIT_KV=splits > 1, BLOCK_M=block_m, BLOCK_N=MLA_BLOCK_N,
            DOT_PRECISION=precision, HAS_KV_START=kv_start is not None, RETURN_LSE=return_lse, num_warps=num_warps,
        )
        if splits > 1:
            merge_latent_splits_kernel[(t, num_heads)](part_o, part_lse, out, t, splits, NUM_HEADS=num_heads,
                                                       VALUE_DIM=value_dim, BLOCK_DV=dot_width(value_dim),
                                                       MAX_SPLITS=MLA_MAX_SPLITS)
        return out, lse
