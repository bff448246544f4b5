"""EAGLE and EAGLE-3 draft heads, in the checkpoint layouts SGLang and vLLM publish.

EAGLE-3 (LlamaForCausalLMEagle3): one `midlayer` whose q/k/v read [input_layernorm(embeds),
hidden_norm(feature)] (2*H wide), `fc` (3*H_target -> H) applied to the target's three aux hidden states,
`norm` + `lm_head` over a draft vocabulary, `d2t` (target id = draft id + d2t[draft id]), optional `t2d`
and `embed_tokens` (else the target's). Its pre-norm output is the next step's feature.
EAGLE (LlamaForCausalLMEagle): `fc` (2*H -> H) over [embeds, feature], decoder `layers.*` whose first has no
input norm, optional `lm_head` (else the target's), no final norm; its feature is the target's final hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from spruce.errors import ConfigError, ModelLoadError
from spruce.models.hf_config import ModelConfig, read_json, rope_settings
from spruce.models.layers import Attention, GatedMLP, RMSNorm
from spruce.models.llama import DecoderLayer
from spruce.models.rope import Rotary
from spruce.models.weights import load_named_tensors

EAGLE3_ARCH = "LlamaForCausalLMEagle3"
EAGLE_ARCH = "LlamaForCausalLMEagle"


@dataclass(frozen=True)
class DraftConfig:
    eagle3: bool
    layer: ModelConfig  # the draft's own decoder shape (vocab = the target's)
    draft_vocab_size: int
    target_hidden_size: int
    target_aux_layers: tuple[int, ...]  # INPUT indices of target layers whose residual stream EAGLE-3 reads
    fc_bias: bool

    @property
    def shares_lm_head(self) -> bool:
        return not self.eagle3

    @staticmethod
    def from_dir(path, target: ModelConfig) -> "DraftConfig":
        path = Path(path)
        if not path.is_dir():
            raise ModelLoadError(f"draft model directory not found: {path}")
        cfg = read_json(path / "config.json", "draft config")
        archs = cfg.get("architectures") or []
        if EAGLE3_ARCH in archs:
            eagle3 = True
        elif EAGLE_ARCH in archs:
            eagle3 = False
        else:
            raise ModelLoadError(f"draft architecture {archs!r} in {path} is not supported; expected "
                                 f"{EAGLE3_ARCH} (EAGLE-3) or {EAGLE_ARCH} (EAGLE)")
        try:
            h, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            theta, scaling = rope_settings(cfg)
            layer = ModelConfig(
                architecture=archs[0], vocab_size=int(cfg.get("vocab_size", target.vocab_size)), hidden_size=h,
                intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg.get("num_hidden_layers", 1)),
                num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or h // heads), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta, rope_scaling=scaling,
                max_position_embeddings=max(int(cfg.get("max_position_embeddings", 0)),
                                            target.max_position_embeddings),
                tie_word_embeddings=False, attention_bias=False, o_proj_bias=False, qk_norm=False,
                bos_token_id=None, eos_token_ids=(),
            )
            draft_vocab = int(cfg.get("draft_vocab_size") or layer.vocab_size)
            target_hidden = int(cfg.get("target_hidden_size") or target.hidden_size)
        except KeyError as e:
            raise ModelLoadError(f"{path / 'config.json'} lacks required field {e.args[0]!r}") from e
        if layer.vocab_size != target.vocab_size:
            raise ConfigError(f"draft vocab_size {layer.vocab_size} != target vocab_size {target.vocab_size}")
        if target_hidden != target.hidden_size:
            raise ConfigError(f"draft expects target hidden size {target_hidden}, the target has {target.hidden_size}")
        if not eagle3 and h != target.hidden_size:
            raise ConfigError(f"EAGLE draft hidden size {h} must equal the target's {target.hidden_size}")
        if draft_vocab > target.vocab_size:
            raise ConfigError(f"draft_vocab_size {draft_vocab} > target vocab_size {target.vocab_size}")
        return DraftConfig(eagle3=eagle3, layer=layer, draft_vocab_size=draft_vocab, target_hidden_size=target_hidden,
                           target_aux_layers=_aux_layers(cfg, target) if eagle3 else (),
                           fc_bias=bool(cfg.get("bias", False)) and not eagle3)


def _aux_layers(cfg: dict, target: ModelConfig) -> tuple[int, ...]:
    """SGLang's rule: configured ids name layer OUTPUTS (= input of id + 1); default inputs [2, L//2, L-3]."""
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = ids if ids is not None else cfg.get("eagle_aux_hidden_state_layer_ids")
    n = target.num_layers
    layers = tuple(i + 1 for i in ids) if ids is not None else (2, n // 2, n - 3)
    bad = [i for i in layers if not 0 <= i <= n]
    if bad or len(layers) != 3:
        raise ConfigError(f"EAGLE-3 aux hidden-state layers {layers} do not fit a {n}-layer target (need 3 in [0, {n}])")
    return layers


class Eagle3MidLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary, backend):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(2 * h, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rotary, backend, 0,
                                   eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = GatedMLP(h, cfg.intermediate_size)

    def forward(self, embeds, feature, batch, kv, page_table):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(feature)], dim=-1)  # [T, 2H]
        h = feature + self.self_attn(x, batch, kv, page_table)
        return h + self.mlp(self.post_attention_layernorm(h))


class EagleDraft(nn.Module):
    """forward(input_ids [T], features [T, F], batch, kv, page_table) -> hidden [T, H] (next feature)."""

    def __init__(self, cfg: DraftConfig, backend):
        super().__init__()
        lc = cfg.layer
        self.config = cfg
        self.hidden_size, self.num_layers = lc.hidden_size, lc.num_layers
        self.num_kv_heads, self.head_dim = lc.num_kv_heads, lc.head_dim
        self.draft_vocab_size = cfg.draft_vocab_size
        self.rotary = Rotary(lc.head_dim, lc.max_position_embeddings, lc.rope_theta, lc.rope_scaling)
        self.embed_tokens = nn.Embedding(lc.vocab_size, lc.hidden_size)
        if cfg.eagle3:
            self.num_layers = 1
            self.fc = nn.Linear(3 * cfg.target_hidden_size, lc.hidden_size, bias=False)
            self.midlayer = Eagle3MidLayer(lc, self.rotary, backend)
            self.norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
            self.lm_head = nn.Linear(lc.hidden_size, cfg.draft_vocab_size, bias=False)
        else:
            self.fc = nn.Linear(2 * lc.hidden_size, lc.hidden_size, bias=cfg.fc_bias)
            self.layers = nn.ModuleList(DecoderLayer(lc, self.rotary, backend, i) for i in range(lc.num_layers))
            self.layers[0].input_layernorm = nn.Identity()
            self.lm_head = nn.Linear(lc.hidden_size, lc.vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self._shared: dict[str, torch.Tensor] = {}

    @property
    def feature_width(self) -> int:
        """Width of the target features the first draft step reads."""
        return 3 * self.config.target_hidden_size if self.config.eagle3 else self.hidden_size

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        w = self._shared["embed"] if "embed" in self._shared else self.embed_tokens.weight
        return nn.functional.embedding(ids, w)

    def forward(self, input_ids, features, batch, kv, page_table) -> torch.Tensor:
        embeds = self.embed(input_ids)  # [T, H]
        features = features.to(embeds.dtype)
        if self.config.eagle3:
            h = features if features.shape[-1] == self.hidden_size else self.fc(features)
            return self.midlayer(embeds, h, batch, kv, page_table)
        h = self.fc(torch.cat([embeds, features], dim=-1))
        for layer in self.layers:
            h = layer(h, batch, kv, page_table)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, H] -> [n, draft vocab] float32."""
        if self.config.eagle3:
            return self.lm_head(self.norm(hidden)).float()
        w = self._shared["lm_head"] if "lm_head" in self._shared else self.lm_head.weight
        return nn.functional.linear(hidden, w).float()

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.d2t[ids]

    def share_from_target(self, target, embeddings: bool, lm_head: bool) -> None:
        """Use the target's embedding (and, for EAGLE, its lm_head) instead of this module's own."""
        if embeddings:
            self._shared["embed"] = target.embed_tokens.weight
            self.embed_tokens = None
        if lm_head:
            self._shared["lm_head"] = target.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
            self.lm_head = None

    def load_weights(self, tensors) -> set[str]:
        """Load checkpoint tensors; returns the names present. Checks d2t stays inside the target vocab."""

        def rename(name: str) -> str | None:
            name = name.removeprefix("model.")
            if name == "t2d" or name.endswith("rotary_emb.inv_freq"):
                return None
            return name

        optional = ["embed_tokens.weight"] + ([] if self.config.eagle3 else ["lm_head.weight"])
        present = load_named_tensors(self, tensors, rename, optional=optional, buffers=["d2t"])
        if self.config.eagle3:
            if "d2t" not in present and self.draft_vocab_size != self.config.layer.vocab_size:
                raise ModelLoadError("EAGLE-3 draft with a reduced vocabulary lacks its d2t tensor")
            top = int((torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t).max())
            if top >= self.config.layer.vocab_size or int((torch.arange(len(self.d2t), device=self.d2t.device)
                                                           + self.d2t).min()) < 0:
                raise ConfigError(f"draft d2t maps to target id {top}, outside the target vocab "
                                  f"{self.config.layer.vocab_size}")
        return present
