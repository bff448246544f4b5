"""The OpenAI wire format: request models, their translation to SamplingParams, response chunks, error bodies.

Requests are validated in two layers: pydantic (strict types, shapes, server limits) and then
`SamplingParams` / `Engine.add_request` (ranges, prompt length). Both raise errors that name the offending
field, and both end up as OpenAI-style `{"error": {"message", "type", "param", "code"}}` bodies.
"""

from __future__ import annotations

import hashlib
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from spruce.errors import InvalidRequestError
from spruce.sampling_params import SamplingParams

MAX_N = 64  # choices per request
MAX_CHOICES = 256  # prompts x n per request
MAX_STOP = 16
MAX_STOP_CHARS = 256
UNION_MESSAGES = {
    "prompt": "prompt must be a string, a list of token ids, or a list of strings or of token-id lists",
    "stop": "stop must be a string or a list of strings",
    "content": "content must be a string or a list of {'type': 'text', 'text': ...} parts",
}


class OpenAIError(Exception):
    """An error answered as an OpenAI-style error body with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 error_type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = error_type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @staticmethod
    def from_invalid_request(e: InvalidRequestError, rename: dict[str, str] | None = None) -> "OpenAIError":
        param = (rename or {}).get(e.field, e.field)
        code = "context_length_exceeded" if e.status == 413 else None
        return OpenAIError(e.status, str(e), param=param, code=code)

    @staticmethod
    def from_validation(e: ValidationError) -> "OpenAIError":
        errors = e.errors()
        first = errors[0]
        loc = list(first["loc"])
        param = _param_path(loc)
        field = str(loc[0]) if loc else None
        leaf = next((str(p) for p in reversed(loc) if str(p) in UNION_MESSAGES), field)
        union = sum(1 for x in errors if x["loc"][:1] == first["loc"][:1]) > 1
        message = UNION_MESSAGES[leaf] if union and leaf in UNION_MESSAGES else f"{param}: {first['msg']}"
        return OpenAIError(400, message, param=param, code="invalid_value" if loc else None)


def _param_path(loc: list) -> str | None:
    """('messages', 0, 'content', 'str') -> 'messages[0].content' (union member tags dropped)."""
    path = ""
    for i, p in enumerate(loc):
        if isinstance(p, int):
            path += f"[{p}]"
        elif i == 0 or (p.isidentifier() and p not in ("str", "int", "float", "bool", "list", "dict")):
            path += ("." if path else "") + p
        else:
            break
    return path or None


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationRequest(_Strict):
    """Fields the completions and chat endpoints share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool | int | None = None
    user: str | None = None

    def check_supported(self) -> None:
        """Refuse features spruce does not implement instead of silently ignoring them."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise OpenAIError(400, f"{name} is not supported (must be 0)", param=name, code="unsupported")
        if self.logprobs:
            raise OpenAIError(400, "logprobs are not supported", param="logprobs", code="unsupported")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        if len(stops) > MAX_STOP:
            raise OpenAIError(400, f"at most {MAX_STOP} stop strings are allowed, got {len(stops)}", param="stop")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise OpenAIError(400, f"stop strings must be at most {MAX_STOP_CHARS} characters", param="stop")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens_default: int, vocab_size: int) -> list[SamplingParams]:
        """One SamplingParams per choice; with a seed, choice i > 0 gets a distinct seed derived from it."""
        max_tokens = self.max_tokens if self.max_tokens is not None else max_tokens_default
        top_k = self.top_k if self.top_k is not None else -1
        if top_k > vocab_size:
            top_k = -1  # no cut; also keeps huge values out of the device tensors
        out = []
        for i in range(self.n):
            out.append(SamplingParams(
                max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=top_k,
                seed=choice_seed(self.seed, i), stop=self.stop or (), stop_token_ids=self.stop_token_ids or (),
                ignore_eos=self.ignore_eos))
        return out


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) of a (possibly batched) request."""
        if self.echo or self.suffix:
            raise OpenAIError(400, "echo and suffix are not supported", param="echo" if self.echo else "suffix")
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [p]
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    def model_post_init(self, _context) -> None:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens


def parse_request(cls: type[_GenerationRequest], body: dict) -> _GenerationRequest:
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        raise OpenAIError.from_validation(e) from None
    req.check_supported()
    return req


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice 0 keeps the user's seed (so n=1 and n>1 agree on it); the others get distinct derived seeds."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.sha256(f"spruce-choice:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class TextDelta:
    """Turns one request's successive outputs into text increments that are safe to stream: while the request
    runs, a trailing U+FFFD (an incomplete UTF-8 character) and any tail that could start a stop string are
    held back. The increments concatenate to the final (stop-cut) text. (Should a tokenizer's decode ever
    rewrite text already sent, streaming resumes at the same character offset: sent text cannot be taken back.)"""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.sent = ""

    def feed(self, text: str, finished: bool) -> str:
        """The text to send now, given the request's whole output text so far."""
        if not finished:
            text = text.rstrip("\ufffd")
            text = text[:len(text) - stop_prefix_len(text, self.stops)]
        if len(text) <= len(self.sent):
            return ""
        if not text.startswith(self.sent):
            self.sent = text[:len(self.sent)]
        delta = text[len(self.sent):]
        self.sent = text
        return delta


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(request_id: str, obj: str, model: str, choices: list, created: int | None = None, **extra) -> dict:
    """The fields every completion object and chunk carries."""
    return {"id": request_id, "object": obj, "created": created or int(time.time()), "model": model,
            "choices": choices, **extra}


def completion_choice(index: int, text: str, finish_reason: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


def chat_choice(index: int, text: str, finish_reason: str | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish_reason}


def chat_delta(index: int, delta: dict, finish_reason: str | None) -> dict:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
