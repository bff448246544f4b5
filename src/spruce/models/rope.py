"""Rotary position embeddings (default, linear, Llama-3 and YaRN scaling), matching transformers."""

from __future__ import annotations

import math

import torch

from spruce.models.hf_config import yarn_mscale


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
    if kind == "yarn":
        return _yarn_inv_frequencies(inv, head_dim, theta, factor, scaling)
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


def _yarn_inv_frequencies(inv: torch.Tensor, dim: int, theta: float, factor: float, scaling: dict) -> torch.Tensor:
    """YaRN: extrapolated (original) frequencies for fast-rotating dims, interpolated (/ factor) for slow ones,
    a linear ramp between the dims that rotate beta_fast and beta_slow times over the original context."""
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)
    old_ctx = float(scaling["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # [D/2] weight of the original frequency
    return (inv / factor) * (1 - extrapolate) + inv * extrapolate


def attention_factor(scaling: dict | None) -> float:
    """YaRN's scale of cos/sin (1 for every other rope type): attention_factor if given, else
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else 0.1 ln(factor) + 1."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return yarn_mscale(factor, float(scaling["mscale"])) / yarn_mscale(factor, float(scaling["mscale_all_dim"]))
    return yarn_mscale(factor)


class Rotary(torch.nn.Module):
    """cos/sin tables for positions [0, num_positions), computed in float32: the model's max_position_embeddings as
    built, then what the engine's forwards can reach (`cover`, Limits.rope_positions: past the context, a round's
    draft and tree tokens).

    The tables are plain attributes (not buffers), so casting the model to bf16 leaves them exact; they are
    created on the current default device (the loader builds models under `torch.device(device)`)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        self.inv = inv_frequencies(head_dim, theta, scaling)  # [D/2]
        self.magnitude = attention_factor(scaling)
        self.cos = self.sin = torch.zeros(0, head_dim // 2, device=self.inv.device)
        self.cover(max_positions)

    def cover(self, num_positions: int) -> None:
        """Rebuild the tables for positions [0, num_positions) (on the tables' device)."""
        pos = torch.arange(num_positions, dtype=torch.float32, device=self.cos.device)
        freqs = torch.outer(pos, self.inv.to(pos.device))  # [P, D/2]
        self.cos = freqs.cos() * self.magnitude  # [P, D/2]
        self.sin = freqs.sin() * self.magnitude  # [P, D/2]

    @property
    def num_positions(self) -> int:
        return self.cos.shape[0]

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, H, D] (rotate-half convention) at positions [T]; computed in float32 (in place on
        CUDA, where a fused kernel does it)."""
        from spruce.ops import rotary_

        return rotary_(x, self.cos, self.sin, positions)

    def forward_qk(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, q_norm=None,
                   k_norm=None) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` of q [T, Hq, D] and k [T, Hkv, D] together, each through its RMSNorm first when given (q_norm,
        k_norm: layers.RMSNorm over D, one eps): on CUDA one fused launch for both, in place."""
        from spruce.ops import qk_rotary_

        if q_norm is None:
            return qk_rotary_(q, k, self.cos, self.sin, positions)
        return qk_rotary_(q, k, self.cos, self.sin, positions, q_norm.weight, k_norm.weight, q_norm.eps)
