"""Model configuration read from a Hugging Face `config.json` (Llama, Mistral, Qwen2, Qwen3).

Both rope styles are read: the older `rope_theta` + `rope_scaling` and the newer `rope_parameters`
(transformers >= 5). Rope types default, linear and llama3 are supported; anything else is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from spruce.errors import ModelLoadError

# architecture -> (qkv bias by default, per-head q/k RMSNorm)
ARCHITECTURES = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}
ROPE_TYPES = ("default", "linear", "llama3")
# keys each rope type needs (llama3's original_max_position_embeddings falls back to max_position_embeddings)
_ROPE_KEYS = {"default": (), "linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}


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
    if rope_type == "llama3":
        scaling.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 2048))
    return theta, scaling


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

    @staticmethod
    def from_dir(path) -> "ModelConfig":
        """Read `path/config.json` (and generation_config.json if present). ModelLoadError on anything unusable."""
        path = Path(path)
        if not path.is_dir():
            raise ModelLoadError(f"model directory not found: {path}")
        file = path / "config.json"
        cfg = read_json(file, "model config")
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(f"architecture {archs!r} in {file} is not supported; "
                                 f"supported: {sorted(ARCHITECTURES)}")
        bias, qk_norm = ARCHITECTURES[arch]
        if cfg.get("mlp_bias"):
            raise ModelLoadError(f"mlp_bias=true in {file} is not supported")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"hidden_act={act!r} in {file} is not supported (only 'silu')")
        try:
            attention_bias = bool(cfg.get("attention_bias", bias))
            return ModelConfig(
                architecture=arch, vocab_size=int(cfg["vocab_size"]), num_layers=int(cfg["num_hidden_layers"]),
                **decoder_shape(cfg), max_position_embeddings=_max_positions(cfg),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=attention_bias,
                # Llama and Qwen3 put `attention_bias` on o_proj too; Qwen2's q/k/v bias leaves o_proj bare
                o_proj_bias=arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") and attention_bias,
                qk_norm=qk_norm,
                bos_token_id=_first_int(cfg.get("bos_token_id")), eos_token_ids=_eos_ids(cfg, path),
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


def _max_positions(cfg: dict) -> int:
    """Context the engine may use: max_position_embeddings, capped by a sliding window if one applies
    (within the window, full attention is exact)."""
    n = int(cfg.get("max_position_embeddings", 2048))
    window = cfg.get("sliding_window")
    if isinstance(window, int) and window > 0 and cfg.get("use_sliding_window", True):
        n = min(n, window)
    return n
