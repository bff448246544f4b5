"""Logprobs: the target's own log-probabilities of the tokens a request commits (and of its prompt).

What is returned (vLLM v1's default "raw logprobs"): the float32 log-softmax of the target's logits at that
position, before temperature, top-k and top-p, for the chosen token (with its rank, as vLLM counts it: the
number of tokens whose logprob is >= the chosen one's, so the most likely token has rank 1) and for the `n`
most likely tokens. With speculation they come from the verify logits along the accepted path (the row of node i
predicts the token after node i, the bonus token's row is the last accepted node's); in plain decoding from
the decode logits; prompt logprobs from the prefill logits. A committed token is the same whichever way it
was reached, and so are the logits that chose it: speculative and plain decoding return the same logprobs.

Cost only when asked: a step whose requests want none computes nothing extra (its graph phases are the same).
Otherwise the strategy scores the wanted rows eagerly after the step's token selection (`pack_logprobs`) into
one float64 pack per step, copied to the host with the step's result rows under the same event.

Pack row layout (float64: exact for float32 values and token ids): [chosen logprob, chosen rank,
top-k logprobs (descending), top-k token ids], k = the largest `n` in the step's batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from spruce.errors import InvariantError
from spruce.runtime.output import Logprob
from spruce.sampling_params import MAX_LOGPROBS

PROMPT_SCORE_ROWS = 512  # prompt rows scored per lm_head call (bounds the [rows, V] float32 logits)


@dataclass
class LogprobPlan:
    """What one launched step scores, decided by the host at launch; the strategy sets `pack` (device) and the
    engine `host` (its copy, valid once the step's event completed).

    Pack rows: `width` per entry of `rows` (the step's result rows: decode; or its final prefill chunks), then
    one per `prompt_rows` entry (a prefill batch token row whose next prompt token `prompt_tokens[i]` is
    scored), grouped by `prompt_spans` (request, first prompt position, count)."""

    k: int
    rows: list[int]
    width: int = 1
    prompt_rows: list[int] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    prompt_spans: list[tuple[Any, int, int]] = field(default_factory=list)
    pack: torch.Tensor | None = None  # [len(rows) * width + len(prompt_rows), 2 + 2k] float64 on the device
    host: torch.Tensor | None = None  # the same on the host

    def row_slots(self) -> dict[int, int]:
        """Result row -> index of its first pack row."""
        return {row: j * self.width for j, row in enumerate(self.rows)}


def decode_plan(reqs: list, width: int) -> LogprobPlan | None:
    """The plan of a decode step over `reqs` (each result row commits up to `width` tokens), None when no
    request wants logprobs."""
    want = [i for i, q in enumerate(reqs) if q.params.logprobs is not None]
    if not want:
        return None
    return LogprobPlan(k=max(reqs[i].params.logprobs for i in want), rows=want, width=width)


def prefill_plan(reqs: list, chunks: list, finals: list) -> LogprobPlan | None:
    """The plan of a prefill step: the token sampled after each final chunk whose request wants logprobs, and
    the prompt positions of the chunks whose requests want prompt logprobs and have not had them scored yet
    (a prompt recomputed after preemption is not scored again). Advances each request's `prompt_lp_next`."""
    rows = [j for j, q in enumerate(finals) if q.params.logprobs is not None]
    k = max((finals[j].params.logprobs for j in rows), default=0)
    prompt_rows: list[int] = []
    prompt_tokens: list[int] = []
    spans: list[tuple[Any, int, int]] = []
    offset = 0
    for q, c in zip(reqs, chunks):
        n = len(c.tokens)
        if q.params.prompt_logprobs is not None and q.prompt_lp_next < len(q.prompt_ids):
            if q.prompt_lp_next < c.start + 1:
                raise InvariantError(
                    f"request {q.request_id}: prompt logprobs of positions {q.prompt_lp_next}..{c.start} were never "
                    f"scored, but its prefill starts at {c.start} (a request that wants prompt logprobs must compute "
                    f"its whole prompt: no prefix-cache hit)")
            lo, hi = q.prompt_lp_next, min(len(q.prompt_ids), c.start + n + 1)  # row t predicts start + t + 1
            if hi > lo:
                prompt_rows += range(offset + lo - c.start - 1, offset + hi - c.start - 1)
                prompt_tokens += q.prompt_ids[lo:hi]
                spans.append((q, lo, hi - lo))
                q.prompt_lp_next = hi
                k = max(k, q.params.prompt_logprobs)
        offset += n
    if not rows and not prompt_rows:
        return None
    return LogprobPlan(k=k, rows=rows, prompt_rows=prompt_rows, prompt_tokens=prompt_tokens, prompt_spans=spans)


# --- device side -------------------------------------------------------------------------------------------------
def pack_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """logits [m, V], tokens [m] -> [m, 2 + 2k] float64: the chosen token's raw logprob and rank, then the
    top-k logprobs and their token ids."""
    lp = logits.float().log_softmax(dim=-1)  # [m, V]
    chosen = lp.gather(1, tokens.long()[:, None])  # [m, 1]
    rank = (lp >= chosen).sum(dim=1, keepdim=True)  # [m, 1] vLLM's rank (1 = most likely)
    cols = [chosen.double(), rank.double()]
    if k:
        values, ids = lp.topk(k, dim=-1)  # [m, k]
        cols += [values.double(), ids.double()]
    return torch.cat(cols, dim=1)


def pack_prefill(plan: LogprobPlan, logits: torch.Tensor | None, new_tokens: torch.Tensor, hidden: torch.Tensor,
                 compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """A prefill step's pack: `logits` [finals, V] and `new_tokens` [finals] of its final chunks, then the
    prompt rows of `hidden` [T, H] through `compute_logits`, PROMPT_SCORE_ROWS at a time."""
    dev = new_tokens.device
    parts = []
    if plan.rows:
        sel = torch.tensor(plan.rows, dtype=torch.int64).to(dev, non_blocking=True)
        parts.append(pack_logprobs(logits[sel], new_tokens[sel], plan.k))
    if plan.prompt_rows:
        host = torch.tensor([plan.prompt_rows, plan.prompt_tokens], dtype=torch.int64)
        idx, targets = host.to(dev, non_blocking=True).unbind(0)
        for s in range(0, idx.shape[0], PROMPT_SCORE_ROWS):
            part = slice(s, s + PROMPT_SCORE_ROWS)
            parts.append(pack_logprobs(compute_logits(hidden[idx[part]]), targets[part], plan.k))
    return torch.cat(parts)


class PackReadback:
    """Two page-locked host buffers for the packs of the (at most two) unread launched steps, made the first
    time a request wants logprobs on a cuda engine; none on the cpu, where a pack is on the host already."""

    def __init__(self, max_rows: int):
        self.max_rows = max_rows
        self.buffers: list[torch.Tensor] = []

    def copy(self, slot: int, pack: torch.Tensor) -> torch.Tensor:
        """Queue the copy of `pack` into buffer `slot` (the slot of the step's result buffer, read under its
        event); returns the host view."""
        if pack.device.type != "cuda":
            return pack
        if not self.buffers:
            size = self.max_rows * (2 + 2 * MAX_LOGPROBS)
            self.buffers = [torch.zeros(size, dtype=torch.float64, pin_memory=True) for _ in range(2)]
        if pack.shape[0] > self.max_rows:
            raise InvariantError(f"logprob pack of {pack.shape[0]} rows exceeds the {self.max_rows} buffered")
        host = self.buffers[slot][: pack.numel()].view(pack.shape)
        host.copy_(pack, non_blocking=True)
        return host


# --- host side ---------------------------------------------------------------------------------------------------
def make_entry(row: list[float], token: int, n: int, text: Callable[[int], str | None]) -> dict[int, Logprob]:
    """One position's logprobs in vLLM's offline shape from a pack row: the chosen token first, then its n most
    likely tokens by rank (a chosen token among them appears once, with its top-k rank)."""
    k = (len(row) - 2) // 2
    entry = {token: Logprob(row[0], int(row[1]), text(token))}
    for j in range(min(n, k)):
        tid = int(row[2 + k + j])
        entry[tid] = Logprob(row[2 + j], j + 1, text(tid))
    return entry
