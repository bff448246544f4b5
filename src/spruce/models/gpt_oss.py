"""gpt-oss targets (`GptOssForCausalLM`): biased q/k/v/o attention with a learned sink logit per head, layers
alternating sliding-window and full attention (config `layer_types`), YaRN rope, and in every layer a mixture
of experts with a biased router, biased experts and the clamped SwiGLU (hf_config.MoEConfig).

Published names, as loaded (the experts fused and transposed, gate and up interleaved column by column):
    model.layers.N.self_attn.sinks                 [Hq]
    model.layers.N.mlp.router.{weight,bias}        -> mlp.gate (the MoE router)
    model.layers.N.mlp.experts.gate_up_proj        [E, H, 2I], columns g0 u0 g1 u1 ... -> w13 [E, 2I, H]
    model.layers.N.mlp.experts.gate_up_proj_bias   [E, 2I], the same interleaving      -> b13 [E, 2I]
    model.layers.N.mlp.experts.down_proj           [E, I, H]                           -> w2 [E, H, I]
    model.layers.N.mlp.experts.down_proj_bias      [E, H]                              -> b2
MXFP4 checkpoints (the published ones) store each fused expert tensor as `{name}_blocks` [E, rows, G, 16]
uint8 (two FP4 values a byte, low nibble first; rows = 2I for gate_up, H for down; G * 32 = the input width) and
`{name}_scales` [E, rows, G] uint8 (a power of two 2^(s - 127) per 32 values): they are dequantized at load
(`dequantize_mxfp4`, exact in bf16) into the layout above, and run in the model dtype (there is no MXFP4 kernel).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from spruce.attention.backend import AttentionBackend
from spruce.attention.metadata import ForwardBatch
from spruce.distributed.checkpoint import whole
from spruce.distributed.layers import mark_shard
from spruce.errors import ModelLoadError
from spruce.models.decoder import DecoderLM
from spruce.models.hf_config import ModelConfig
from spruce.models.layers import Attention, PreNormLayer
from spruce.models.moe import MoE, gate_up_by_rank
from spruce.models.rope import Rotary
from spruce.models.weights import load_named_tensors

_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)$")
_MXFP4 = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)_(blocks|scales)$")
# the 16 values of an FP4 (e2m1) nibble
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class SinkAttention(Attention):
    """Attention with a learned per-head sink logit (`sinks` [Hq]) in every softmax, over all cached positions
    or, with `window`, over the last `window` positions only (plus a tree's ancestors)."""

    def __init__(self, *args, window: int | None = None, tp=None, **kw):
        super().__init__(*args, tp=tp, **kw)
        self.window = window
        # [Hq] (this rank's heads when tensor-parallel), kept in float32
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        if tp is not None:
            mark_shard(self.sinks, 0, tp)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv, page_table: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.project_qkv(x, batch.positions)
        k_cache, v_cache = kv.layer(self.layer_id)
        o = self.backend.forward(q, k, v, k_cache, v_cache, kv.scratch_start, batch, page_table, self.scale,
                                 window=self.window, sinks=self.sinks)
        return self.o_proj(o.reshape(t, self.q_size))

    def dense_causal(self, x: torch.Tensor, positions: torch.Tensor, batch: int, length: int) -> torch.Tensor:
        """The same attention over `batch` dense causal windows of `length` tokens, no cache (training):
        position i sees j <= i (and i - j < window), each head's sink logit joins its softmax.
        x [B*L, in_features] -> [B*L, hidden]; computed in float32."""
        t = x.shape[0]
        q, k, v = self.project_qkv(x, positions)  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
        group = self.num_heads // self.num_kv_heads

        def windows(y, repeat=1):  # [T, h, D] -> [B, h * repeat, L, D] float32
            y = y.float().reshape(batch, length, y.shape[1], self.head_dim).transpose(1, 2)
            return y.repeat_interleave(repeat, dim=1)

        scores = windows(q) @ windows(k, group).transpose(-1, -2) * self.scale  # [B, Hq, L, L]
        i = torch.arange(length, device=x.device)
        seen = i[None, :] <= i[:, None]  # [L, L]
        if self.window is not None:
            seen = seen & (i[:, None] - i[None, :] < self.window)
        scores = scores.masked_fill(~seen, float("-inf"))
        sink = self.sinks.float()[None, :, None, None].expand(batch, -1, length, 1)  # [B, Hq, L, 1]
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :length]
        o = (probs @ windows(v, group)).to(x.dtype)  # [B, Hq, L, D]
        return self.o_proj(o.transpose(1, 2).reshape(t, self.q_size))


def deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[..., 2I] columns g0 u0 g1 u1 ... -> [..., 2I] columns g0 g1 ... u0 u1 ... (spruce's gate-then-up)."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def expert_tensors(prefix: str, kind: str, tensor: torch.Tensor, ranks: int = 1):
    """One published fused expert tensor as the (name, tensor) pairs spruce's RoutedExperts loads: per expert
    `{prefix}.{e}.{gate,up,down}_proj.weight` rows, or the whole bias `{prefix}.b13` (its columns by rank for
    `ranks` tensor-parallel ranks, `gate_up_by_rank`) / `{prefix}.b2`."""
    if kind == "gate_up_proj_bias":
        return [(f"{prefix}.b13", gate_up_by_rank(deinterleave(tensor), ranks))]
    if kind == "down_proj_bias":
        return [(f"{prefix}.b2", tensor)]
    out = []
    for e in range(tensor.shape[0]):
        if kind == "gate_up_proj":  # [H, 2I] -> gate [I, H], up [I, H]
            w = tensor[e]
            out += [(f"{prefix}.{e}.gate_proj.weight", w[:, 0::2].t()),
                    (f"{prefix}.{e}.up_proj.weight", w[:, 1::2].t())]
        else:  # down [I, H] -> [H, I]
            out.append((f"{prefix}.{e}.down_proj.weight", tensor[e].t()))
    return out


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [E, rows, G, 16] uint8 and scales [E, rows, G] uint8 -> [E, G * 32, rows] bfloat16: the published
    fused layout of the unquantized tensor (gate_up_proj [E, H, 2I], down_proj [E, I, H]); transformers'
    convert_moe_packed_tensors."""
    if blocks.shape[:-1] != scales.shape or blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ModelLoadError(f"MXFP4 blocks {tuple(blocks.shape)} ({blocks.dtype}) and scales {tuple(scales.shape)} "
                             f"({scales.dtype}) do not match: expected uint8 [E, rows, G, 16] and [E, rows, G]")
    lut = torch.tensor(FP4_VALUES, dtype=torch.bfloat16)
    e, rows, g, b = blocks.shape
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [E, rows, G, 16, 2]
    values = torch.ldexp(values.reshape(e, rows, g, 2 * b), scales.to(torch.int32)[..., None] - 127)
    return values.reshape(e, rows, g * 2 * b).transpose(1, 2).contiguous()


class GptOssForCausalLM(DecoderLM):
    @staticmethod
    def build_layer(cfg: ModelConfig, rotary: Rotary, backend: AttentionBackend, index: int,
                    pool_layer: int, tp=None) -> PreNormLayer:
        """Layer `index`: sink attention (windowed where layer_types says so), then the MoE (this rank's heads,
        sinks and expert columns with a tensor-parallel group `tp`)."""
        h = cfg.hidden_size
        attn = SinkAttention(h, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rotary, backend, pool_layer,
                             bias=cfg.attention_bias, o_bias=cfg.o_proj_bias, window=cfg.layer_window(index), tp=tp)
        return PreNormLayer(h, cfg.rms_norm_eps, attn, MoE(h, cfg.moe, tp))

    def checkpoint_name(self, name: str) -> str | None:
        name = super().checkpoint_name(name)
        return None if name is None else name.replace(".mlp.router.", ".mlp.gate.")

    def load_weights(self, tensors) -> None:
        """Published names into the model, the fused expert tensors split per expert (`expert_tensors`)."""
        ranks = 1 if self.tp is None else self.tp.size

        def split(pairs):
            packed = {}  # (prefix, tensor name) -> {"blocks" / "scales": tensor} until both arrived
            for name, tensor in pairs:
                q = _MXFP4.match(name)
                if q is not None:
                    parts = packed.setdefault((q.group(1), q.group(2)), {})
                    parts[q.group(3)] = whole(tensor)
                    if len(parts) == 2:
                        del packed[(q.group(1), q.group(2))]
                        yield from expert_tensors(q.group(1), q.group(2),
                                                  dequantize_mxfp4(parts["blocks"], parts["scales"]), ranks)
                    continue
                m = _EXPERTS.match(name)
                if m is None:
                    yield name, tensor
                else:
                    yield from expert_tensors(m.group(1), m.group(2), whole(tensor), ranks)
            if packed:
                raise ModelLoadError(f"MXFP4 expert tensors without their blocks or scales: "
                                     f"{sorted(f'{p}.{n}' for p, n in packed)}")

        load_named_tensors(self, split(tensors), self.checkpoint_name)
