"""Model configuration read from a Hugging Face `config.json`: Llama-family (Llama, Mistral, Qwen2, Qwen3; with
routed experts Qwen2-MoE, Qwen3-MoE, Mixtral) and DeepSeek-V2/V3 (MLA attention over a latent KV cache, MoE
feed-forward).

Both rope styles are read: the older `rope_theta` + `rope_scaling` and the newer `rope_parameters`
(transformers >= 5). Rope types default, linear, llama3 and yarn are supported; anything else is refused.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from spruce.errors import ModelLoadError

# Llama-family architecture -> (qkv bias by default, per-head q/k RMSNorm)
ARCHITECTURES = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
    # with routed experts (moe_config_qwen); Qwen2-MoE reads its q/k/v bias from `qkv_bias`
    "Qwen2MoeForCausalLM": (True, False),
    "Qwen3MoeForCausalLM": (False, True),
    "MixtralForCausalLM": (False, False),
}
DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
GPT_OSS_ARCHITECTURES = ("GptOssForCausalLM",)
# the text model (Llama4TextConfig), or its language model inside the published image-text checkpoints
LLAMA4_ARCHITECTURES = ("Llama4ForCausalLM", "Llama4ForConditionalGeneration")
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
# Llama-family architectures whose sliding windows spruce runs (the context is not capped by the window)
SLIDING_ARCHITECTURES = ("MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# keys each rope type needs (llama3's original_max_position_embeddings falls back to max_position_embeddings)
_ROPE_KEYS = {"default": (), "linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
              "yarn": ()}


def read_json(path: Path, what: str) -> dict:
    """The JSON object in `path`; ModelLoadError naming the path when it is missing or not a JSON object."""
    if not path.exists():
        raise ModelLoadError(f"{what} not found: {path}")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{what} {path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{what} {path} must hold a JSON object, got {type(data).__name__}")
    return data


def decoder_shape(cfg: dict) -> dict:
    """The decoder-layer fields of a config.json, as ModelConfig keywords: sizes, heads, KV heads (default: the
    heads), head_dim (default: hidden // heads), RMSNorm eps (default 1e-6) and rope. KeyError / TypeError /
    ValueError for a missing or malformed field (the caller names its file)."""
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    theta, scaling = rope_settings(cfg)
    return dict(hidden_size=hidden, intermediate_size=int(cfg["intermediate_size"]), num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling)


def rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from either config style.

    The scaling dict (None for plain rope) always has `rope_type` and the keys that type needs."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = dict(cfg.get("rope_scaling") or {})
    rope_type = scaling.pop("type", None)  # the oldest configs say "type"
    rope_type = scaling.get("rope_type", rope_type or "default")
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(f"rope_type={rope_type!r} is not supported; expected one of {ROPE_TYPES}")
    partial = float(scaling.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ModelLoadError(f"partial_rotary_factor={partial} is not supported (only 1.0)")
    if rope_type == "default":
        return theta, None
    missing = [k for k in _ROPE_KEYS[rope_type] if k not in scaling]
    if missing:
        raise ModelLoadError(f"rope_type={rope_type!r} needs {missing} in the rope settings, got {scaling}")
    scaling["rope_type"] = rope_type
    if rope_type in ("llama3", "yarn"):
        scaling.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 2048))
    if rope_type == "yarn" and scaling.get("factor") is None:  # DeepSeek-V3 style: the ratio of the contexts
        scaling["factor"] = cfg.get("max_position_embeddings", 2048) / scaling["original_max_position_embeddings"]
    return theta, scaling


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): per token and layer the cache holds one latent of
    kv_lora_rank + qk_rope_head_dim values (the normed compressed kv, then the rotated shared rope key)."""

    q_lora_rank: int | None  # None: q_proj straight from the hidden state
    kv_lora_rank: int  # C
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # R
    v_head_dim: int
    rope_interleave: bool  # rope pairs are (x0, x1), (x2, x3), ... (DeepSeek's layout) instead of rotate-half
    softmax_scale: float  # qk_head_dim^-0.5, times YaRN's mscale_all_dim correction squared

    @property
    def latent_dim(self) -> int:
        """Values per token and layer in the latent cache: C + R (576 for DeepSeek-V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """Mixture of experts: routed experts chosen per token by a router, plus optional always-on shared experts.

    DeepSeek-V2/V3 (groups, sigmoid scoring, bias correction) and the plain softmax top-k routers of Qwen2-MoE,
    Qwen3-MoE and Mixtral (`moe_config_qwen`)."""

    num_experts: int  # E (n_routed_experts)
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # per expert (moe_intermediate_size)
    num_shared_experts: int
    scoring: str  # "softmax" (V2) or "sigmoid" (V3, with e_score_correction_bias)
    num_groups: int  # n_group (1: no group limit)
    topk_groups: int  # topk_group
    topk_method: str  # "greedy"; "group_limited_greedy" (V2: groups by their best score); "noaux_tc" (V3:
    # groups by their top-2 biased scores, always used by V3 as transformers does)
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int  # layers [0, first_k_dense_replace) use the dense MLP
    layer_freq: int  # moe_layer_freq: MoE every layer_freq-th layer past first_k_dense_replace
    # Qwen's rule instead (when set): MoE where (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers
    decoder_sparse_step: int | None = None
    mlp_only_layers: tuple[int, ...] = ()
    # shared experts' total intermediate (None: intermediate_size * num_shared_experts, DeepSeek's layout)
    shared_intermediate_size: int | None = None
    shared_expert_gate: bool = False  # Qwen2-MoE: the shared output times sigmoid(x @ shared_expert_gate.T)
    norm_single: bool = False  # norm_topk_prob also at top_k 1 (its weight becomes 1: Qwen, Mixtral)
    moe_layer_ids: tuple[int, ...] | None = None  # Llama 4: exactly these layers are MoE (config `moe_layers`)
    weight_input: bool = False  # Llama 4: the routing weight scales the expert's input, not its output (top-1)
    # gpt-oss: a router bias, softmax over the top-k logits only ("topk_softmax" scoring), biased experts whose
    # gate/up pass through the clamped SwiGLU: (min(up, L).clamp(-L) + 1) * g * sigmoid(alpha * g), g = min(gate, L)
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None  # None: silu(gate) * up
    swiglu_alpha: float = 1.702
    # the router's GEMM in float32 (DeepSeek: transformers keeps its weight in float32 and casts the input); else
    # in the model dtype, as transformers runs Qwen-MoE's, Mixtral's, gpt-oss's and Llama 4's routers
    router_float32: bool = False

    def is_moe_layer(self, i: int) -> bool:
        if self.moe_layer_ids is not None:
            return i in self.moe_layer_ids
        if self.decoder_sparse_step is not None:
            return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
        return i >= self.first_k_dense_replace and i % self.layer_freq == 0

    @property
    def shared_size(self) -> int:
        """The shared experts' total intermediate (0: none)."""
        if self.shared_intermediate_size is not None:
            return self.shared_intermediate_size
        return self.intermediate_size * self.num_shared_experts


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """DeepSeek's YaRN magnitude correction: 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _mla_config(cfg: dict, arch: str, scaling: dict | None) -> MLAConfig:
    nope, rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    scale = (nope + rope) ** -0.5
    if scaling is not None and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
    q_lora = cfg.get("q_lora_rank")
    return MLAConfig(q_lora_rank=int(q_lora) if q_lora else None, kv_lora_rank=int(cfg["kv_lora_rank"]),
                     qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=int(cfg["v_head_dim"]),
                     # V2's rope is complex multiplication over adjacent pairs; V3 says which in rope_interleave
                     rope_interleave=arch == "DeepseekV2ForCausalLM" or bool(cfg.get("rope_interleave", True)),
                     softmax_scale=scale)


_TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def moe_config_qwen(cfg: dict, arch: str, file: Path) -> MoEConfig | None:
    """Qwen2-MoE / Qwen3-MoE / Mixtral routing: softmax over the experts, greedy top-k, the chosen weights
    renormalized when norm_topk_prob (Mixtral: always). Qwen places MoE layers by decoder_sparse_step and
    mlp_only_layers (the others use the dense MLP of intermediate_size); Qwen2-MoE adds one shared expert of
    shared_expert_intermediate_size, gated by sigmoid(shared_expert_gate). None for a dense config."""
    if arch not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM"):
        return None
    mixtral = arch == "MixtralForCausalLM"
    # published Qwen configs say num_experts; transformers 5 writes num_local_experts for every one of them
    experts = int(cfg.get("num_experts") or cfg["num_local_experts"])
    top_k = int(cfg["num_experts_per_tok"])
    if experts < 1 or not 1 <= top_k <= experts:
        raise ModelLoadError(f"num_experts_per_tok={top_k} in {file} must be in [1, number of experts={experts}]")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
    step = 1 if mixtral else int(cfg.get("decoder_sparse_step") or 1)
    only = () if mixtral else tuple(int(i) for i in cfg.get("mlp_only_layers") or ())
    return MoEConfig(
        num_experts=experts, top_k=top_k,
        intermediate_size=int(cfg["intermediate_size"] if mixtral else cfg["moe_intermediate_size"]),
        num_shared_experts=1 if shared else 0, scoring="softmax", num_groups=1, topk_groups=1, topk_method="greedy",
        norm_topk_prob=mixtral or bool(cfg.get("norm_topk_prob", False)), routed_scaling_factor=1.0,
        first_k_dense_replace=0, layer_freq=1, decoder_sparse_step=step, mlp_only_layers=only,
        shared_intermediate_size=shared, shared_expert_gate=bool(shared), norm_single=True)


def _moe_config(cfg: dict, arch: str, file: Path) -> MoEConfig | None:
    experts = cfg.get("n_routed_experts")
    if not experts:
        return None
    v3 = arch == "DeepseekV3ForCausalLM"
    scoring = cfg.get("scoring_func", "sigmoid" if v3 else "softmax")
    if scoring not in ("softmax", "sigmoid"):
        raise ModelLoadError(f"scoring_func={scoring!r} in {file} is not supported; expected 'softmax' or 'sigmoid'")
    method = "noaux_tc" if v3 else cfg.get("topk_method") or "greedy"
    if method not in _TOPK_METHODS:
        raise ModelLoadError(f"topk_method={method!r} in {file} is not supported; expected one of {_TOPK_METHODS}")
    groups = int(cfg.get("n_group") or 1)
    if int(experts) % groups:
        raise ModelLoadError(f"n_routed_experts={experts} in {file} is not divisible by n_group={groups}")
    topk_groups = int(cfg.get("topk_group") or groups)
    if not 1 <= topk_groups <= groups:
        raise ModelLoadError(f"topk_group={topk_groups} in {file} must be in [1, n_group={groups}]")
    return MoEConfig(
        num_experts=int(experts), top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg["moe_intermediate_size"]), num_shared_experts=int(cfg.get("n_shared_experts") or 0),
        scoring=scoring, num_groups=groups, topk_groups=topk_groups, topk_method=method,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        first_k_dense_replace=int(cfg.get("first_k_dense_replace", 0)), layer_freq=int(cfg.get("moe_layer_freq", 1)),
        router_float32=True,
    )


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's shape and conventions, as spruce needs them (read once, frozen)."""

    architecture: str
    vocab_size: int
    hidden_size: int  # H
    intermediate_size: int  # I
    num_layers: int  # L
    num_heads: int  # Hq
    num_kv_heads: int  # Hkv
    head_dim: int  # D (config `head_dim`, else hidden_size // num_heads)
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None: plain rope; else {"rope_type": "linear"|"llama3", ...}
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v
    o_proj_bias: bool
    qk_norm: bool  # Qwen3: per-head RMSNorm on q and k before rope
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # config.json's eos merged with generation_config.json's
    mla: MLAConfig | None = None  # DeepSeek: latent attention (num_kv_heads / head_dim then describe its rope)
    moe: MoEConfig | None = None  # routed (+ shared) experts (intermediate_size is the dense layers')
    num_nextn_predict_layers: int = 0  # DeepSeek MTP layers stored after the main layers
    # gpt-oss: the layers whose layer_types entry is "sliding_attention" see the last sliding_window positions
    # only ((p - W, p] at position p); attention_sinks: a learned per-head logit in every softmax
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    attention_sinks: bool = False
    # Llama 4: "chunked_attention" layers see only their own chunk of attention_chunk_size positions
    # ([C floor(p / C), p] at position p); rope_layers[i] False: layer i has no rope (and scales its queries by
    # log1p(floor((p + 1) / floor_scale)) * attn_scale + 1 when attn_temperature = (floor_scale, attn_scale));
    # qk_l2_norm: q and k of the rope layers divided by their RMS (no weight) after rope; interleaved_rope: the
    # checkpoint rotates pairs (x0, x1), (x2, x3)... (its q/k rows are permuted to rotate-half at load)
    attention_chunk_size: int | None = None
    rope_layers: tuple[bool, ...] | None = None
    attn_temperature: tuple[float, float] | None = None
    qk_l2_norm: bool = False
    interleaved_rope: bool = False

    def layer_window(self, i: int) -> int | None:
        """Layer i's sliding window (None: full attention)."""
        if self.layer_types is None or self.layer_types[i] != "sliding_attention":
            return None
        return self.sliding_window

    def layer_chunk(self, i: int) -> int | None:
        """Layer i's attention chunk size (None: not chunked)."""
        if self.layer_types is None or self.layer_types[i] != "chunked_attention":
            return None
        return self.attention_chunk_size

    @property
    def needs_windows(self) -> bool:
        """Whether some layer has a sliding window or attention sinks (attention backends must serve them)."""
        return self.attention_sinks or any(self.layer_window(i) is not None for i in range(self.num_layers))

    @property
    def needs_chunks(self) -> bool:
        """Whether some layer has chunked attention (attention backends must serve it)."""
        return any(self.layer_chunk(i) is not None for i in range(self.num_layers))

    @staticmethod
    def from_dir(path) -> "ModelConfig":
        """Read `path/config.json` (and generation_config.json if present). ModelLoadError on anything unusable."""
        path = Path(path)
        if not path.is_dir():
            raise ModelLoadError(f"model directory not found: {path}")
        file = path / "config.json"
        cfg = read_json(file, "model config")
        archs = cfg.get("architectures") or []
        known = (*ARCHITECTURES, *DEEPSEEK_ARCHITECTURES, *GPT_OSS_ARCHITECTURES, *LLAMA4_ARCHITECTURES)
        arch = next((a for a in archs if a in known), None)
        if arch is None:
            raise ModelLoadError(f"architecture {archs!r} in {file} is not supported; supported: {sorted(known)}")
        if arch in DEEPSEEK_ARCHITECTURES:
            return _deepseek_config(cfg, arch, path, file)
        if arch in GPT_OSS_ARCHITECTURES:
            return _gpt_oss_config(cfg, arch, path, file)
        if arch in LLAMA4_ARCHITECTURES:
            if arch == "Llama4ForConditionalGeneration":  # the text side only (vision tensors are skipped)
                text = cfg.get("text_config")
                if not isinstance(text, dict):
                    raise ModelLoadError(f"{file} ({arch}) has no text_config object")
                cfg = {**{k: cfg[k] for k in ("bos_token_id", "eos_token_id") if k in cfg}, **text}
            return _llama4_config(cfg, arch, path, file)
        bias, qk_norm = ARCHITECTURES[arch]
        if cfg.get("mlp_bias"):
            raise ModelLoadError(f"mlp_bias=true in {file} is not supported")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"hidden_act={act!r} in {file} is not supported (only 'silu')")
        try:
            bias_key = "qkv_bias" if arch == "Qwen2MoeForCausalLM" else "attention_bias"
            attention_bias = bool(cfg.get(bias_key, bias))
            layers = int(cfg["num_hidden_layers"])
            window, types = _sliding_layers(cfg, arch, layers, file)
            return ModelConfig(
                architecture=arch, vocab_size=int(cfg["vocab_size"]), num_layers=layers,
                **decoder_shape(cfg), sliding_window=window, layer_types=types,
                max_position_embeddings=(int(cfg.get("max_position_embeddings", 2048)) if arch in SLIDING_ARCHITECTURES
                                         else _max_positions(cfg)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=attention_bias,
                # Llama and Qwen3 put `attention_bias` on o_proj too; Qwen2's q/k/v bias leaves o_proj bare
                o_proj_bias=arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and attention_bias,
                qk_norm=qk_norm, moe=moe_config_qwen(cfg, arch, file),
                bos_token_id=_first_int(cfg.get("bos_token_id")), eos_token_ids=_eos_ids(cfg, path),
                num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0),
            )
        except KeyError as e:
            raise ModelLoadError(f"{file} lacks required field {e.args[0]!r}") from e
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"{file} has a malformed field: {e}") from e


def _deepseek_config(cfg: dict, arch: str, path: Path, file: Path) -> ModelConfig:
    """DeepSeek-V2/V3: rope on qk_rope_head_dim (its heads share one rope key), MLA and MoE sub-configs."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"hidden_act={act!r} in {file} is not supported (only 'silu')")
    if cfg.get("attention_bias"):
        raise ModelLoadError(f"attention_bias=true in {file} is not supported for {arch}")
    try:
        theta, scaling = rope_settings({**cfg, "head_dim": cfg["qk_rope_head_dim"]})
        heads = int(cfg["num_attention_heads"])
        return ModelConfig(
            architecture=arch, vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=1, head_dim=int(cfg["qk_rope_head_dim"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=_max_positions(cfg), tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=False, o_proj_bias=False, qk_norm=False,
            bos_token_id=_first_int(cfg.get("bos_token_id")), eos_token_ids=_eos_ids(cfg, path),
            mla=_mla_config(cfg, arch, scaling), moe=_moe_config(cfg, arch, file),
            num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0),
        )
    except KeyError as e:
        raise ModelLoadError(f"{file} lacks required field {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{file} has a malformed field: {e}") from e


def _gpt_oss_config(cfg: dict, arch: str, path: Path, file: Path) -> ModelConfig:
    """gpt-oss: biased q/k/v/o, attention sinks, layer_types alternating sliding-window / full attention (the
    window does not cap the context), YaRN rope, every layer MoE with biased experts and the clamped SwiGLU."""
    quant = cfg.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if quant and method != "mxfp4":  # MXFP4 experts are dequantized at load (models/gpt_oss.py)
        raise ModelLoadError(f"{file} has quantization_config {method!r}: not supported for {arch} (only 'mxfp4', "
                             f"dequantized at load)")
    try:
        layers = int(cfg["num_hidden_layers"])
        types = tuple(cfg.get("layer_types") or ("sliding_attention" if (i + 1) % 2 else "full_attention"
                                                 for i in range(layers)))
        bad = sorted(set(types) - set(LAYER_TYPES))
        if bad or len(types) != layers:
            raise ModelLoadError(f"layer_types in {file} must list {layers} entries of {LAYER_TYPES}, "
                                 f"got {list(types)}")
        window = int(cfg.get("sliding_window") or 0)
        if "sliding_attention" in types and window < 1:
            raise ModelLoadError(f"sliding_window={cfg.get('sliding_window')!r} in {file} must be >= 1 for its "
                                 f"sliding_attention layers")
        experts, top_k = int(cfg["num_local_experts"]), int(cfg["num_experts_per_tok"])
        if not 1 <= top_k <= experts:
            raise ModelLoadError(f"num_experts_per_tok={top_k} in {file} must be in [1, number of experts={experts}]")
        moe = MoEConfig(
            num_experts=experts, top_k=top_k, intermediate_size=int(cfg["intermediate_size"]), num_shared_experts=0,
            scoring="topk_softmax", num_groups=1, topk_groups=1, topk_method="greedy", norm_topk_prob=False,
            routed_scaling_factor=1.0, first_k_dense_replace=0, layer_freq=1, router_bias=True, expert_bias=True,
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)), swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)))
        attention_bias = bool(cfg.get("attention_bias", True))
        return ModelConfig(
            architecture=arch, vocab_size=int(cfg["vocab_size"]), num_layers=layers, **decoder_shape(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), attention_bias=attention_bias,
            o_proj_bias=attention_bias, qk_norm=False, bos_token_id=_first_int(cfg.get("bos_token_id")),
            eos_token_ids=_eos_ids(cfg, path), moe=moe, sliding_window=window or None, layer_types=types,
            attention_sinks=True,
        )
    except KeyError as e:
        raise ModelLoadError(f"{file} lacks required field {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{file} has a malformed field: {e}") from e


def _llama4_config(cfg: dict, arch: str, path: Path, file: Path) -> ModelConfig:
    """Llama 4 text: rope on the layers no_rope_layers marks 1 (chunked attention there when
    attention_chunk_size is set; L2-normed q/k with use_qk_norm), no rope and full attention with temperature
    tuning on the others; MoE on `moe_layers` (top-1, sigmoid routing weight on the expert's input, plus one
    ungated shared expert of intermediate_size), dense MLPs of intermediate_size_mlp elsewhere."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"hidden_act={act!r} in {file} is not supported (only 'silu')")
    try:
        layers = int(cfg["num_hidden_layers"])
        rope = tuple(bool(x) for x in cfg.get("no_rope_layers") or (
            (i + 1) % int(cfg.get("no_rope_layer_interval", 4)) != 0 for i in range(layers)))
        chunk = int(cfg.get("attention_chunk_size") or 0) or None
        types = tuple(cfg.get("layer_types") or ("chunked_attention" if chunk and r else "full_attention"
                                                 for r in rope))
        if len(rope) != layers or len(types) != layers or set(types) - {"full_attention", "chunked_attention"}:
            raise ModelLoadError(f"no_rope_layers / layer_types in {file} must give {layers} entries "
                                 f"(layer types 'full_attention', 'chunked_attention'), got {list(rope)} / "
                                 f"{list(types)}")
        if "chunked_attention" in types and not chunk:
            raise ModelLoadError(f"attention_chunk_size={cfg.get('attention_chunk_size')!r} in {file} must be >= 1 "
                                 f"for its chunked_attention layers")
        experts, top_k = int(cfg["num_local_experts"]), int(cfg.get("num_experts_per_tok", 1))
        if top_k != 1:
            raise ModelLoadError(f"num_experts_per_tok={top_k} in {file} is not supported for {arch} (only 1: the "
                                 f"routing weight scales the expert's input)")
        step = int(cfg.get("interleave_moe_layer_step", 1))
        moe_ids = tuple(int(i) for i in (cfg["moe_layers"] if cfg.get("moe_layers") is not None
                                         else range(step - 1, layers, step)))
        inter = int(cfg["intermediate_size"])
        moe = MoEConfig(
            num_experts=experts, top_k=1, intermediate_size=inter, num_shared_experts=1, scoring="topk_sigmoid",
            num_groups=1, topk_groups=1, topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0,
            first_k_dense_replace=0, layer_freq=1, shared_intermediate_size=inter, moe_layer_ids=moe_ids,
            weight_input=True)
        shape = decoder_shape({**cfg, "intermediate_size": cfg.get("intermediate_size_mlp", inter)})
        tuning = cfg.get("attn_temperature_tuning", True)
        temperature = (float(cfg.get("floor_scale", 8192)), float(cfg.get("attn_scale", 0.1))) if tuning else None
        return ModelConfig(
            architecture=arch, vocab_size=int(cfg["vocab_size"]), num_layers=layers, **shape,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)), o_proj_bias=bool(cfg.get("attention_bias", False)),
            qk_norm=False, bos_token_id=_first_int(cfg.get("bos_token_id")), eos_token_ids=_eos_ids(cfg, path),
            moe=moe, layer_types=types, attention_chunk_size=chunk, rope_layers=rope,
            attn_temperature=temperature,
            qk_l2_norm=bool(cfg.get("use_qk_norm", True)), interleaved_rope=True,
        )
    except KeyError as e:
        raise ModelLoadError(f"{file} lacks required field {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{file} has a malformed field: {e}") from e


def _first_int(value) -> int | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) else None


def _eos_ids(cfg: dict, path: Path) -> tuple[int, ...]:
    """eos ids of config.json then generation_config.json (each an int or a list), deduplicated, in order."""
    ids: list[int] = []
    sources = [cfg.get("eos_token_id")]
    gen = path / "generation_config.json"
    if gen.exists():
        sources.append(read_json(gen, "generation config").get("eos_token_id"))
    for src in sources:
        for t in src if isinstance(src, list) else [src]:
            if isinstance(t, int) and t not in ids:
                ids.append(t)
    return tuple(ids)


def _sliding_layers(cfg: dict, arch: str, layers: int, file: Path) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) of a Llama-family config, as transformers reads them: Mistral and Mixtral
    slide every layer when `sliding_window` is set; Qwen2 and Qwen3 list `layer_types`, or slide the layers from
    `max_window_layers` on when `use_sliding_window`. (None, None): every layer attends to all positions."""
    window = cfg.get("sliding_window")
    if arch not in SLIDING_ARCHITECTURES or not window:
        return None, None
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        types = ("sliding_attention",) * layers
    elif not cfg.get("use_sliding_window", False):
        return None, None
    else:
        first = int(cfg.get("max_window_layers") or 0)
        types = tuple(cfg.get("layer_types") or ("sliding_attention" if i >= first else "full_attention"
                                                 for i in range(layers)))
    if len(types) != layers or set(types) - {"full_attention", "sliding_attention"} or int(window) < 1:
        raise ModelLoadError(f"layer_types {list(types)} / sliding_window={window!r} in {file}: expected {layers} "
                             f"entries of 'full_attention' / 'sliding_attention' and a window >= 1")
    return (int(window), types) if "sliding_attention" in types else (None, None)


def _max_positions(cfg: dict) -> int:
    """Context the engine may use: max_position_embeddings, capped by a sliding window if one applies
    (within the window, full attention is exact)."""
    n = int(cfg.get("max_position_embeddings", 2048))
    window = cfg.get("sliding_window")
    if isinstance(window, int) and window > 0 and cfg.get("use_sliding_window", True):
        n = min(n, window)
    return n
