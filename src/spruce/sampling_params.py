"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from spruce.errors import InvalidRequestError

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20  # most top alternatives per position (vLLM's default max_logprobs)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    temperature == 0 means greedy; a temperature below SAMPLING_EPS (1e-5) is normalised to 0 (greedy, vLLM's
    convention): it differs from greedy only on near-exact logit ties, and dividing float32 logits by, say,
    1e-39 gives inf and a NaN softmax.
    top_k <= 0 (or -1) means no top-k cut; top_p == 1 means no nucleus cut.
    `seed` makes sampling reproducible per request, independent of what else is in the batch.
    `stop` strings end generation; the text is cut before the stop string. `stop_token_ids` (at most
    MAX_STOP_TOKEN_IDS, each >= 0; the engine's vocabulary bounds them above) end it too.
    `logprobs` (vLLM's meaning): None = none; n in [0, MAX_LOGPROBS] = each generated token's logprob plus its
    n most likely alternatives (0: the chosen token's alone). `prompt_logprobs` likewise for the prompt tokens
    (the first has none). Logprobs are the target's raw distribution: float32 log-softmax of its logits, before
    temperature, top-k and top-p (vLLM v1's default "raw logprobs"), identical with and without speculation.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}", field="max_tokens")
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}", field="temperature")
        if self.temperature < SAMPLING_EPS:
            object.__setattr__(self, "temperature", 0.0)
        _check_number("top_p", self.top_p)
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", field="top_p")
        _check_int("top_k", self.top_k)
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be >= 1, or -1/0 for no limit, got {self.top_k}", field="top_k")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not (0 <= self.seed < 2**63):
                raise InvalidRequestError(f"seed must be in [0, 2**63), got {self.seed}", field="seed")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(f"stop strings must be non-empty strings, got {s!r}", field="stop")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got "
                                      f"{len(self.stop_token_ids)}", field="stop_token_ids")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t)
            if t < 0:
                raise InvalidRequestError(f"stop_token_ids must be >= 0, got {t}", field="stop_token_ids")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            _check_int(name, value)
            if not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequestError(
                    f"{name}={value} is out of range: it must be between 0 and {MAX_LOGPROBS} (the number of top "
                    f"alternatives returned per token; 0 = only the chosen token's logprob)", field=name)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", field=name)


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", field=name)
