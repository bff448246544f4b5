"""Write the new tokens' K and V into their cache slots (one program per token, K and V together)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache, v_cache, slots, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < WIDTH
    k = tl.load(k_ptr + t * WIDTH + offs, mask=mask)
    v = tl.load(v_ptr + t * WIDTH + offs, mask=mask)
    tl.store(k_cache + slot * WIDTH + offs, k.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(v_cache + slot * WIDTH + offs, v.to(v_cache.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k, v [T, Hkv, D] -> k_cache[slots], v_cache[slots] ([slots_total, Hkv, D], contiguous)."""
    t = k.shape[0]
    if t == 0:
        return
    width = k.shape[1] * k.shape[2]
    _store_kv_kernel[(t,)](k.contiguous(), v.contiguous(), k_cache, v_cache, slots, WIDTH=width,
                           BLOCK=triton.next_power_of_2(width))
