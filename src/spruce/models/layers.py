"""Decoder building blocks shared by targets and drafts: RMSNorm, attention with fused qkv, gated MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spruce.attention.backend import AttentionBackend
from spruce.attention.metadata import ForwardBatch
from spruce.distributed.layers import mark_shard, row_parallel_linear
from spruce.models.rope import Rotary
from spruce.ops.fp8 import FP8_DTYPE, fp8_cache_inputs, fp8_cache_output
from spruce.ops import add_rms_norm, rms_norm, silu_and_mul


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back before the weight (as transformers does)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., dim] -> [..., dim]."""
        return rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one pass: the pre-norm residual-stream update."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    """Fused qkv projection (optionally biased), optional per-head q/k norm, rope, paged attention, o_proj.

    `in_features` is the width q/k/v read (EAGLE-3's midlayer reads 2 * hidden). With a tensor-parallel group
    `tp`, this rank holds num_heads / tp query heads and num_kv_heads / tp KV heads (qkv column-parallel by
    head, o_proj row-parallel with one all-reduce); num_heads and friends are then this rank's counts."""

    def __init__(self, in_features: int, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rotary: Rotary, backend: AttentionBackend, layer_id: int, bias: bool = False,
                 o_bias: bool = False, qk_norm: bool = False, eps: float = 1e-6, tp=None, window: int | None = None):
        super().__init__()
        self.window = window  # sliding window W: queries see the last W positions (None: all)
        if tp is not None:
            num_heads, num_kv_heads = tp.shard(num_heads, "num_attention_heads"), tp.shard(num_kv_heads,
                                                                                           "num_key_value_heads")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv = nn.Linear(in_features, self.q_size + 2 * self.kv_size, bias=bias)
        if tp is not None:  # q, k and v rows each cut by head: this rank's heads of each
            mark_shard(self.qkv.weight, 0, tp)
            if bias:
                mark_shard(self.qkv.bias, 0, tp)
        self.o_proj = row_parallel_linear(self.q_size * (tp.size if tp else 1), hidden, tp, "o_proj input",
                                          bias=o_bias)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.rotary = rotary
        self.backend = backend
        self.layer_id = layer_id
        self.scale = head_dim ** -0.5
        self.k_scale = self.v_scale = 1.0  # an FP8 KV cache's scales (the checkpoint's k_scale / v_scale)

    def project_qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """x [T, in_features] -> q [T, Hq, D], k [T, Hkv, D] (q/k-normed if configured, rotated), v [T, Hkv, D]."""
        t = x.shape[0]
        q, k, v = self.qkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.reshape(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary.forward_qk(q, k, positions, self.q_norm, self.k_norm)  # q/k-normed first if configured
        return q, k, v

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv, page_table: torch.Tensor) -> torch.Tensor:
        """x [T, in_features] -> [T, hidden]; stores this layer's K/V in `kv` (a KVPool) at batch.out_slots."""
        t = x.shape[0]
        q, k, v = self.project_qkv(x, batch.positions)
        k_cache, v_cache = kv.layer(self.layer_id)
        fp8_cache = k_cache.dtype == FP8_DTYPE  # holds k / k_scale, v / v_scale (ops/fp8.py)
        if fp8_cache:
            q, k, v = fp8_cache_inputs(q, k, v, self.k_scale, self.v_scale)
        extra = {} if self.window is None else {"window": self.window}  # backends without windows take none
        o = self.backend.forward(q, k, v, k_cache, v_cache, kv.scratch_start, batch, page_table, self.scale, **extra)
        if fp8_cache:
            o = fp8_cache_output(o, self.v_scale)
        return self.o_proj(o.reshape(t, self.q_size))

    def dense_causal(self, x: torch.Tensor, positions: torch.Tensor, batch: int, length: int) -> torch.Tensor:
        """The same attention over `batch` dense causal windows of `length` tokens, no cache:
        x [B*L, in_features] -> [B*L, hidden]. Training windows use it instead of the paged cache."""
        t = x.shape[0]
        q, k, v = self.project_qkv(x, positions)  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]

        def windows(y):  # [T, h, D] -> [B, h, L, D]
            return y.reshape(batch, length, y.shape[1], self.head_dim).transpose(1, 2)

        o = F.scaled_dot_product_attention(windows(q), windows(k), windows(v), is_causal=True, scale=self.scale,
                                           enable_gqa=self.num_heads != self.num_kv_heads)  # [B, Hq, L, D]
        return self.o_proj(o.transpose(1, 2).reshape(t, self.q_size))


class PreNormLayer(nn.Module):
    """Pre-norm decoder layer: x + self_attn(norm(x)), then + mlp(norm(.)). Residual stream [T, H] in and out.

    `self_attn(h, batch, kv, page_table)` and `mlp(h)` are whatever the architecture uses (MHA or MLA; a gated
    MLP or a mixture of experts)."""

    def __init__(self, hidden: int, eps: float, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = mlp

    def forward(self, x, batch, kv, page_table):
        out, residual = self.forward_residual(x, None, batch, kv, page_table)
        return out + residual

    def forward_residual(self, x, residual, batch, kv, page_table):
        """Residual-carrying form (x, residual) -> (mlp output, residual): each add is fused into the next
        norm, so the stream is x + residual at every layer boundary."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, batch, kv, page_table)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one [2I, H] weight.

    With a tensor-parallel group `tp` this rank holds I / tp of the intermediate (gate/up column-parallel,
    down row-parallel: one all-reduce, or none with `reduce=False`, the caller then reducing a sum of partials);
    `intermediate` is then this rank's share."""

    def __init__(self, hidden: int, intermediate: int, tp=None, reduce: bool = True):
        super().__init__()
        local = intermediate if tp is None else tp.shard(intermediate, "intermediate_size")
        self.intermediate = local
        self.gate_up = nn.Linear(hidden, 2 * local, bias=False)
        if tp is not None:  # gate rows and up rows each cut: this rank's part of each
            mark_shard(self.gate_up.weight, 0, tp)
        self.down = row_parallel_linear(intermediate, hidden, tp, "intermediate_size", reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, H]."""
        return self.down(silu_and_mul(self.gate_up(x)))


def fused_slices(attn: Attention) -> dict[str, tuple[int, int]]:
    """Row ranges of q/k/v inside the fused qkv weight."""
    q, kv = attn.q_size, attn.kv_size
    return {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
