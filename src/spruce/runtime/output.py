"""What the engine hands back for a request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's logprob at one position (vLLM's `Logprob`): rank 1 = the most likely token;
    `decoded_token` is the token decoded alone (special tokens included), None without a tokenizer."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class RequestOutput:
    """A request's state after a step. `new_token_ids` are the tokens committed since the previous output
    (a speculative round can commit several at once); `text` is the whole output text so far.

    `logprobs` (when SamplingParams.logprobs is set): one dict per token of `token_ids`, vLLM's offline shape
    {token_id: Logprob(logprob, rank, decoded_token)}, the chosen token first, then its n most likely
    alternatives. `prompt_logprobs` (SamplingParams.prompt_logprobs): the same per prompt token, None for the
    first. Raw target logprobs (before temperature / top-k / top-p), float32."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    spec_stats: dict = field(default_factory=dict)
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (OpenAI usage.cached_tokens)
    error: str | None = None  # finish_reason "error": why (the request's grammar failed mid-generation)
