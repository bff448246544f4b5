"""The frozen target, as a dense causal forward over [B, L] windows, yielding what a draft head trains on.

The weights are spruce's own target model (loaded by spruce's loader, so the fused layouts, q/k norms, MLA,
MoE and rope scaling are the engine's); only attention differs from the paged path: training windows are
whole sequences, so each layer attends through its module's `dense_causal` (one causal
scaled_dot_product_attention) instead of going through a KV pool. tests/test_train_draft.py checks it against
the paged forward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from spruce.attention.backend import create_backend
from spruce.models.hf_config import ModelConfig
from spruce.models.loader import load_target


def default_aux_layers(cfg: ModelConfig) -> tuple[int, int, int]:
    """EAGLE-3's default features (the rule DraftConfig applies to a config without layer ids): the
    residual-stream inputs of target layers [2, L//2, L-3]."""
    n = cfg.num_layers
    return (2, n // 2, n - 3)


class TargetOutputs(NamedTuple):
    """What one dense target forward over windows [B, L] yields (no gradients)."""

    aux: torch.Tensor | None  # [B, L, A*H] residual-stream inputs of the aux layers (EAGLE-3); None without any
    hidden: torch.Tensor  # [B, L, H] the final normed hidden state (what an MTP layer reads at step 0)
    logits: torch.Tensor  # [B, L, V] float32; [:, p] is the target's prediction of token p+1


class FrozenTarget:
    """target(ids [B, L]) -> TargetOutputs(aux, hidden, logits), no gradients.

    aux concatenates the residual-stream inputs of `aux_layers` (EAGLE-3's fc input; aux_layers=() for an
    MTP head, which reads the final normed hidden instead)."""

    def __init__(self, path, device: str | torch.device, dtype: torch.dtype,
                 aux_layers: tuple[int, ...] | None = None):
        self.path = path
        self.config = ModelConfig.from_dir(path)
        self.device = torch.device(device)
        self.dtype = dtype
        self.aux_layers = tuple(aux_layers) if aux_layers is not None else default_aux_layers(self.config)
        backend = create_backend("torch", 1)  # the layers' paged attention is never called here
        self.model = load_target(path, dtype, self.device, backend, aux_layers=self.aux_layers)

    @property
    def output_weight(self) -> torch.Tensor:
        """[V, H] the target's lm_head (its embedding when tied)."""
        return self.model.output_weight

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> TargetOutputs:
        m = self.model
        b, length = ids.shape
        pos = torch.arange(length, device=ids.device).repeat(b)  # [B*L]
        x = m.embed(ids.reshape(-1))  # [B*L, H] residual stream
        inputs = {}
        for i, layer in enumerate(m.layers):
            if i in self.aux_layers:
                inputs[i] = x
            x = x + layer.self_attn.dense_causal(layer.input_layernorm(x), pos, b, length)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        inputs[len(m.layers)] = x
        hidden = m.norm(x)  # [B*L, H]
        logits = m.compute_logits(hidden)  # [B*L, V]
        aux = torch.cat([inputs[i] for i in self.aux_layers], dim=-1).view(b, length, -1) if self.aux_layers else None
        return TargetOutputs(aux, hidden.view(b, length, -1), logits.view(b, length, -1))
