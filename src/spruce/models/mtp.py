"""MTP (NEXTN) drafts: a checkpoint's own multi-token-prediction layers, in DeepSeek's published layout.

MTP layer j of n is stored after the L main layers as `model.layers.{L+j}.*`:
    embed_tokens (shared by all MTP layers, and equal to the target's), enorm, hnorm, eh_proj,
    one decoder layer of the target's own kind (input_layernorm, self_attn, post_attention_layernorm, mlp:
    MLA + MoE for DeepSeek, MHA + gated MLP for a Llama target), shared_head.norm, shared_head.head.
For the pair (h[p], t[p+1]) (h: the target's final normed hidden state, or the previous MTP step's output):
    x = eh_proj([enorm(embed(t[p+1])), hnorm(h[p])])         (embeddings first, as SGLang and vLLM)
    out = shared_head.norm(decoder(x))                        the next step's feature (SGLang's convention)
    logits = shared_head.head(out)                            predict t[p+2]
The decoder attends over its own cache at the pair's position p (spruce pairs run at the feature's
position; vLLM runs them at the token's, p + 1: rope is relative, so every score, and the output, is the same).

Several layers: draft step j uses layer min(j, n-1). The draft extend over committed tokens runs the layers
as a chain on the same pairs (layer j's feature is layer j-1's output at that position), so every layer's
cache covers every committed position; it returns layer 0's output, which seeds step 1.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from spruce.errors import ConfigError, ModelLoadError
from spruce.models.hf_config import ModelConfig
from spruce.models.layers import RMSNorm
from spruce.models.mla import rope_rows_to_rotate_half
from spruce.models.moe import router_bias_name
from spruce.models.registry import target_class
from spruce.models.weights import export_named_tensors, load_named_tensors

_LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\.(.*)")
_OWN_PARTS = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")


class MTPLayer(nn.Module):
    """One MTP layer: (embeds [T, H], feature [T, H]) -> normed output [T, H]."""

    def __init__(self, cfg: ModelConfig, rotary, backend, index: int, pool_layer: int):
        super().__init__()
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.decoder = target_class(cfg).build_layer(cfg, rotary, backend, index, pool_layer)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.shared_head.head = nn.Linear(h, cfg.vocab_size, bias=False)

    def forward(self, embeds, feature, batch, kv, page_table) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(feature.to(embeds.dtype))], dim=-1))  # [T, H]
        out, residual = self.decoder.forward_residual(x, None, batch, kv, page_table)
        return self.shared_head.norm.add_forward(out, residual)[0]


class MTPDraft(nn.Module):
    """The draft interface the EAGLE worker drives (as EagleDraft): forward(input_ids, features, batch, kv,
    page_table, layer) -> hidden [T, H]; compute_logits(hidden, layer) -> [T, V] float32; draft_to_target."""

    def __init__(self, cfg: ModelConfig, backend, num_layers: int, first_index: int):
        super().__init__()
        self.config = cfg
        self.hidden_size = cfg.hidden_size
        self.num_layers = num_layers
        self.first_index = first_index  # checkpoint index of MTP layer 0 (= the target's num_hidden_layers)
        self.draft_vocab_size = cfg.vocab_size
        self.feature_width_first_step = cfg.hidden_size  # the target's final normed hidden state
        self.rotary = target_class(cfg).build_rotary(cfg)
        self.layers = nn.ModuleList(MTPLayer(cfg, self.rotary, backend, first_index + j, j) for j in range(num_layers))
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)

    @property
    def attention_config(self) -> ModelConfig:
        """The MTP layers' attention shape: the target's (MLA for DeepSeek)."""
        return self.config

    def step_layer(self, step: int) -> int:
        """The layer draft step `step` runs (step 0's top-K comes from the extend, i.e. layer 0)."""
        return min(step, self.num_layers - 1)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, batch, kv, page_table,
                layer: int | None = None) -> torch.Tensor:
        """layer j: that layer alone (a draft step). None (draft extend): the chain through every layer, so each
        layer's cache gets the pairs; returns layer 0's output."""
        embeds = self.embed(input_ids)  # [T, H]
        if layer is not None:
            return self.layers[layer](embeds, features, batch, kv, page_table)
        first = h = self.layers[0](embeds, features, batch, kv, page_table)
        for mtp in self.layers[1:]:
            h = mtp(embeds, h, batch, kv, page_table)
        return first

    def compute_logits(self, hidden: torch.Tensor, layer: int = 0) -> torch.Tensor:
        return nn.functional.linear(hidden, self.layers[layer].shared_head.head.weight).float()

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids  # the MTP head predicts over the target's vocabulary

    def use_target_weights(self, target) -> None:
        """Nothing to share: the published layout carries its own embedding and heads (copies of the target's)."""

    def load_weights(self, tensors, path: str = "") -> None:
        """model.layers.{first_index + j}.* into layer j; the main layers and everything else are skipped."""
        cfg, first, n = self.config, self.first_index, self.num_layers

        def stream():
            for raw, tensor in tensors:
                m = _LAYER.fullmatch(raw)
                if m is None or not first <= int(m.group(1)) < first + n:
                    continue
                j, rest = int(m.group(1)) - first, m.group(2)
                if rest == "embed_tokens.weight":
                    if j == 0:
                        yield "embed_tokens.weight", tensor
                    continue
                if rest.endswith("rotary_emb.inv_freq"):
                    continue
                if not rest.startswith(_OWN_PARTS):
                    rest = "decoder." + router_bias_name(rest)
                yield f"layers.{j}.{rest}", rope_rows_to_rotate_half(rest, tensor, cfg)

        buffers = [f"layers.{j}.decoder.mlp.e_score_correction_bias" for j in range(n)]
        try:
            load_named_tensors(self, stream(), buffers=buffers)
        except ModelLoadError as e:
            raise ModelLoadError(f"MTP layers {first}..{first + n - 1} of {path or 'the checkpoint'}: {e}") from e


def mtp_checkpoint_tensors(draft: MTPDraft) -> dict[str, torch.Tensor]:
    """The draft's weights under their published names (model.layers.{L+j}.*, DeepSeek's layout), rope rows back
    in the checkpoint's order: what `load_weights` reads."""
    cfg, first = draft.config, draft.first_index
    out = {}
    for name, tensor in export_named_tensors(draft).items():
        if name == "embed_tokens.weight":
            for j in range(draft.num_layers):
                out[f"model.layers.{first + j}.embed_tokens.weight"] = tensor
            continue
        j, _, rest = name.removeprefix("layers.").partition(".")
        rest = rest.removeprefix("decoder.")
        out[f"model.layers.{first + int(j)}.{rest}"] = rope_rows_to_rotate_half(rest, tensor, cfg, inverse=True)
    for j, layer in enumerate(draft.layers):
        bias = getattr(layer.decoder.mlp, "e_score_correction_bias", None)
        if bias is not None:
            out[f"model.layers.{first + j}.mlp.gate.e_score_correction_bias"] = bias.detach()
    return out


def mtp_layout(path, target: ModelConfig) -> tuple[ModelConfig, int, int]:
    """(layer config, number of MTP layers, checkpoint index of the first) of the MTP checkpoint at `path`:
    the target's own directory, or a directory `spruce train-draft --draft-arch mtp` wrote for it."""
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    n = cfg.num_nextn_predict_layers
    if n < 1:
        raise ConfigError(f"speculative_algorithm='NEXTN' needs MTP layers, but {path / 'config.json'} has "
                          f"num_nextn_predict_layers={n}: use a checkpoint that has them, or train one with "
                          f"`spruce train-draft --draft-arch mtp`")
    if (cfg.hidden_size, cfg.vocab_size) != (target.hidden_size, target.vocab_size):
        raise ConfigError(f"MTP checkpoint {path} has hidden/vocab {cfg.hidden_size}/{cfg.vocab_size}; the target "
                          f"has {target.hidden_size}/{target.vocab_size}")
    return cfg, n, cfg.num_layers
