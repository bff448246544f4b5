"""The adaptive plain step's store of EAGLE-3 features into the feature ring, as one kernel.

An adaptive engine's plain step keeps the target's draft features at each row's position for a later catch-up
(speculative/feature_ring.py). For EAGLE-3 a feature is the concatenation of the residual-stream inputs of the aux
layers, each x + residual (layer 0's: the embedding). Built as torch ops inside the step's CUDA graph that was two
adds, a concatenation, `positions % W` and an indexed store: on the H200 (pycode-19m, one request at a 1.3k-token
context, 2026-11-23, bench/plain_step_kernels.py) the adaptive plain step ran 270.7 us of kernels and 314 us of
stream time against a plain engine's 256.6 and 288, +9% on a device-bound step. Here each aux layer's parts go
straight from the forward (DecoderLM.forward(aux_parts=True)) to their ring slots: one launch, each token's slot
(row, position mod W) and each part's column range written in place. Profiled the same way after (9730ff9): 260.2
against 255.9 us of kernels, the store itself 1.6 us.

Rounding equals the torch path's: each sum is computed in float32 and rounded once to the ring's dtype, as torch's
add of two bf16 tensors does.
"""

from __future__ import annotations

import torch

from spruce.ops.fused import _use_triton
from spruce.ops.triton_support import tl, triton

MAX_PARTS = 4  # aux layers one launch stores (EAGLE-3 reads 3)


def stream_inputs(parts: list[tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
    """The torch reference of a feature: [T, len(parts) * H], each part's x + residual (x alone without one)."""
    return torch.cat([x if r is None else x + r for x, r in parts], dim=-1)


def store_reference(ring: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                    parts: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
    """ring [R, W, F]; rows, positions [T]; parts: (x [T, H], residual [T, H] or None) per aux layer, F = len * H."""
    ring[rows, positions % ring.shape[1]] = stream_inputs(parts).to(ring.dtype)


@triton.jit
def _store_parts_kernel(ring_ptr, rows_ptr, pos_ptr, x0, r0, x1, r1, x2, r2, x3, r3, stride_row, stride_slot, width,
                        H: tl.constexpr, BLOCK: tl.constexpr, NUM_PARTS: tl.constexpr, HAS_R: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + t).to(tl.int64)
    slot = tl.load(pos_ptr + t).to(tl.int64) % width
    dst = ring_ptr + row * stride_row + slot * stride_slot
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    for j in tl.static_range(NUM_PARTS):
        if j == 0:
            x_ptr, r_ptr = x0, r0
        elif j == 1:
            x_ptr, r_ptr = x1, r1
        elif j == 2:
            x_ptr, r_ptr = x2, r2
        else:
            x_ptr, r_ptr = x3, r3
        v = tl.load(x_ptr + t * H + offs, mask=mask, other=0.0).to(tl.float32)
        if (HAS_R >> j) & 1:
            v += tl.load(r_ptr + t * H + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dst + j * H + offs, v.to(ring_ptr.dtype.element_ty), mask=mask)


def store_stream_parts(ring: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                       parts: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
    """ring[rows[t], positions[t] mod W] = the concatenation over `parts` of x[t] + residual[t] (x[t] without a
    residual), for each token t (module docstring). One Triton launch on CUDA (up to MAX_PARTS parts, each [T, H]
    of one width), the torch reference elsewhere."""
    if not parts:
        raise ValueError("store_stream_parts needs at least one (x, residual) part, got none")
    t, h = parts[0][0].shape
    if ring.shape[2] != len(parts) * h:
        raise ValueError(f"the ring's features are {ring.shape[2]} wide; {len(parts)} parts of {h} make "
                         f"{len(parts) * h}")
    if not _use_triton(ring) or len(parts) > MAX_PARTS or t == 0 or ring.stride(2) != 1:
        store_reference(ring, rows, positions, parts)
        return
    args, has_r = [], 0
    for j, (x, r) in enumerate(parts):
        args += [x.contiguous(), r.contiguous() if r is not None else x]
        has_r |= (r is not None) << j
    args += [args[0], args[0]] * (MAX_PARTS - len(parts))  # unused pointers
    _store_parts_kernel[(t,)](ring, rows, positions, *args, ring.stride(0), ring.stride(1), ring.shape[1], H=h,
                              BLOCK=triton.next_power_of_2(h), NUM_PARTS=len(parts), HAS_R=has_r)
