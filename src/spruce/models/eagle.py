"""EAGLE and EAGLE-3 draft heads, in the checkpoint layouts SGLang and vLLM load.

EAGLE-3 (LlamaForCausalLMEagle3): a `midlayer` (also accepted as `layers.0`) whose q/k/v read
[input_layernorm(embeds), hidden_norm(feature)] (2*H wide), residual = feature; with num_hidden_layers = n > 1,
n - 1 `additional_layers.{k}` (also accepted as `layers.{k+1}`) after it, as SGLang's llama_eagle3.py runs them:
plain decoder layers over H whose input norm is named `hidden_norm` and which read only the previous layer's MLP
output (its residual is dropped: residual = input; x = attn(hidden_norm(input)); x, residual =
post_attention_layernorm.add(x, residual); x = mlp(x)). Every layer caches in its own layer (0..n-1) of the
draft's pool, and every draft step runs them all. `fc` (n_aux*H_target -> H) projects the target's aux hidden
states; `norm` + `lm_head` over a draft vocabulary; `d2t` (target id = draft id + d2t[draft id]); optional `t2d`
(ignored) and `embed_tokens` (else the target's). The last layer's pre-norm output (mlp output + residual) is the
next step's feature.
EAGLE (LlamaForCausalLMEagle): `fc` (2*H -> H) over [embeds, feature], decoder `layers.*` whose first has no
input norm, optional `lm_head` (else the target's), no final norm; its first feature is the target's final
(normed) hidden, later ones its own output.

Published variants of EAGLE-3 heads:
- `norm_before_residual` (vLLM's llama_eagle3.py): the midlayer's residual is hidden_norm(feature), not the
  feature itself.
- Multi-layer heads run one of two ways, chosen by the config key `eagle3_layer_style`:
  "sglang" (above) or "vllm": the later layers are plain pre-norm decoder layers over H named `layers.{k}` with
  an `input_layernorm`, and the residual stream runs through them all (residual += previous mlp output; x =
  attn(input_layernorm(residual)); ...). Without the key: speculators-format heads run vLLM's way, heads naming
  `additional_layers.*` SGLang's way, `layers.{k}` heads by which input norm their later layers carry (both or
  neither: refused as ambiguous).
- `norm_before_fc` (gpt-oss heads; NVIDIA's say it in `eagle_config`): an RMSNorm `input_norm` over the
  concatenated target features before fc; `fc_norm`: one RMSNorm `fc_norm.{i}` over each target feature.
- Speculators format (`speculators_model_type` "eagle3", `transformer_layer_config`, `speculators_config`), read as
  vLLM converts it: the draft's shape is `transformer_layer_config`; `draft_vocab_size`, `target_hidden_size`,
  `norm_before_residual` (default True) and `eagle_aux_hidden_state_layer_ids` are top-level. vLLM's aux ids name
  target layer INPUTS (id j = the input of layer j), SGLang's name outputs (the input of id + 1).

Heads published for MoE targets are LlamaForCausalLMEagle3 heads (a dense midlayer) whose config may carry the
target's model_type; SGLang and vLLM read a draft config through transformers' AutoConfig, so keys it leaves out
take that model type's defaults (`MODEL_TYPE_DEFAULTS`: gpt-oss heads rotate with YaRN at theta 150000 unless
they say otherwise). Heads saved from a Llama 4 text config carry both `intermediate_size` (the target's expert
width) and `intermediate_size_mlp` (its dense width): the MLP is as wide as the checkpoint's, without weights
to tell `intermediate_size_mlp` for model_type 'llama4_text' (TensorRT-LLM's rule), else refused as ambiguous.
A head's own hidden size may differ from the target's (`target_hidden_size`: fc reads the target's width; such a
head brings its own embedding), and its vocabulary may be a subset (`draft_vocab_size`, `d2t`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from spruce.errors import ConfigError, ModelLoadError
from spruce.models.checkpoint_files import checkpoint_names
from spruce.models.hf_config import ModelConfig, decoder_shape, read_json
from spruce.models.layers import Attention, GatedMLP, RMSNorm
from spruce.models.llama import DecoderLayer
from spruce.models.rope import Rotary
from spruce.models.weights import load_named_tensors

EAGLE3_ARCH = "LlamaForCausalLMEagle3"
EAGLE_ARCH = "LlamaForCausalLMEagle"
_UNSUPPORTED_EAGLE3_FLAGS = ("use_aux_norm", "norm_output")
# optional norms of the target features before fc (vLLM's llama_eagle3.py): `input_norm` [A * Ht] over their
# concatenation (norm_before_fc: gpt-oss heads), or `fc_norm.{i}` [Ht] over each aux state (fc_norm)
FC_NORM_FLAGS = ("norm_before_fc", "fc_norm")
LAYER_STYLE_KEY = "eagle3_layer_style"
LAYER_STYLES = ("sglang", "vllm")
SPECULATORS_TYPES = ("eagle3",)
# transformers' defaults for keys a head's config leaves out, by its model_type (SGLang and vLLM read draft configs
# through AutoConfig): GptOssConfig's rope, Llama4TextConfig's theta
MODEL_TYPE_DEFAULTS = {
    "gpt_oss": {"rope_theta": 150000.0,
                "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 4096}},
    "llama4_text": {"rope_theta": 500000.0},
}


@dataclass(frozen=True)
class DraftConfig:
    """A draft head's shape, checked against its target."""

    eagle3: bool
    layer: ModelConfig  # the draft's own decoder shape (vocab_size = the target's)
    draft_vocab_size: int
    target_hidden_size: int
    target_aux_layers: tuple[int, ...]  # EAGLE-3: INPUT indices of the target layers whose residual stream it reads
    fc_bias: bool | None  # config `bias`; None: not said, load fc.bias if the checkpoint has one
    tie_word_embeddings: bool  # EAGLE-3: lm_head is the (own or shared) embedding
    norm_before_residual: bool = False  # EAGLE-3: the midlayer's residual is hidden_norm(feature)
    layer_style: str = "sglang"  # EAGLE-3 layers after the midlayer: "sglang" or "vllm" (see the module doc)
    norm_before_fc: bool = False  # EAGLE-3: RMSNorm `input_norm` over the concatenated target features
    fc_norm: bool = False  # EAGLE-3: RMSNorm `fc_norm.{i}` over each target feature

    @property
    def fc_in_features(self) -> int:
        if self.eagle3:
            return len(self.target_aux_layers) * self.target_hidden_size
        return 2 * self.layer.hidden_size

    @staticmethod
    def from_dir(path, target: ModelConfig) -> "DraftConfig":
        """Read `path/config.json`; ModelLoadError for an unusable file, ConfigError for a draft/target mismatch."""
        path = Path(path)
        if not path.is_dir():
            raise ModelLoadError(f"draft model directory not found: {path}")
        file = path / "config.json"
        cfg = read_json(file, "draft config")
        speculators = "speculators_model_type" in cfg
        if speculators:
            cfg = speculators_to_eagle3(cfg, file)
        if "rope_parameters" not in cfg:
            cfg = {**MODEL_TYPE_DEFAULTS.get(cfg.get("model_type"), {}), **cfg}
        archs = cfg.get("architectures") or []
        if EAGLE3_ARCH in archs:
            eagle3 = True
        elif EAGLE_ARCH in archs:
            eagle3 = False
        else:
            raise ModelLoadError(f"draft architecture {archs!r} in {file} is not supported; expected "
                                 f"{EAGLE3_ARCH} (EAGLE-3) or {EAGLE_ARCH} (EAGLE)")
        flags = [k for k in _UNSUPPORTED_EAGLE3_FLAGS if cfg.get(k)]
        if flags:
            raise ModelLoadError(f"draft config {file} sets {flags}, which spruce does not support")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"hidden_act={act!r} in {file} is not supported (only 'silu')")
        try:
            layer = ModelConfig(
                architecture=archs[0], vocab_size=int(cfg.get("vocab_size", target.vocab_size)),
                num_layers=int(cfg.get("num_hidden_layers", 1)),
                **decoder_shape({**cfg, "intermediate_size": _mlp_width(cfg, file)}),
                # drafts run at the target's positions, whatever their own config says
                max_position_embeddings=max(int(cfg.get("max_position_embeddings", 0)),
                                            target.max_position_embeddings),
                tie_word_embeddings=False, attention_bias=False, o_proj_bias=False, qk_norm=False,
                bos_token_id=None, eos_token_ids=(),
            )
            draft_vocab = int(cfg.get("draft_vocab_size") or layer.vocab_size)
            target_hidden = int(cfg.get("target_hidden_size") or target.hidden_size)
        except KeyError as e:
            raise ModelLoadError(f"{file} lacks required field {e.args[0]!r}") from e
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"{file} has a malformed field: {e}") from e
        if layer.vocab_size != target.vocab_size:
            raise ConfigError(f"draft vocab_size {layer.vocab_size} != target vocab_size {target.vocab_size}")
        if target_hidden != target.hidden_size:
            raise ConfigError(f"draft expects target hidden size {target_hidden}, the target has {target.hidden_size}")
        if not eagle3 and layer.hidden_size != target.hidden_size:
            raise ConfigError(f"EAGLE draft hidden size {layer.hidden_size} must equal the target's hidden size {target.hidden_size} "
                              f"(its fc is [H, 2H] over [embeds, target hidden])")
        if not 1 <= draft_vocab <= target.vocab_size:
            raise ConfigError(f"draft_vocab_size {draft_vocab} must be in [1, target vocab_size {target.vocab_size}]")
        if layer.num_layers < 1:
            raise ModelLoadError(f"draft {file} has num_hidden_layers={layer.num_layers}; it needs at least 1")
        tie = bool(cfg.get("tie_word_embeddings", False)) and eagle3
        if tie and draft_vocab != layer.vocab_size:
            raise ConfigError(f"EAGLE-3 draft ties lm_head to embeddings but draft_vocab_size {draft_vocab} != "
                              f"vocab_size {layer.vocab_size}")
        bias = cfg.get("bias")
        if not eagle3:
            return DraftConfig(eagle3=False, layer=layer, draft_vocab_size=draft_vocab,
                               target_hidden_size=target_hidden, target_aux_layers=(),
                               fc_bias=None if bias is None else bool(bias), tie_word_embeddings=False)
        before_fc, fc_norm = (_fc_norm_flag(cfg, key) for key in FC_NORM_FLAGS)
        if before_fc and fc_norm:
            raise ModelLoadError(f"draft config {file} sets both norm_before_fc and fc_norm; a head has one or "
                                 f"the other")
        return DraftConfig(eagle3=True, layer=layer, draft_vocab_size=draft_vocab, target_hidden_size=target_hidden,
                           target_aux_layers=_aux_layers(cfg, target, ids_name_inputs=speculators),
                           fc_bias=None if bias is None else bool(bias), tie_word_embeddings=tie,
                           norm_before_residual=bool(cfg.get("norm_before_residual", False)),
                           layer_style=_layer_style(cfg, file, layer.num_layers, speculators),
                           norm_before_fc=before_fc, fc_norm=fc_norm)


def speculators_to_eagle3(cfg: dict, file: Path) -> dict:
    """A speculators-format config as the flat LlamaForCausalLMEagle3 config vLLM converts it to: the
    `transformer_layer_config` with the EAGLE-3 fields of the top level laid over it. Multi-layer heads run
    vLLM's way unless the config names `eagle3_layer_style`; the aux ids keep vLLM's meaning (layer inputs)."""
    kind = cfg.get("speculators_model_type")
    if kind not in SPECULATORS_TYPES:
        raise ModelLoadError(f"speculators_model_type={kind!r} in {file} is not supported; expected one of "
                             f"{list(SPECULATORS_TYPES)}")
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ModelLoadError(f"speculators config {file} needs a transformer_layer_config object, got "
                             f"{type(layer).__name__}")
    out = dict(layer)
    out["architectures"] = [EAGLE3_ARCH]
    out["draft_vocab_size"] = cfg.get("draft_vocab_size")
    if cfg.get("target_hidden_size") is not None:
        out["target_hidden_size"] = cfg["target_hidden_size"]
    out["norm_before_residual"] = cfg.get("norm_before_residual", True)  # vLLM's default for this format
    out["eagle3_layer_style"] = cfg.get(LAYER_STYLE_KEY, "vllm")
    out["eagle_config"] = {}  # only the top-level ids count here
    out["eagle_aux_hidden_state_layer_ids"] = cfg.get("eagle_aux_hidden_state_layer_ids") or None
    for flag in (*_UNSUPPORTED_EAGLE3_FLAGS, *FC_NORM_FLAGS):
        if flag in cfg:
            out[flag] = cfg[flag]
    return out


def _fc_norm_flag(cfg: dict, key: str) -> bool:
    """A target-feature norm flag, at the config's top level or (NVIDIA's heads) in its eagle_config."""
    return bool(cfg.get(key) or (cfg.get("eagle_config") or {}).get(key))


def _mlp_width(cfg: dict, file: Path) -> int:
    """The head's MLP intermediate width: `intermediate_size`, unless the config also names a different
    `intermediate_size_mlp` (a head saved from a Llama 4 text config): then the width of the checkpoint's MLP
    (its first gate_proj's rows), or without weights `intermediate_size_mlp` for model_type 'llama4_text'.
    ModelLoadError naming both keys when neither tells."""
    inter = int(cfg["intermediate_size"])
    dense = cfg.get("intermediate_size_mlp")
    if dense is None or int(dense) == inter:
        return inter
    dense = int(dense)
    rows = _checkpoint_mlp_rows(file.parent)
    if rows in (inter, dense):
        return rows
    if rows is None and cfg.get("model_type") == "llama4_text":
        return dense
    found = "no MLP weights" if rows is None else f"MLP weights {rows} wide"
    raise ModelLoadError(f"draft config {file} gives intermediate_size={inter} and intermediate_size_mlp={dense} "
                         f"and its checkpoint has {found}: ambiguous. Keep the key its MLP uses (or set model_type "
                         f"'llama4_text' for intermediate_size_mlp)")


_MLP_GATE = re.compile(r"(?:model\.)?(?:midlayer|layers\.0)\.mlp\.gate_proj\.weight")


def _checkpoint_mlp_rows(path: Path) -> int | None:
    """Rows of the first layer's mlp.gate_proj weight in the checkpoint in `path` (headers only); None when it
    has no weight files or no such tensor."""
    from safetensors import SafetensorError, safe_open

    from spruce.models.checkpoint_files import safetensors_files

    try:
        files = safetensors_files(path)
    except ModelLoadError:
        return None
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if _MLP_GATE.fullmatch(name):
                        return int(f.get_slice(name).get_shape()[0])
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ModelLoadError(f"cannot read safetensors file {file}: {e}") from e
    return None


_LATER_LAYER_NORM = re.compile(r"(?:model\.)?layers\.([1-9]\d*)\.(hidden_norm|input_layernorm)\.weight")


def _layer_style(cfg: dict, file: Path, num_layers: int, speculators: bool) -> str:
    """How an EAGLE-3 head's layers after the midlayer run: the config key, else what the format or the
    checkpoint's tensor names leave no doubt about; ModelLoadError when they do."""
    style = cfg.get(LAYER_STYLE_KEY)
    if style is not None:
        if style not in LAYER_STYLES:
            raise ModelLoadError(f"{LAYER_STYLE_KEY}={style!r} in {file} is not supported; expected one of "
                                 f"{list(LAYER_STYLES)}")
        return style
    if num_layers == 1:
        return "sglang"  # one layer: both ways are the same forward
    names = _checkpoint_names(file.parent)
    if any(n.removeprefix("model.").startswith("additional_layers.") for n in names):
        return "sglang"  # only SGLang names its later layers so
    norms = {m.group(2) for m in map(_LATER_LAYER_NORM.fullmatch, names) if m}
    if norms == {"hidden_norm"}:
        return "sglang"
    if norms == {"input_layernorm"}:
        return "vllm"
    found = sorted(norms) or "no later-layer norm tensors"
    raise ModelLoadError(f"EAGLE-3 head {file} has {num_layers} layers and its later layers are ambiguous "
                         f"({found}): SGLang runs them on `hidden_norm` with the residual dropped, vLLM on "
                         f"`input_layernorm` with the residual carried; set {LAYER_STYLE_KEY} to 'sglang' or "
                         f"'vllm' in its config.json")


def _checkpoint_names(path: Path) -> set[str]:
    """Tensor names of the checkpoint in `path` (headers only); empty when it has no weight files."""
    try:
        return checkpoint_names(path)
    except ModelLoadError:
        return set()


def _aux_layers(cfg: dict, target: ModelConfig, ids_name_inputs: bool = False) -> tuple[int, ...]:
    """SGLang's rule (set_eagle3_layers_to_capture): configured ids name layer OUTPUTS, i.e. the input of
    layer id + 1; without ids, the inputs of layers [2, L//2, L-3]. ids_name_inputs (vLLM's rule, kept for
    speculators-format heads): id j is the input of layer j, so each is in [0, L-1]."""
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = ids if ids is not None else cfg.get("eagle_aux_hidden_state_layer_ids")
    n = target.num_layers
    shift, top = (0, n - 1) if ids_name_inputs else (1, n)
    layers = tuple(int(i) + shift for i in ids) if ids is not None else (2, n // 2, n - 3)
    if not layers or any(not 0 <= i <= top for i in layers):
        raise ConfigError(f"EAGLE-3 aux hidden-state layers (inputs) {layers} do not fit a {n}-layer target "
                          f"(need at least one, each in [0, {top}]; configured ids {ids})")
    return layers


class Eagle3MidLayer(nn.Module):
    """The EAGLE-3 head's first decoder layer: attention over [norm(embeds), norm(feature)], residual = feature."""

    def __init__(self, cfg: ModelConfig, rotary: Rotary, backend, norm_before_residual: bool = False):
        super().__init__()
        h = cfg.hidden_size
        self.norm_before_residual = norm_before_residual  # residual = hidden_norm(feature) (vLLM's option)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(2 * h, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rotary, backend, 0,
                                   eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = GatedMLP(h, cfg.intermediate_size)

    def forward(self, embeds, feature, batch, kv, page_table):
        """embeds [T, H], feature [T, H] -> (mlp output [T, H], residual [T, H]); their sum is the pre-norm hidden."""
        normed = self.hidden_norm(feature)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [T, 2H]
        residual = normed if self.norm_before_residual else feature
        h, residual = self.post_attention_layernorm.add_forward(self.self_attn(x, batch, kv, page_table), residual)
        return self.mlp(h), residual


class _Eagle3UpperLayer(nn.Module):
    """A pre-norm decoder layer over H after the midlayer; its input norm's checkpoint name is `INPUT_NORM`."""

    INPUT_NORM = ""

    def __init__(self, cfg: ModelConfig, rotary: Rotary, backend, layer_id: int):
        super().__init__()
        h = cfg.hidden_size
        setattr(self, self.INPUT_NORM, RMSNorm(h, cfg.rms_norm_eps))
        self.self_attn = Attention(h, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rotary, backend, layer_id,
                                   eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = GatedMLP(h, cfg.intermediate_size)


class Eagle3AdditionalLayer(_Eagle3UpperLayer):
    """An EAGLE-3 head's layer after the midlayer (SGLang's BasicDecoderLayer): a pre-norm decoder layer over H
    whose input norm is `hidden_norm`. As in SGLang it reads only the previous layer's MLP output; the previous
    residual is not added back in (heads trained for SGLang expect exactly that)."""

    INPUT_NORM = "hidden_norm"

    def forward(self, x, batch, kv, page_table):
        """x [T, H] (the previous layer's mlp output) -> (mlp output [T, H], residual [T, H])."""
        h = self.self_attn(self.hidden_norm(x), batch, kv, page_table)
        h, residual = self.post_attention_layernorm.add_forward(h, x)
        return self.mlp(h), residual


class Eagle3StreamLayer(_Eagle3UpperLayer):
    """An EAGLE-3 head's layer after the midlayer as vLLM's llama_eagle3.py runs it: a pre-norm decoder layer
    over H whose input norm is `input_layernorm`, on the residual stream the midlayer started."""

    INPUT_NORM = "input_layernorm"

    def forward(self, x, residual, batch, kv, page_table):
        """x [T, H] (the previous mlp output), residual [T, H] -> (mlp output [T, H], residual [T, H])."""
        h, residual = self.input_layernorm.add_forward(x, residual)
        h, residual = self.post_attention_layernorm.add_forward(self.self_attn(h, batch, kv, page_table), residual)
        return self.mlp(h), residual


_NEW_EAGLE3_LAYER = re.compile(r"layers\.(\d+)\.(.*)")


def _eagle3_name(name: str) -> str:
    """The newer naming (`layers.0.*` = midlayer, `layers.{i}.*` = additional layer i-1) as SGLang's names."""
    m = _NEW_EAGLE3_LAYER.fullmatch(name)
    if m is None:
        return name
    i = int(m.group(1))
    return f"midlayer.{m.group(2)}" if i == 0 else f"additional_layers.{i - 1}.{m.group(2)}"


class EagleDraft(nn.Module):
    """An EAGLE or EAGLE-3 head. forward(input_ids [T], features [T, F], batch, kv, page_table) -> hidden [T, H].

    `own_embed` / `own_lm_head`: whether the checkpoint brings them; if not, `use_target_weights` shares the
    target's (nothing is allocated for them here)."""

    def __init__(self, cfg: DraftConfig, backend, own_embed: bool = True, own_lm_head: bool = True):
        super().__init__()
        lc = cfg.layer
        self.config = cfg
        self.hidden_size, self.num_kv_heads, self.head_dim = lc.hidden_size, lc.num_kv_heads, lc.head_dim
        self.num_layers = lc.num_layers  # attention layers, each caching in its own layer of the draft's pool
        self.draft_vocab_size = cfg.draft_vocab_size
        self.rotary = Rotary(lc.head_dim, lc.max_position_embeddings, lc.rope_theta, lc.rope_scaling)
        self.embed_tokens = nn.Embedding(lc.vocab_size, lc.hidden_size) if own_embed else None
        self.fc = nn.Linear(cfg.fc_in_features, lc.hidden_size, bias=cfg.fc_bias is not False)
        if self.fc.bias is not None:
            nn.init.zeros_(self.fc.bias)  # stays zero when the checkpoint has no fc.bias (and none was promised)
        self.input_norm = RMSNorm(cfg.fc_in_features, lc.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc_norm = (nn.ModuleList(RMSNorm(cfg.target_hidden_size, lc.rms_norm_eps)
                                      for _ in cfg.target_aux_layers) if cfg.fc_norm else None)
        if cfg.eagle3:
            self.midlayer = Eagle3MidLayer(lc, self.rotary, backend, cfg.norm_before_residual)
            later = Eagle3StreamLayer if cfg.layer_style == "vllm" else Eagle3AdditionalLayer
            self.additional_layers = nn.ModuleList(later(lc, self.rotary, backend, i)
                                                   for i in range(1, lc.num_layers))
            self.norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
        else:
            self.layers = nn.ModuleList(DecoderLayer(lc, self.rotary, backend, i) for i in range(lc.num_layers))
            self.layers[0].input_layernorm = nn.Identity()
        has_head = own_lm_head and not cfg.tie_word_embeddings
        self.lm_head = nn.Linear(lc.hidden_size, cfg.draft_vocab_size, bias=False) if has_head else None
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))  # [draft vocab]
        self._shared: dict[str, torch.Tensor] = {}  # "embed" / "lm_head" -> the target's weight

    @property
    def feature_width_first_step(self) -> int:
        """Width F of the target features the first draft step reads (later steps read the draft's own H)."""
        return self.config.fc_in_features if self.config.eagle3 else self.hidden_size

    feature_width = feature_width_first_step

    @property
    def attention_config(self) -> ModelConfig:
        """The draft layers' attention shape (what its KV pool is made for)."""
        return self.config.layer

    def step_layer(self, step: int) -> int:
        """Every draft step runs the whole head (its layers are stacked, not per step)."""
        return 0

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [n] -> [n, H] with the draft's own embedding, else the target's (its vocab-parallel module when
        the target is tensor-parallel)."""
        if self.embed_tokens is not None:
            return self.embed_tokens(ids)
        shared = self._shared["embed"]
        return shared(ids) if isinstance(shared, nn.Module) else nn.functional.embedding(ids, shared)

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, batch, kv, page_table,
                layer: int | None = None) -> torch.Tensor:
        """Draft hidden [T, H] (pre-norm: the next step's feature) for tokens paired with features [T, F].

        F is feature_width_first_step (target features) or H (the draft's own previous hidden). `layer` is the
        step's layer for per-step drafts (MTP); an EAGLE head runs all its layers whatever it says."""
        embeds = self.embed(input_ids)  # [T, H]
        features = features.to(embeds.dtype)
        if self.config.eagle3:
            width = features.shape[-1]
            if width == self.hidden_size:
                h = features  # the draft's own previous hidden
            elif width == self.fc.in_features:
                h = self.fc(self.normed_features(features))  # [T, H]
            else:
                raise ConfigError(f"EAGLE-3 draft features have width {width}; expected {self.fc.in_features} "
                                  f"(target aux states) or {self.hidden_size} (draft hidden)")
            h, residual = self.midlayer(embeds, h, batch, kv, page_table)
            stream = self.config.layer_style == "vllm"
            for block in self.additional_layers:  # SGLang: each reads only the previous mlp output
                h, residual = block(h, residual, batch, kv, page_table) if stream else block(h, batch, kv, page_table)
            return h + residual
        h, residual = self.fc(torch.cat([embeds, features], dim=-1)), None  # [T, H]
        for layer in self.layers:  # layer 0 has no input norm: it reads fc's output as is
            h, residual = layer.forward_residual(h, residual, batch, kv, page_table)
        return h + residual

    def normed_features(self, features: torch.Tensor) -> torch.Tensor:
        """Target aux features [T, A * Ht] as fc reads them: each aux state normed (fc_norm), or their
        concatenation (norm_before_fc), or as they are."""
        if self.fc_norm is not None:
            parts = features.split(self.config.target_hidden_size, dim=-1)  # A x [T, Ht]
            return torch.cat([norm(part) for norm, part in zip(self.fc_norm, parts)], dim=-1)
        return features if self.input_norm is None else self.input_norm(features)

    def compute_logits(self, hidden: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """hidden [n, H] -> [n, draft vocab] float32 (EAGLE-3 applies its final norm first)."""
        if self.config.eagle3:
            hidden = self.norm(hidden)
        if self.lm_head is not None:
            w = self.lm_head.weight
        elif self.config.tie_word_embeddings:
            w = self._shared["embed"] if self.embed_tokens is None else self.embed_tokens.weight
        else:
            w = self._shared["lm_head"]
        if isinstance(w, nn.Module):  # a tensor-parallel target's vocab-parallel embedding (tied), or the target
            return w.logits(hidden) if hasattr(w, "logits") else w.compute_logits(hidden)
        return nn.functional.linear(hidden, w).float()

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft token ids -> target token ids (identity for EAGLE and full-vocabulary EAGLE-3)."""
        return ids + self.d2t[ids]

    def use_target_weights(self, target) -> None:
        """Share the target's embedding / lm_head for those this checkpoint does not bring. A tensor-parallel
        target holds only its rank's vocabulary rows: the draft (replicated on every rank) then calls the
        target's vocab-parallel embedding and logits, which gather the whole."""
        tc = target.config
        sharded = getattr(target, "tp", None) is not None
        if self.embed_tokens is None:
            if self.hidden_size != tc.hidden_size:
                raise ConfigError(f"draft has no embed_tokens and its hidden size {self.hidden_size} differs from "
                                  f"the target's {tc.hidden_size}, so the target's embedding cannot be shared")
            self._shared["embed"] = target.embed_tokens if sharded else target.embed_tokens.weight
        if self.lm_head is None and not self.config.tie_word_embeddings:
            if self.hidden_size != tc.hidden_size or self.draft_vocab_size != tc.vocab_size:
                raise ConfigError(f"draft has no lm_head and cannot share the target's: draft hidden "
                                  f"{self.hidden_size} / vocab {self.draft_vocab_size} vs target {tc.hidden_size} / "
                                  f"{tc.vocab_size}")
            if sharded:
                self._shared["lm_head"] = target
            else:
                self._shared["lm_head"] = target.embed_tokens.weight if target.lm_head is None else target.lm_head.weight

    def load_weights(self, tensors) -> None:
        """Load (name, tensor) pairs in the published layouts; checks d2t against the vocabularies."""
        eagle3 = self.config.eagle3
        seen_d2t = False
        vllm_layers = eagle3 and self.config.layer_style == "vllm"

        def vllm_unused(name: str) -> bool:
            """vLLM gives every layer a hidden_norm and reads only the midlayer's."""
            return vllm_layers and name.startswith("additional_layers.") and ".hidden_norm." in name

        def stream():
            nonlocal seen_d2t
            for raw, tensor in tensors:
                name = raw.removeprefix("model.")
                if eagle3:
                    name = _eagle3_name(name)
                if name == "d2t":
                    self._set_d2t(tensor)
                    seen_d2t = True
                elif vllm_unused(name):
                    continue
                elif name != "t2d" and not name.endswith("rotary_emb.inv_freq"):
                    yield name, tensor

        optional = [] if self.config.fc_bias else ["fc.bias"]
        load_named_tensors(self, stream(), optional=optional)
        if eagle3 and not seen_d2t and self.draft_vocab_size != self.config.layer.vocab_size:
            raise ModelLoadError(f"EAGLE-3 draft with draft_vocab_size {self.draft_vocab_size} < vocab_size "
                                 f"{self.config.layer.vocab_size} lacks its d2t tensor")

    def _set_d2t(self, d2t: torch.Tensor) -> None:
        n, vocab = self.draft_vocab_size, self.config.layer.vocab_size
        if d2t.dim() != 1 or d2t.shape[0] != n:
            raise ConfigError(f"draft d2t has shape {tuple(d2t.shape)}; expected ({n},) = draft_vocab_size")
        target_ids = torch.arange(n) + d2t.to(torch.int64).cpu()  # [draft vocab]
        lo, hi = int(target_ids.min()), int(target_ids.max())
        if lo < 0 or hi >= vocab:
            raise ConfigError(f"draft d2t maps to target ids in [{lo}, {hi}], outside the target vocab {vocab}")
        self.d2t.copy_(d2t.to(torch.int64))
