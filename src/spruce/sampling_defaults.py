"""Sampling defaults from a model's generation_config.json, as vLLM (`--generation-config auto`) and SGLang
(`--sampling-defaults model`) read them: a request that leaves temperature, top_p, top_k, min_p or
repetition_penalty unset gets the model's value instead of the API's neutral one."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from spruce.errors import InvalidRequestError

log = logging.getLogger("spruce")
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def model_sampling_defaults(model: str | Path) -> dict[str, float | int]:
    """The sampling settings `model`'s generation_config.json gives ({} when it has none or no such file). A value
    SamplingParams refuses is left out with a warning, as is HF's top_k 0 (no cut, spruce's -1: the default).

    e.g. {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": true} -> {"temperature": 0.6,
    "top_p": 0.95, "top_k": 20}."""
    from spruce.sampling_params import SamplingParams

    path = Path(model) / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    defaults = {}
    for key in SAMPLING_DEFAULT_KEYS:
        value = config.get(key) if isinstance(config, dict) else None
        if value is None or (key == "top_k" and value == 0):
            continue
        try:
            SamplingParams(**{key: value})
        except (InvalidRequestError, TypeError, ValueError) as e:
            log.warning("%s: %s=%r is not a usable sampling default, left out: %s", path, key, value, e)
            continue
        defaults[key] = value
    return defaults
