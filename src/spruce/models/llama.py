"""Llama-family decoder (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm) on the paged cache."""

from __future__ import annotations

import torch
from torch import nn

from spruce.attention.backend import AttentionBackend
from spruce.attention.metadata import ForwardBatch
from spruce.errors import ModelLoadError
from spruce.models.hf_config import ModelConfig
from spruce.models.layers import Attention, GatedMLP, RMSNorm
from spruce.models.rope import Rotary
from spruce.models.weights import load_named_tensors


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then + mlp(norm(.)). Residual stream [T, H] in and out."""

    def __init__(self, cfg: ModelConfig, rotary: Rotary, backend: AttentionBackend, layer_id: int):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(h, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rotary, backend, layer_id,
                                   bias=cfg.attention_bias, o_bias=cfg.o_proj_bias, qk_norm=cfg.qk_norm,
                                   eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = GatedMLP(h, cfg.intermediate_size)

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


class LlamaForCausalLM(nn.Module):
    """forward -> (final-normed hidden [T, H], aux [T, len(aux_layers) * H] or None).

    aux concatenates the residual-stream input of each layer in `aux_layers` (layer 0's input is the
    embedding): the features an EAGLE-3 head consumes."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, aux_layers: tuple[int, ...] = ()):
        super().__init__()
        for i in aux_layers:
            if not 0 <= i <= cfg.num_layers:
                raise ModelLoadError(f"aux hidden-state layer input {i} is outside [0, {cfg.num_layers}] "
                                     f"(the target has {cfg.num_layers} layers; {cfg.num_layers} = last layer's output)")
        self.config = cfg
        self.aux_layers = tuple(aux_layers)
        self.rotary = Rotary(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.rotary, backend, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings: ids [n] -> [n, H]."""
        return self.embed_tokens(ids)

    def forward(self, batch: ForwardBatch, kv, page_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward over batch.input_ids at batch.positions, writing every layer's K/V into `kv` (a KVPool).

        Returns (hidden [T, H] after the final norm, aux [T, len(aux_layers) * H] or None). T may be 0."""
        x = self.embed(batch.input_ids)  # [T, H]
        residual = None
        inputs = {}  # layer index -> residual-stream input of that layer (x + residual)
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:
                inputs[i] = x if residual is None else x + residual
            x, residual = layer.forward_residual(x, residual, batch, kv, page_table)
        if len(self.layers) in self.aux_layers:
            inputs[len(self.layers)] = x + residual
        aux = torch.cat([inputs[i] for i in self.aux_layers], dim=-1) if self.aux_layers else None
        hidden = self.norm(x) if residual is None else self.norm.add_forward(x, residual)[0]
        return hidden, aux

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, H] -> [n, V] float32."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return nn.functional.linear(hidden, weight).float()

    def load_weights(self, tensors) -> None:
        """Copy HF-named (name, tensor) pairs (model.layers.N.self_attn.q_proj.weight, lm_head.weight, ...) into
        the fused parameters. ModelLoadError naming the tensor on a missing, unknown or wrongly shaped one."""

        def rename(name: str) -> str | None:
            if name.endswith("rotary_emb.inv_freq") or (self.lm_head is None and name == "lm_head.weight"):
                return None
            return name.removeprefix("model.")

        load_named_tensors(self, tensors, rename)
