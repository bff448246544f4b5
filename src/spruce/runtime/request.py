"""A request's state as it moves through the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from spruce.errors import InvalidRequestError
from spruce.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # queued, holds no row and no pages
    PREFILL = "prefill"  # holds a row and pages, prompt not fully in the cache yet
    DECODE = "decode"  # committed == len(token_ids) - 1: the last token has no KV yet
    FINISHED = "finished"


FINISHED = Status.FINISHED  # a module constant: `Status.FINISHED` is a class lookup (~60 ns) on hot paths


@dataclass
class SpecStats:
    """Speculation statistics. accept length = tokens committed per verify round, bonus included."""

    rounds: int = 0
    committed_tokens: int = 0
    accepted_per_depth: list[int] = field(default_factory=list)  # [S]: rounds whose depth d+1 was accepted
    accept_length_counts: list[int] = field(default_factory=list)  # [S+1]: rounds that accepted a drafts
    built: dict | None = field(default=None, repr=False, compare=False)  # as_dict's, until the next round: what
    # an output carries, read without a call on every output of every step (`Engine._output`)

    def add_round(self, accepted: int, num_steps: int) -> None:
        self.built = None
        if not self.accepted_per_depth:
            self.accepted_per_depth = [0] * num_steps
            self.accept_length_counts = [0] * (num_steps + 1)
        self.rounds += 1
        self.committed_tokens += accepted + 1
        for d in range(accepted):
            self.accepted_per_depth[d] += 1
        self.accept_length_counts[accepted] += 1

    @property
    def mean_accept_length(self) -> float:
        return self.committed_tokens / self.rounds if self.rounds else 0.0

    @property
    def accept_rate_per_depth(self) -> list[float]:
        return [v / self.rounds for v in self.accepted_per_depth] if self.rounds else []

    def as_dict(self) -> dict:
        """The statistics as a dict, built once per round and shared by every output until the next round (every
        output of a speculative engine carries one, so adaptive plain steps must not build it anew): read it, do
        not modify it."""
        if self.built is None:
            self.built = {
                "rounds": self.rounds,
                "committed_tokens": self.committed_tokens,
                "mean_accept_length": round(self.mean_accept_length, 4),
                "accept_rate_per_depth": [round(r, 4) for r in self.accept_rate_per_depth],
                "accept_length_counts": list(self.accept_length_counts),
            }
        return self.built


@dataclass(eq=False)  # identity: queues look requests up by object, never by comparing their fields
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: int  # admission order key (lower = older)
    queued_at: float = 0.0  # when it was (last) queued, by the scheduler's clock (prefill batching)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    row: int | None = None
    token_limit: int = 0  # prompt + output tokens at which it ends ("length"): min(prompt + max_tokens, context)
    stop_ids: frozenset = frozenset()  # token ids that end it ("stop"): eos (unless ignored) and stop_token_ids
    committed: int = 0  # positions whose target KV is in the pages, as far as the host knows
    accept_state: object | None = None  # adaptive speculation's record of its rounds' acceptance
    # (speculative/adaptive.py's RequestAcceptance; None before its first decode step)
    reserved: int = 0  # positions its pages cover (0 while it holds no row)
    freed_to: int = 0  # its own pages in columns [len(cached_path), freed_to) are freed: every window passed them
    inflight: int = 0  # launched steps that include this request and whose results are not read yet
    finish_reason: str | None = None
    text: str = ""  # output text so far (incremental; cut before a stop string)
    detokenizer: object | None = None  # IncrementalDetokenizer over output_ids (None: no tokenizer)
    detokenized: int = 0  # output tokens already fed to the detokenizer (text is built when asked for)
    num_preemptions: int = 0
    spec: SpecStats = field(default_factory=SpecStats)
    new_token_count: int = 0  # tokens appended since the last output was emitted
    logprobs: list | None = None  # one entry per output token (params.logprobs set), see runtime/logprobs.py
    prompt_logprobs: list | None = None  # one entry per prompt token, None first (params.prompt_logprobs set)
    prompt_lp_next: int = 1  # first prompt position whose logprobs no launched step has scored yet
    cached_path: list = field(default_factory=list)  # prefix-cache nodes whose pages it shares (while it holds a row)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at its (latest) admission
    grammar: object | None = None  # RequestGrammar (runtime/grammar.py) when it has structured output
    bad_word_ids: tuple = ()  # its bad_words as token sequences (SamplingParams.bad_words_token_ids)

    def __post_init__(self):
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_ids)

    @property
    def prompt_logprobs_pending(self) -> bool:
        """Prompt logprobs are wanted and not all scored: its whole prompt must be computed (no prefix-cache
        hit may skip a position)."""
        return self.prompt_logprobs is not None and self.prompt_lp_next < len(self.prompt_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is FINISHED

    def reset_for_recompute(self) -> None:
        """After preemption: the cache is gone; prompt + output so far will be prefilled again."""
        self.status = Status.WAITING
        self.row = None
        self.committed = 0
        self.reserved = 0
        self.freed_to = 0
        self.cached_path = []
        self.num_preemptions += 1


def prompt_token_ids(prompt, tokenizer, vocab_size: int) -> list[int]:
    """A request's prompt as token ids: a string encoded by `tokenizer` (None: the model ships no tokenizer, so
    strings are refused), or a list of ids, each checked to be an int in [0, vocab_size). InvalidRequestError
    names what is wrong. The engine calls it in add_request; the server's engine-process client
    (server/engine_process.py) calls it before sending, so prompts are tokenised outside the engine process."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt is empty; expected at least one token", field="prompt")
        if tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer.json: give token ids", field="prompt")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)):
        ids = list(prompt)
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token ids must be ints in [0, {vocab_size}); got {bad[:5]}",
                                      field="prompt")
    else:
        raise InvalidRequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                                  field="prompt")
    if not ids:
        raise InvalidRequestError("prompt is empty; expected at least one token", field="prompt")
    return ids
