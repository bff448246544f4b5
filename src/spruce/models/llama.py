"""Llama-family decoder (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm) on the paged cache."""

from __future__ import annotations

from spruce.attention.backend import AttentionBackend
from spruce.models.decoder import DecoderLM
from spruce.models.hf_config import ModelConfig
from spruce.models.layers import Attention, GatedMLP, PreNormLayer
from spruce.models.rope import Rotary


class DecoderLayer(PreNormLayer):
    """Llama's layer: multi-head (grouped-query) attention and a gated MLP (or the given `mlp`: routed experts)."""

    def __init__(self, cfg: ModelConfig, rotary: Rotary, backend: AttentionBackend, layer_id: int, tp=None,
                 mlp=None):
        h = cfg.hidden_size
        attn = Attention(h, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rotary, backend, layer_id,
                         bias=cfg.attention_bias, o_bias=cfg.o_proj_bias, qk_norm=cfg.qk_norm, eps=cfg.rms_norm_eps,
                         tp=tp, window=cfg.layer_window(layer_id))
        super().__init__(h, cfg.rms_norm_eps, attn, mlp if mlp is not None else GatedMLP(h, cfg.intermediate_size, tp))


class LlamaForCausalLM(DecoderLM):
    @staticmethod
    def build_layer(cfg: ModelConfig, rotary: Rotary, backend: AttentionBackend, index: int,
                    pool_layer: int, tp=None) -> PreNormLayer:
        """A decoder layer (every index alike), caching its K/V in layer `pool_layer` of its pool."""
        return DecoderLayer(cfg, rotary, backend, pool_layer, tp)
