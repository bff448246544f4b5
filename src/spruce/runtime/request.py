"""A request's state as it moves through the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from spruce.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # queued, holds no row and no pages
    PREFILL = "prefill"  # holds a row and pages, prompt not fully in the cache yet
    DECODE = "decode"  # committed == len(token_ids) - 1: the last token has no KV yet
    FINISHED = "finished"


@dataclass
class SpecStats:
    """Speculation statistics. accept length = tokens committed per verify round, bonus included."""

    rounds: int = 0
    committed_tokens: int = 0
    accepted_per_depth: list[int] = field(default_factory=list)  # [S]: rounds whose depth d+1 was accepted

    def add_round(self, accepted: int, num_steps: int) -> None:
        if not self.accepted_per_depth:
            self.accepted_per_depth = [0] * num_steps
        self.rounds += 1
        self.committed_tokens += accepted + 1
        for d in range(accepted):
            self.accepted_per_depth[d] += 1

    def merge(self, other: "SpecStats") -> None:
        if not self.accepted_per_depth:
            self.accepted_per_depth = [0] * len(other.accepted_per_depth)
        self.rounds += other.rounds
        self.committed_tokens += other.committed_tokens
        for d, v in enumerate(other.accepted_per_depth):
            self.accepted_per_depth[d] += v

    @property
    def mean_accept_length(self) -> float:
        return self.committed_tokens / self.rounds if self.rounds else 0.0

    @property
    def accept_rate_per_depth(self) -> list[float]:
        return [v / self.rounds for v in self.accepted_per_depth] if self.rounds else []

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "committed_tokens": self.committed_tokens,
            "mean_accept_length": round(self.mean_accept_length, 4),
            "accept_rate_per_depth": [round(r, 4) for r in self.accept_rate_per_depth],
        }


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: int  # admission order key (lower = older)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    row: int | None = None
    committed: int = 0  # positions whose target KV is in the pages
    draft_committed: int = 0  # positions whose draft KV is in the pages
    finish_reason: str | None = None
    text: str = ""
    text_frozen: bool = False  # set when a stop string cut the text; later decodes must not undo the cut
    num_preemptions: int = 0
    spec: SpecStats = field(default_factory=SpecStats)
    new_token_count: int = 0  # tokens appended since the last output was emitted

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

    def reset_for_recompute(self) -> None:
        """After preemption: the cache is gone; prompt + output so far will be prefilled again."""
        self.status = Status.WAITING
        self.row = None
        self.committed = 0
        self.draft_committed = 0
        self.num_preemptions += 1
