"""Top-k of a softmax over a vocabulary, for the draft loop: (probabilities, ids) of the k most likely tokens.

Reference: `logits.float().softmax(-1).topk(k)`. On the GPU two small Triton kernels replace the softmax over
the whole row plus a full top-k:
  1. per (row, chunk of CHUNK logits): the chunk's max m_c and sum_c exp(x - m_c) (for the row's logsumexp),
     and its k best logits (k rounds of max-and-mask in registers);
  2. per row: lse = M + log(sum_c s_c * exp(m_c - M)), with s_c the chunk's sum and M = max_c m_c, then the
     k best of the chunks' candidates, written as probabilities exp(x - lse).
Among exactly equal logits the lower token id wins (torch.topk leaves that order unspecified).
"""

from __future__ import annotations

import torch

from spruce.ops.fused import _use_triton
from spruce.ops.triton_support import tl, triton

CHUNK = 2048
MAX_K = 16
_NO_INDEX = tl.constexpr(2147483647)  # a global a kernel reads must be a constexpr


@triton.jit
def _chunk_stats_topk_kernel(x_ptr, vals_ptr, idx_ptr, cmax_ptr, csum_ptr, width, num_chunks, K: tl.constexpr,
                             CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * width + offs, mask=offs < width, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # a chunk of -inf logits adds exp(-inf) = 0
    tl.store(cmax_ptr + row * num_chunks + chunk, m)
    tl.store(csum_ptr + row * num_chunks + chunk, tl.sum(tl.exp(x - m), axis=0))
    out = (row * num_chunks + chunk) * K
    for i in tl.static_range(K):
        best = tl.max(x, axis=0)
        where = tl.min(tl.where(x == best, offs, _NO_INDEX), axis=0)  # lowest id among equals
        tl.store(vals_ptr + out + i, best)
        tl.store(idx_ptr + out + i, where.to(tl.int64))
        x = tl.where(offs == where, float("-inf"), x)


@triton.jit
def _merge_topk_kernel(vals_ptr, idx_ptr, cmax_ptr, csum_ptr, p_ptr, ids_ptr, num_chunks, K: tl.constexpr,
                       BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs_c = tl.arange(0, BLOCK_C)
    cmax = tl.load(cmax_ptr + row * num_chunks + offs_c, mask=offs_c < num_chunks, other=float("-inf"))
    csum = tl.load(csum_ptr + row * num_chunks + offs_c, mask=offs_c < num_chunks, other=0.0)
    big = tl.max(cmax, axis=0)
    lse = big + tl.log(tl.sum(csum * tl.exp(cmax - big), axis=0))
    offs_v = tl.arange(0, BLOCK_V)
    n = num_chunks * K
    vals = tl.load(vals_ptr + row * n + offs_v, mask=offs_v < n, other=float("-inf"))
    ids = tl.load(idx_ptr + row * n + offs_v, mask=offs_v < n, other=_NO_INDEX).to(tl.int32)
    for i in tl.static_range(K):
        best = tl.max(vals, axis=0)
        where = tl.min(tl.where(vals == best, ids, _NO_INDEX), axis=0)  # lowest id among equals
        tl.store(p_ptr + row * K + i, tl.exp(best - lse))
        tl.store(ids_ptr + row * K + i, where.to(tl.int64))
        vals = tl.where(ids == where, float("-inf"), vals)


def softmax_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, V] -> (probabilities [rows, k] float32, ids [rows, k] int64) of the k most likely tokens
    under softmax(logits), most likely first."""
    rows, width = logits.shape
    if not _use_triton(logits) or k > MAX_K or width <= CHUNK or rows == 0:
        return logits.float().softmax(dim=-1).topk(k, dim=-1)
    chunks = triton.cdiv(width, CHUNK)
    dev = logits.device
    vals = torch.empty(rows, chunks * k, dtype=torch.float32, device=dev)  # [rows, chunks*k]
    idx = torch.empty(rows, chunks * k, dtype=torch.int64, device=dev)
    cmax = torch.empty(rows, chunks, dtype=torch.float32, device=dev)  # [rows, chunks]
    csum = torch.empty(rows, chunks, dtype=torch.float32, device=dev)
    _chunk_stats_topk_kernel[(rows, chunks)](logits.contiguous(), vals, idx, cmax, csum, width, chunks, K=k,
                                             CHUNK=CHUNK)
    p = torch.empty(rows, k, dtype=torch.float32, device=dev)  # [rows, k]
    ids = torch.empty(rows, k, dtype=torch.int64, device=dev)
    _merge_topk_kernel[(rows,)](vals, idx, cmax, csum, p, ids, chunks, K=k, BLOCK_C=triton.next_power_of_2(chunks),
                                BLOCK_V=triton.next_power_of_2(chunks * k))
    return p, ids
