"""Write the new tokens' K and V into their cache slots (one program per token, K and V together)."""

from __future__ import annotations

import torch

from spruce.ops.triton_support import tl, triton


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache, v_cache, slots, k_stride, v_stride, WIDTH: tl.constexpr,
                     BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < WIDTH
    k = tl.load(k_ptr + t * k_stride + offs, mask=mask)
    v = tl.load(v_ptr + t * v_stride + offs, mask=mask)
    tl.store(k_cache + slot * WIDTH + offs, k.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(v_cache + slot * WIDTH + offs, v.to(v_cache.dtype.element_ty), mask=mask)


def token_rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] with each token's H*D values contiguous (tokens may be strided, e.g. views of a fused qkv)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k, v [T, Hkv, D] -> k_cache[slots], v_cache[slots] ([slots_total, Hkv, D], contiguous)."""
    t = k.shape[0]
    if t == 0:
        return
    if k_cache.dtype != k.dtype:  # an FP8 cache: torch's round-to-nearest cast, the same as the torch backend's
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    k, v = token_rows_contiguous(k), token_rows_contiguous(v)
    width = k.shape[1] * k.shape[2]
    _store_kv_kernel[(t,)](k, v, k_cache, v_cache, slots, k.stride(0), v.stride(0), WIDTH=width,
                           BLOCK=triton.next_power_of_2(width))
