"""Counter-based random numbers: uniform(seed, position) with plain int64 torch ops.

A request's randomness depends only on its own seed and the positions it samples, never on the batch it
shares or on the device: seeded requests are reproducible, and the same ops run inside CUDA graphs.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_MULT = 0x45D9F3B  # < 2**27: products of 32-bit values stay inside int64


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply), on int64 tensors holding values < 2**32."""
    x = ((x ^ (x >> 16)) * _MULT) & _MASK32
    x = ((x ^ (x >> 16)) * _MULT) & _MASK32
    return x ^ (x >> 16)


def uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Uniform floats in [0, 1) from int64 tensors of one broadcast shape (each < 2**63)."""
    h = _mix32(seeds & _MASK32)
    h = _mix32(h ^ ((seeds >> 32) & _MASK32))
    h = _mix32(h ^ (positions & _MASK32))
    h = _mix32(h ^ 0x9E3779B9)
    return (h >> 8).to(torch.float64).div(float(1 << 24)).to(torch.float32)
