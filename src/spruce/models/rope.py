"""Rotary position embeddings (default, linear and Llama-3 scaling), matching transformers."""

from __future__ import annotations

import math

import torch


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies."""
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv = 1.0 / (theta ** exps)
    if scaling is None:
        return inv
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv / float(scaling["factor"])
    # llama3: low frequencies scaled by `factor`, high ones kept, a smooth ramp between
    factor = float(scaling["factor"])
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Rotary(torch.nn.Module):
    """cos/sin tables for every position, computed once in float32 (plain attributes, so casting the
    model to bf16 leaves them exact)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv = inv_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv.float())  # [P, D/2]
        self.cos = freqs.cos()
        self.sin = freqs.sin()

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, H, D] (rotate-half convention) at positions [T]."""
        cos = self.cos[positions][:, None, :]  # [T, 1, D/2]
        sin = self.sin[positions][:, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return out.to(x.dtype)
