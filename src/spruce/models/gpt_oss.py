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
MXFP4-quantized checkpoints (the published ones) are refused by hf_config with the dequantization recipe.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from spruce.attention.backend import AttentionBackend
from spruce.attention.metadata import ForwardBatch
from spruce.distributed.checkpoint import whole
from spruce.errors import ModelLoadError
from spruce.models.decoder import DecoderLM
from spruce.models.hf_config import ModelConfig
from spruce.models.layers import Attention, PreNormLayer
from spruce.models.moe import MoE
from spruce.models.rope import Rotary
from spruce.models.weights import load_named_tensors

_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)$")


class SinkAttention(Attention):
    """Attention with a learned per-head sink logit (`sinks` [Hq]) in every softmax, over all cached positions
    or, with `window`, over the last `window` positions only (plus a tree's ancestors)."""

    def __init__(self, *args, window: int | None = None, **kw):
        super().__init__(*args, **kw)
        self.window = window
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))  # [Hq], kept in float32

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv, page_table: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.project_qkv(x, batch.positions)
        k_cache, v_cache = kv.layer(self.layer_id)
        o = self.backend.forward(q, k, v, k_cache, v_cache, kv.scratch_start, batch, page_table, self.scale,
                                 window=self.window, sinks=self.sinks)
        return self.o_proj(o.reshape(t, self.q_size))


def deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[..., 2I] columns g0 u0 g1 u1 ... -> [..., 2I] columns g0 g1 ... u0 u1 ... (spruce's gate-then-up)."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def expert_tensors(prefix: str, kind: str, tensor: torch.Tensor):
    """One published fused expert tensor as the (name, tensor) pairs spruce's RoutedExperts loads: per expert
    `{prefix}.{e}.{gate,up,down}_proj.weight` rows, or the whole bias `{prefix}.b13` / `{prefix}.b2`."""
    if kind == "gate_up_proj_bias":
        return [(f"{prefix}.b13", deinterleave(tensor))]
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


class GptOssForCausalLM(DecoderLM):
    def __init__(self, cfg: ModelConfig, backend, aux_layers: tuple[int, ...] = (), tp=None):
        if tp is not None:
            raise ModelLoadError(f"tensor parallelism (tp_size={tp.size}) is not supported for {cfg.architecture} "
                                 f"yet ({cfg.tp_refusal}); use tp_size=1")
        super().__init__(cfg, backend, aux_layers, tp)

    @staticmethod
    def build_rotary(cfg: ModelConfig) -> Rotary:
        return Rotary(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)

    @staticmethod
    def build_layer(cfg: ModelConfig, rotary: Rotary, backend: AttentionBackend, index: int,
                    pool_layer: int, tp=None) -> PreNormLayer:
        """Layer `index`: sink attention (windowed where layer_types says so), then the MoE."""
        h = cfg.hidden_size
        attn = SinkAttention(h, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rotary, backend, pool_layer,
                             bias=cfg.attention_bias, o_bias=cfg.o_proj_bias, window=cfg.layer_window(index))
        return PreNormLayer(h, cfg.rms_norm_eps, attn, MoE(h, cfg.moe))

    def checkpoint_name(self, name: str) -> str | None:
        name = super().checkpoint_name(name)
        return None if name is None else name.replace(".mlp.router.", ".mlp.gate.")

    def load_weights(self, tensors) -> None:
        """Published names into the model, the fused expert tensors split per expert (`expert_tensors`)."""

        def split(pairs):
            for name, tensor in pairs:
                m = _EXPERTS.match(name)
                if m is None:
                    yield name, tensor
                else:
                    yield from expert_tensors(m.group(1), m.group(2), whole(tensor))

        load_named_tensors(self, split(tensors), self.checkpoint_name)
