"""Llama-family attention with routed experts: Qwen2-MoE (q/k/v bias, one shared expert behind a sigmoid gate),
Qwen3-MoE (per-head q/k RMSNorm) and Mixtral, on the fused MoE op the DeepSeek targets use (models/moe.py).

Layers are MoE where `MoEConfig.is_moe_layer` says (Qwen: every decoder_sparse_step-th layer outside
mlp_only_layers; Mixtral: every layer), the others a dense gated MLP of intermediate_size.

Published names, as loaded:
    Qwen2/3-MoE  model.layers.N.mlp.gate.weight, mlp.experts.{i}.{gate,up,down}_proj.weight,
                 (Qwen2) mlp.shared_expert.{gate,up,down}_proj.weight, mlp.shared_expert_gate.weight
    Mixtral      model.layers.N.block_sparse_moe.gate.weight, block_sparse_moe.experts.{i}.w1 / w3 / w2.weight
                 (gate / up / down)
"""

from __future__ import annotations

import re

from spruce.attention.backend import AttentionBackend
from spruce.models.hf_config import ModelConfig
from spruce.models.layers import GatedMLP, PreNormLayer
from spruce.models.llama import DecoderLayer, LlamaForCausalLM
from spruce.models.moe import MoE
from spruce.models.rope import Rotary

_MIXTRAL_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w([123])\.weight$")
_MIXTRAL_PROJ = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


def moe_checkpoint_name(name: str) -> str:
    """A published Qwen-MoE / Mixtral tensor name in spruce's MoE layout (others unchanged):
    `...block_sparse_moe.experts.3.w1.weight` -> `...mlp.experts.3.gate_proj.weight`,
    `...mlp.shared_expert.up_proj.weight` -> `...mlp.shared_experts.up_proj.weight`."""
    name = _MIXTRAL_EXPERT.sub(lambda m: f".mlp.experts.{m.group(1)}.{_MIXTRAL_PROJ[m.group(2)]}.weight", name)
    name = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
    return name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")


class MoEDecoderLM(LlamaForCausalLM):
    @staticmethod
    def build_layer(cfg: ModelConfig, rotary: Rotary, backend: AttentionBackend, index: int,
                    pool_layer: int, tp=None) -> PreNormLayer:
        """Checkpoint layer `index`: Llama-family attention, then routed experts or the dense MLP."""
        h = cfg.hidden_size
        mlp = MoE(h, cfg.moe, tp) if cfg.moe.is_moe_layer(index) else GatedMLP(h, cfg.intermediate_size, tp)
        return DecoderLayer(cfg, rotary, backend, pool_layer, tp, mlp=mlp)

    def checkpoint_name(self, name: str) -> str | None:
        name = super().checkpoint_name(name)
        return None if name is None else moe_checkpoint_name(name)
