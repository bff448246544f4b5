"""What the engine hands back for a request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """A request's state after a step. `new_token_ids` are the tokens committed since the previous output
    (a speculative round can commit several at once); `text` is the whole output text so far."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    spec_stats: dict = field(default_factory=dict)
