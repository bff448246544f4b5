"""Engine outputs as deltas, for the pipe between the engine process and the server (server/engine_process.py).

A request's token ids and logprob entries only ever grow (Engine._append appends), so each delta carries the ones
not sent yet; the prompt's ids and logprobs travel in a request's first delta only; the text travels as (length
of the sent text kept, text added), because a stop string can cut it and the final text is decoded afresh.
A request's speculation statistics travel only when they changed (None: as last sent): a speculative engine's
outputs each carry them, and they change only with a round (SpecStats.as_dict hands out the same dict until then),
so sending them every step would pickle an unchanged dict per request per step.
Whole outputs would cost pickling the whole prompt and output per request per step. Every output
of a request must be encoded, and assembled, in order: then the ids not sent yet are the output's
`new_token_ids`, which therefore do not travel apart.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from spruce.runtime.output import RequestOutput


@dataclass
class _Sent:
    """What the other side already has of one request's output."""

    tokens: int = 0
    text: str = ""
    logprobs: int = 0
    spec_stats: dict | None = None  # the object last sent (compared by identity)


class OutputEncoder:
    """Engine side: each RequestOutput as the delta from what was sent of its request before (module docstring).
    Every output of a request must be encoded, in order (the assembler applies them in that order)."""

    def __init__(self):
        self._sent: dict[str, _Sent] = {}

    def encode(self, outputs: list[RequestOutput]) -> list[tuple]:
        return [self._encode(out) for out in outputs]

    def _encode(self, out: RequestOutput) -> tuple:
        sent = self._sent.get(out.request_id)
        first = sent is None
        if first:
            sent = self._sent[out.request_id] = _Sent()
        keep = len(sent.text) if out.text.startswith(sent.text) else 0
        logprobs = None
        if out.logprobs is not None:
            logprobs, sent.logprobs = out.logprobs[sent.logprobs:], len(out.logprobs)
        spec_stats = None if out.spec_stats is sent.spec_stats else out.spec_stats
        delta = (out.request_id, out.prompt_token_ids if first else None, out.prompt_logprobs if first else None,
                 out.token_ids[sent.tokens:], keep, out.text[keep:], logprobs, out.finished, out.finish_reason,
                 spec_stats, out.num_cached_tokens, out.error)
        sent.tokens, sent.text, sent.spec_stats = len(out.token_ids), out.text, out.spec_stats
        if out.finished:
            del self._sent[out.request_id]
        return delta


class GrowingPrefix(Sequence):
    """The first `n` items of a list that only grows (appends, never a change to an item it holds): a snapshot of
    the list as it was, taken in O(1). The assembler's running outputs hold their token ids and logprobs so: the
    server reads a request's latest output (Mailbox) after later ones were assembled, so each needs the list as of
    its step, and a copy per request per step would cost O(output) each.
    Lengths, indexing, slices (O(slice)), iteration and equality with a list
    read as the snapshot."""

    __slots__ = ("_items", "_n")

    def __init__(self, items: list, n: int | None = None):
        self._items = items
        self._n = len(items) if n is None else n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(self._n)
            if step == 1:
                return self._items[start:max(start, stop)]
            return [self._items[k] for k in range(start, stop, step)]  # indices() gave bounds of the snapshot
        if not -self._n <= index < self._n:
            raise IndexError(f"index {index} out of a snapshot of {self._n} items")
        return self._items[index % self._n]

    def __iter__(self):
        return itertools.islice(self._items, self._n)

    def __eq__(self, other) -> bool:
        if isinstance(other, (GrowingPrefix, list, tuple)):
            return len(other) == self._n and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return repr(self._items[:self._n])


@dataclass
class _Assembled:
    """One request's output so far, rebuilt from its deltas."""

    prompt_token_ids: list[int]
    prompt_logprobs: list | None
    token_ids: list[int]
    text: str = ""
    logprobs: list | None = None
    spec_stats: dict = field(default_factory=dict)


class OutputAssembler:
    """Server side: rebuilds each request's cumulative RequestOutput from the encoder's deltas."""

    def __init__(self):
        self._requests: dict[str, _Assembled] = {}

    def assemble(self, deltas: list[tuple]) -> list[RequestOutput]:
        return [self._assemble(delta) for delta in deltas]

    def _assemble(self, delta: tuple) -> RequestOutput:
        (rid, prompt_ids, prompt_logprobs, tokens, keep, text, logprobs, finished, finish_reason, spec_stats, cached,
         error) = delta
        req = self._requests.get(rid)
        if req is None:
            req = self._requests[rid] = _Assembled(prompt_ids, prompt_logprobs, [])
        req.token_ids.extend(tokens)
        req.text = req.text[:keep] + text
        if spec_stats is not None:
            req.spec_stats = spec_stats
        if logprobs is not None:
            if req.logprobs is None:
                req.logprobs = []
            req.logprobs.extend(logprobs)
        if finished:  # its lists grow no more: handed out whole
            del self._requests[rid]
            token_ids, logprobs = req.token_ids, req.logprobs
        else:  # snapshots: later deltas append to the lists
            token_ids = GrowingPrefix(req.token_ids)
            logprobs = None if req.logprobs is None else GrowingPrefix(req.logprobs)
        # every output is sent, so the ids new since the last one sent are the output's new ids
        return RequestOutput(rid, req.prompt_token_ids, token_ids, req.text, tokens, finished, finish_reason,
                             req.spec_stats, logprobs, req.prompt_logprobs, cached, error)
