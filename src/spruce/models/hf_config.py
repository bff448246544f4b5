"""Model configuration read from a Hugging Face `config.json` (Llama, Mistral, Qwen2, Qwen3)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from spruce.errors import ModelLoadError

# architecture -> (qkv bias, per-head q/k RMSNorm)
ARCHITECTURES = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}
ROPE_TYPES = ("default", "llama3", "linear")


def read_json(path: Path, what: str) -> dict:
    if not path.exists():
        raise ModelLoadError(f"{what} not found: {path}")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{what} {path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{what} {path} must hold a JSON object, got {type(data).__name__}")
    return data


def rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from either style: `rope_theta`/`rope_scaling` or `rope_parameters`."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = dict(cfg.get("rope_scaling") or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(f"rope_type={rope_type!r} is not supported; expected one of {ROPE_TYPES}")
    if rope_type == "default":
        return theta, None
    scaling["rope_type"] = rope_type
    return theta, scaling


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v
    o_proj_bias: bool
    qk_norm: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @staticmethod
    def from_dir(path) -> "ModelConfig":
        path = Path(path)
        if not path.is_dir():
            raise ModelLoadError(f"model directory not found: {path}")
        cfg = read_json(path / "config.json", "model config")
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"architecture {archs!r} in {path / 'config.json'} is not supported; "
                f"supported: {sorted(ARCHITECTURES)}"
            )
        bias, qk_norm = ARCHITECTURES[arch]
        if cfg.get("mlp_bias"):
            raise ModelLoadError(f"mlp_bias=true in {path / 'config.json'} is not supported")
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            theta, scaling = rope_settings(cfg)
            eos = _eos_ids(cfg, path)
            return ModelConfig(
                architecture=arch, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
                max_position_embeddings=_max_positions(cfg),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", bias)),
                o_proj_bias=arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") and bool(cfg.get("attention_bias")),
                qk_norm=qk_norm,
                bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos,
            )
        except KeyError as e:
            raise ModelLoadError(f"{path / 'config.json'} lacks required field {e.args[0]!r}") from e
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"{path / 'config.json'} has a malformed field: {e}") from e


def _eos_ids(cfg: dict, path: Path) -> tuple[int, ...]:
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
