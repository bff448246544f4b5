"""Llama 4 text targets (`Llama4ForCausalLM`, and the language model of the published image-text checkpoints,
`Llama4ForConditionalGeneration`, whose vision tower is not loaded): rope layers with chunked local attention
and L2-normed q/k, every no_rope_layer_interval-th layer without rope and with full attention (its queries
temperature-tuned by position), MoE layers (`moe_layers`: top-1 routing whose sigmoid weight scales the expert's input, plus one
shared expert) interleaved with dense MLPs of intermediate_size_mlp.

Published names, as loaded:
    model.layers.N.feed_forward.*                  -> layers.N.mlp.*
    feed_forward.router.weight                     -> the MoE router (mlp.gate)
    feed_forward.experts.gate_up_proj  [E, H, 2I]  gate columns, then up columns -> per expert w13 rows
    feed_forward.experts.down_proj     [E, I, H]                                  -> per expert w2 rows
    feed_forward.shared_expert.*                   -> mlp.shared_experts.*
    self_attn.{q,k}_proj rows                      Llama 4 rotates pairs (x0, x1), (x2, x3)...: each head's
                                                   rows are permuted to rotate-half order (q.k is unchanged)
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from spruce.attention.backend import AttentionBackend
from spruce.attention.metadata import ForwardBatch
from spruce.distributed.checkpoint import whole
from spruce.models.decoder import DecoderLM
from spruce.models.hf_config import ModelConfig
from spruce.models.layers import Attention, GatedMLP, PreNormLayer
from spruce.models.moe import MoE
from spruce.models.rope import Rotary
from spruce.models.weights import load_named_tensors

_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_QK = re.compile(r".*\.self_attn\.[qk]_proj\.(weight|bias)$")
_VISION_PREFIXES = ("vision_model.", "multi_modal_projector.")


class Llama4Attention(Attention):
    """Attention with Llama 4's per-layer options: rope or not, L2-normed q/k (rope layers with use_qk_norm),
    query temperature tuning (no-rope layers), chunked attention (`chunk` positions per chunk)."""

    def __init__(self, *args, use_rope: bool = True, l2_eps: float | None = None,
                 temperature: tuple[float, float] | None = None, chunk: int | None = None, **kw):
        super().__init__(*args, **kw)
        self.use_rope, self.l2_eps, self.temperature, self.chunk = use_rope, l2_eps, temperature, chunk

    def project_qkv(self, x: torch.Tensor, positions: torch.Tensor):
        t = x.shape[0]
        q, k, v = self.qkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.reshape(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.use_rope:
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        if self.l2_eps is not None:
            q, k = l2_norm(q, self.l2_eps), l2_norm(k, self.l2_eps)
        if self.temperature is not None:  # [T] log1p(floor((p + 1) / floor_scale)) * attn_scale + 1
            floor_scale, attn_scale = self.temperature
            scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q * scales[:, None, None]).to(q.dtype)
        return q, k, v

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv, page_table: torch.Tensor) -> torch.Tensor:
        if self.chunk is None:
            return super().forward(x, batch, kv, page_table)
        t = x.shape[0]
        q, k, v = self.project_qkv(x, batch.positions)
        k_cache, v_cache = kv.layer(self.layer_id)
        o = self.backend.forward(q, k, v, k_cache, v_cache, kv.scratch_start, batch, page_table, self.scale,
                                 chunk=self.chunk)
        return self.o_proj(o.reshape(t, self.q_size))

    def dense_causal(self, x: torch.Tensor, positions: torch.Tensor, batch: int, length: int) -> torch.Tensor:
        """The same attention over `batch` dense causal windows of `length` tokens, no cache (training): with
        chunks, position i sees j <= i in its own chunk (i // C == j // C). x [B*L, in_features] -> [B*L, hidden]."""
        if self.chunk is None:
            return super().dense_causal(x, positions, batch, length)
        t = x.shape[0]
        q, k, v = self.project_qkv(x, positions)  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]

        def windows(y):  # [T, h, D] -> [B, h, L, D]
            return y.reshape(batch, length, y.shape[1], self.head_dim).transpose(1, 2)

        i = torch.arange(length, device=x.device)
        seen = (i[None, :] <= i[:, None]) & (i[None, :] // self.chunk == i[:, None] // self.chunk)  # [L, L]
        o = F.scaled_dot_product_attention(windows(q), windows(k), windows(v), attn_mask=seen, scale=self.scale,
                                           enable_gqa=self.num_heads != self.num_kv_heads)  # [B, Hq, L, D]
        return self.o_proj(o.transpose(1, 2).reshape(t, self.q_size))


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim in float32, no weight (transformers' Llama4TextL2Norm)."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def interleaved_to_rotate_half(tensor: torch.Tensor, head_dim: int) -> torch.Tensor:
    """q/k projection rows [heads * D, ...] (or a bias [heads * D]): each head's rows 0, 2, 4, ..., then 1, 3, ...,
    so that the pair (2i, 2i + 1) that Llama 4 rotates becomes (i, i + D/2), which rotate-half rotates."""
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])  # [D]
    heads = tensor.shape[0] // head_dim
    rows = (torch.arange(heads)[:, None] * head_dim + order[None, :]).reshape(-1)
    return tensor[rows]


def expert_tensors(prefix: str, kind: str, tensor: torch.Tensor):
    """A fused expert tensor as per-expert `{prefix}.{e}.{gate,up,down}_proj.weight` rows."""
    out = []
    for e in range(tensor.shape[0]):
        if kind == "gate_up_proj":  # [H, 2I]: gate columns, then up columns
            gate, up = tensor[e].chunk(2, dim=-1)
            out += [(f"{prefix}.{e}.gate_proj.weight", gate.t()), (f"{prefix}.{e}.up_proj.weight", up.t())]
        else:  # down [I, H] -> [H, I]
            out.append((f"{prefix}.{e}.down_proj.weight", tensor[e].t()))
    return out


class Llama4ForCausalLM(DecoderLM):
    @staticmethod
    def build_layer(cfg: ModelConfig, rotary: Rotary, backend: AttentionBackend, index: int,
                    pool_layer: int, tp=None) -> PreNormLayer:
        """Layer `index`: its attention kind (rope + chunks + L2 norm, or no rope + temperature), then the MoE
        or the dense MLP (this rank's heads, expert, shared-expert and MLP columns with a tensor-parallel group
        `tp`: each head's q/k rows are permuted whole, so a rank's heads are permuted alike)."""
        h = cfg.hidden_size
        rope = cfg.rope_layers[index]
        attn = Llama4Attention(h, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rotary, backend, pool_layer,
                               bias=cfg.attention_bias, o_bias=cfg.o_proj_bias, use_rope=rope,
                               l2_eps=cfg.rms_norm_eps if rope and cfg.qk_l2_norm else None,
                               temperature=None if rope else cfg.attn_temperature, chunk=cfg.layer_chunk(index),
                               tp=tp)
        mlp = MoE(h, cfg.moe, tp) if cfg.moe.is_moe_layer(index) else GatedMLP(h, cfg.intermediate_size, tp)
        return PreNormLayer(h, cfg.rms_norm_eps, attn, mlp)

    def checkpoint_name(self, name: str) -> str | None:
        """Published names (the image-text checkpoints' `language_model.` prefix dropped, their vision tower and
        projector skipped) in this module."""
        if name.startswith(_VISION_PREFIXES):
            return None
        name = super().checkpoint_name(name.removeprefix("language_model."))
        if name is None:
            return None
        name = name.replace(".feed_forward.", ".mlp.").replace(".mlp.router.", ".mlp.gate.")
        return name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")

    def load_weights(self, tensors) -> None:
        """Published names into the model: fused experts split per expert, q/k rows to rotate-half order."""
        head_dim = self.config.head_dim

        def convert(pairs):
            for raw, tensor in pairs:
                name = self.checkpoint_name(raw)
                if name is None:
                    continue
                m = _EXPERTS.match(name)
                if m is not None:
                    yield from expert_tensors(m.group(1), m.group(2), whole(tensor))
                elif _QK.match(name):
                    yield name, interleaved_to_rotate_half(whole(tensor), head_dim)
                else:
                    yield name, tensor

        load_named_tensors(self, convert(tensors))
