"""Top-k of a few (k <= 16) over a wide last dim (a vocabulary), for the draft loop.

torch.topk over [rows, 32000] costs tens of microseconds on the GPU; here a Triton pass finds each chunk's
k best (k rounds of max-and-mask in registers) and torch.topk finishes over the rows' chunks * k candidates.
Values are exact; among exactly equal values either index may be returned (as with torch.topk).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spruce.ops.fused import _use_triton

CHUNK = 2048


@triton.jit
def _chunk_topk_kernel(x_ptr, vals_ptr, idx_ptr, width, num_chunks, K: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * width + offs, mask=offs < width, other=float("-inf")).to(tl.float32)
    out = (row * num_chunks + chunk) * K
    for i in tl.static_range(K):
        best = tl.max(x, axis=0)
        where = tl.min(tl.where(x == best, offs, 2147483647), axis=0)  # lowest index among equals
        tl.store(vals_ptr + out + i, best)
        tl.store(idx_ptr + out + i, where.to(tl.int64))
        x = tl.where(offs == where, float("-inf"), x)


def topk_small(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest along the last dim of x [rows, width], descending."""
    rows, width = x.shape
    if not _use_triton(x) or k > 16 or width <= CHUNK or rows == 0:
        return x.topk(k, dim=-1)
    chunks = triton.cdiv(width, CHUNK)
    vals = torch.empty(rows, chunks * k, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows, chunks * k, dtype=torch.int64, device=x.device)
    _chunk_topk_kernel[(rows, chunks)](x.contiguous(), vals, idx, width, chunks, K=k, CHUNK=CHUNK)
    best, pos = vals.topk(k, dim=-1)
    return best.to(x.dtype), idx.gather(1, pos)
