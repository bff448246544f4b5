"""Rotary position embeddings (default, linear and Llama-3 scaling), matching transformers."""

from __future__ import annotations

import math

import torch

# Positions past max_position_embeddings the tables still cover: a speculative round may place draft/tree
# tokens up to S+1 positions past the last committed one (their outputs past the context are discarded).
POSITION_HEADROOM = 256


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies (transformers' ROPE_INIT_FUNCTIONS, same float ops)."""
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv = 1.0 / (theta ** exps)
    if scaling is None:
        return inv
    kind = scaling["rope_type"]
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor
    if kind != "llama3":
        raise ValueError(f"rope_type={kind!r} is not supported")
    # llama3: low frequencies divided by `factor`, high ones kept, a smooth ramp in between
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Rotary(torch.nn.Module):
    """cos/sin tables for positions [0, max_positions + POSITION_HEADROOM), computed once in float32.

    The tables are plain attributes (not buffers), so casting the model to bf16 leaves them exact; they are
    created on the current default device (the loader builds models under `torch.device(device)`)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv = inv_frequencies(head_dim, theta, scaling)  # [D/2]
        pos = torch.arange(max_positions + POSITION_HEADROOM, dtype=torch.float32)
        freqs = torch.outer(pos, inv.to(pos.device))  # [P, D/2]
        self.cos = freqs.cos()  # [P, D/2]
        self.sin = freqs.sin()  # [P, D/2]

    @property
    def num_positions(self) -> int:
        return self.cos.shape[0]

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, H, D] (rotate-half convention) at positions [T]; computed in float32 (in place on
        CUDA, where a fused kernel does it)."""
        from spruce.ops import rotary_

        return rotary_(x, self.cos, self.sin, positions)
