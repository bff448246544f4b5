"""DeepSeek-V2 / V3 targets: MLA attention over the latent cache, MoE feed-forward past the first dense layers.

Loads published checkpoints (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`): per-expert weights
`mlp.experts.{i}.{gate,up,down}_proj`, `mlp.gate.weight` (+ `e_score_correction_bias` for V3), shared experts,
MLA with or without q_lora_rank. MTP layers stored after the main ones (`model.layers.{L..}`) are not part of
the target; the NEXTN draft loads them.
"""

from __future__ import annotations

import re

from spruce.attention.backend import AttentionBackend
from spruce.models.decoder import DecoderLM
from spruce.models.hf_config import ModelConfig
from spruce.models.layers import GatedMLP, PreNormLayer
from spruce.models.mla import MLAttention, rope_rows_to_rotate_half
from spruce.models.moe import MoE, router_bias_name
from spruce.models.rope import Rotary
from spruce.models.weights import load_named_tensors

_LAYER = re.compile(r"layers\.(\d+)\.")


class DeepseekForCausalLM(DecoderLM):
    @staticmethod
    def build_rotary(cfg: ModelConfig) -> Rotary:
        """Rope over qk_rope_head_dim (the heads' shared rope key)."""
        return Rotary(cfg.mla.qk_rope_head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)

    @staticmethod
    def build_layer(cfg: ModelConfig, rotary: Rotary, backend: AttentionBackend, index: int,
                    pool_layer: int, tp=None) -> PreNormLayer:
        """Checkpoint layer `index` (MoE past first_k_dense_replace, MTP layers included), caching its latents
        in layer `pool_layer` of its pool."""
        h = cfg.hidden_size
        moe = cfg.moe is not None and cfg.moe.is_moe_layer(index)
        mlp = MoE(h, cfg.moe, tp) if moe else GatedMLP(h, cfg.intermediate_size, tp)
        return PreNormLayer(h, cfg.rms_norm_eps, MLAttention(cfg, rotary, backend, pool_layer, tp), mlp)

    def load_weights(self, tensors) -> None:
        """Published names into the model; the MTP layers (index >= num_layers) are skipped."""
        cfg = self.config

        def rename(name: str) -> str | None:
            name = self.checkpoint_name(name)
            m = _LAYER.match(name or "")
            if name is None or (m and int(m.group(1)) >= cfg.num_layers):
                return None
            return router_bias_name(name)

        buffers = [f"layers.{i}.mlp.e_score_correction_bias" for i in range(cfg.num_layers)]
        load_named_tensors(self, ((n, rope_rows_to_rotate_half(n, t, cfg)) for n, t in tensors), rename,
                           buffers=buffers)
