"""Decode strategies (DESIGN §10): how a step turns the rows' device state into committed tokens.

The engine plans, launches and resolves steps and never asks which strategy it has. A strategy owns its
static inputs, its phases and their CUDA graphs; `PlainDecoding` commits one target token per step, the
EAGLE worker (EAGLE, EAGLE-3; speculative/eagle_worker.py) a tree-verified run of draft tokens plus the target's
bonus token. This module is the interface the engine needs; speculative strategies plug into it from above: the
engine builds its strategy with the `StrategyFactory` its caller passes in (speculative/registry.py's
`make_strategy`), so runtime/ never imports speculative/.

Every step returns a device tensor [n, W], W at most Limits.step_result_width: each row's accept length a (0 for
plain decoding and prefill), then its committed tokens (a + 1 of them, then padding). A plain step's is [n, 2] even
beside a draft, so that its read-back holds no padding. Nothing inside a strategy reads device memory back to the
host, so a step can be queued while the previous one still runs.

Two hooks let a strategy choose per step (adaptive speculation, speculative/adaptive.py): `choose(requests)` before a
decode step returns what runs it, and `on_round(step, requests, results)` after the step's results are read.

A step given a `LogprobPlan` (some request wants logprobs) also scores the plan's rows, eagerly after its
token selection, and leaves the pack in `plan.pack` (runtime/logprobs.py); without one nothing extra runs.
A step given a `GrammarBatch` (some request has structured output) selects its tokens eagerly from the target's
logits masked by the requests' grammars (runtime/grammar.py); logprobs still score the raw logits.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

import torch

from spruce.attention.metadata import Phase
from spruce.limits import Limits
from spruce.runtime.grammar import GrammarBatch, apply_token_mask
from spruce.runtime.logprobs import LogprobPlan, pack_logprobs, pack_prefill
from spruce.runtime.model_runner import ModelRunner
from spruce.runtime.penalties import TokenHistory
from spruce.runtime.sampler import SamplingTensors, select_tokens


WARM_LENGTHS = (1, 16, 17, 64)  # tokens per request of the eager warm-up's batches (`warm_spans`)
WARM_FAR = 1024  # ... from position 0 and from this far into the context (or as far as the context allows)


def warm_spans(limits: Limits) -> list[list[tuple[int, int]]]:
    """The (start, length) spans of the dummy row that `DecodeStrategy.warm_eager` runs, one list per eager
    forward: each length of WARM_LENGTHS from position 0 and from WARM_FAR, one request at a time, then all of
    them in one batch. A Triton kernel is compiled per constexpr variant, and the eager paths choose theirs from
    the batch: the attention kernel's query block (16 rows for requests of at most 16 tokens, else 32) and its
    kv split (split where a few requests read a long context), MLA's block (64 rows once a request has that
    many query rows). Those four lengths at those two starts meet every variant; lengths that differ only in a
    divisibility by 16 or a value of 1 also meet any specialisation of an integer argument. Lengths are capped at
    Limits.max_tokens_per_forward, starts at the context length, the batch at max_running_requests."""
    budget = limits.max_tokens_per_forward
    lengths = sorted({min(n, budget) for n in WARM_LENGTHS})
    far = max(min(WARM_FAR, limits.context_length - lengths[-1]), 0)
    starts = sorted({0, far})
    single = [[(start, n)] for start in starts for n in lengths]
    together, used = [], 0
    for start in starts:
        for n in lengths:
            if used + n <= budget and len(together) < limits.max_running_requests:
                together.append((start, n))
                used += n
    return single + [together]


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens [start, start + len(tokens)) of the request in page-table row `row`.

    `next_tokens` are the tokens one position later (the draft's inputs): the chunk's tokens shifted by one,
    ending with the prompt token after the chunk, or (final chunk) one short: the token sampled after the
    prompt completes it on the device."""

    row: int
    start: int
    tokens: list[int]
    next_tokens: list[int]
    final: bool


class DecodeStrategy:
    """The interface, and the prefill and static-input handling every strategy shares."""

    speculative = False
    tree_width = 1  # sampling rows per request of a decode step: the verify tree's nodes (speculative)

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        lim = runner.limits
        self.rows = torch.full((lim.max_running_requests,), lim.dummy_row, dtype=torch.int64,
                               device=runner.device)  # [R] static input: the batch's rows, then padding
        self._filled_rows: list[int] | None = None  # what `rows` holds (None: unknown, e.g. after a capture)

    # --- prefill ---------------------------------------------------------------------------------------------
    def prefill(self, chunks: list[PrefillChunk], sampling: SamplingTensors,
                logprobs: LogprobPlan | None = None, grammar: GrammarBatch | None = None) -> torch.Tensor:
        """Run prompt chunks through the target; sample after every final chunk.

        `sampling` (and `grammar`, if any) has one row per final chunk. Returns [finals, step_result_width]
        (accept length 0, the sampled token) and sets each finished prompt's row state (committed = prompt
        length, last = token).
        `logprobs`: score the sampled tokens of its final chunks and its prompt rows."""
        r = self.runner
        keep = self.wants_prefill_features(chunks)
        hidden, aux = r.prefill_forward([c.row for c in chunks], [c.start for c in chunks], [c.tokens for c in chunks],
                                        aux=keep)
        ends = [n - 1 for n in itertools.accumulate(len(c.tokens) for c in chunks)]  # each chunk's last token
        finals = [i for i, c in enumerate(chunks) if c.final]
        result = torch.zeros(len(finals), r.limits.step_result_width, dtype=torch.int64, device=r.device)
        new_tokens = result[:, 1]
        logits = None
        if finals:
            host = torch.tensor([[ends[i] for i in finals], [chunks[i].row for i in finals],
                                 [chunks[i].start + len(chunks[i].tokens) for i in finals]], dtype=torch.int64)
            idx, rows, positions = host.to(r.device, non_blocking=True).unbind(0)
            logits = r.target.compute_logits(hidden[idx])  # [finals, V]
            chosen_from = logits if grammar is None else apply_token_mask(logits, grammar.row_masks(r.device))
            new_tokens.copy_(select_tokens(chosen_from, sampling, positions, self.history(sampling, rows)))
            r.row_state.set(rows, positions, new_tokens)
        if logprobs is not None:
            logprobs.pack = pack_prefill(logprobs, logits, new_tokens, hidden, r.target.compute_logits)
        self.extend_draft(chunks, r.target_features(hidden, aux) if keep else None, ends, finals, new_tokens)
        return result

    def wants_prefill_features(self, chunks: list[PrefillChunk]) -> bool:
        """Whether `extend_draft` reads the target's draft features of these prefill chunks: only then does the
        target's eager prefill keep them (EAGLE-3's aux concatenation). Here: no draft."""
        return False

    def extend_draft(self, chunks: list[PrefillChunk], features: torch.Tensor | None, ends: list[int],
                     finals: list[int], new_tokens: torch.Tensor) -> None:
        """Bring a draft's KV up to the prefilled chunks (features [T, F] of the chunk tokens, None where
        `wants_prefill_features` said no); none here."""

    def warm_eager(self) -> None:
        """Run the eager prefill path (the target, then the draft's extend) over the dummy row at `warm_spans`,
        before serving: every kernel variant a served prompt can meet is compiled now, not in the middle of serving
        (a compilation stalls the step that launched it for 0.1-1 s on a GPU: ops/compile_watch.py). The
        chunks are not final: no token is sampled and no row's state changes; their K/V go to the dummy page,
        which padding rows write anyway."""
        row = self.runner.limits.dummy_row
        for spans in warm_spans(self.runner.limits):
            chunks = [PrefillChunk(row, start, [0] * n, [0] * n, final=False) for start, n in spans]
            self.prefill(chunks, SamplingTensors.greedy())

    # --- decode ----------------------------------------------------------------------------------------------
    def decode(self, rows: list[int], max_kv: int, sampling: SamplingTensors,
               logprobs: LogprobPlan | None = None, grammar: GrammarBatch | None = None) -> torch.Tensor:
        """One decode step for the requests in `rows`: [bs, W] on the device (module docstring).

        max_kv: an upper bound of any row's kv length during the step (eager runs size their split-KV by it).
        `sampling` has one row per request (per tree node for speculative strategies). `logprobs`: score the
        committed tokens of its rows (`width` pack rows each). `grammar`: one entry per request in `rows`."""
        raise NotImplementedError

    def capture_graphs(self, show_progress: bool) -> None:
        """Capture this strategy's decode-time phases for every graph bucket."""
        raise NotImplementedError

    # --- per-step choice (speculative/adaptive.py; a fixed strategy is its own choice) --------------------------
    def choose(self, requests: list):
        """What runs the next decode step over `requests`, called right before its launch: an object with
        `speculative`, `tree_width` and this class's `decode` (a fixed strategy: itself)."""
        return self

    def on_round(self, step, requests: list, results: list[list[int]], seconds: float | None = None) -> None:
        """A decode step's result rows (one per request) were read; `step` is what `choose` returned for it,
        `seconds` its served time (since the previous decode step's results; None where unknown)."""

    def measure_costs(self) -> None:
        """Time what the per-step choice needs, once the graphs are captured."""

    def stats(self) -> dict | None:
        """The per-step choice's state for /metrics (None: no choice is made)."""
        return None

    def history(self, sampling: SamplingTensors, rows: torch.Tensor, path: torch.Tensor | None = None,
                path_valid: torch.Tensor | None = None) -> TokenHistory | None:
        """What penalties count and bad words match for the requests in `rows` [b] (device), plus per-node `path`
        tokens [n, W] for a tree; None when no request of the batch uses penalties or bad words."""
        if sampling.penalties is None and sampling.bad_words is None:
            return None
        history = (self.runner.penalties.history(rows, path, path_valid) if sampling.penalties is not None
                   else TokenHistory(None, None, path, path_valid))
        if sampling.bad_words is not None:
            history.recent = self.runner.output_tails.recent(rows, sampling.bad_words.width, path, path_valid)
        return history

    def fill_rows(self, rows: list[int]) -> None:
        """Copy the batch's rows into the static input, padded to its graph bucket (skipped when the batch is
        the previous step's: steady decoding then copies nothing)."""
        if rows == self._filled_rows:
            return
        bs = len(rows)
        pad = self.runner.graphs.padded_size(bs)
        self.rows[:bs].copy_(torch.tensor(rows, dtype=torch.int64).to(self.runner.device, non_blocking=True))
        self.prepare_padding(bs, pad)
        self._filled_rows = list(rows)

    def prepare_padding(self, start: int, stop: int) -> None:
        """Rows [start, stop) of the static inputs become padding (the dummy row); also used for capture."""
        self.rows[start:stop] = self.runner.limits.dummy_row
        self._filled_rows = None


class StrategyFactory(Protocol):
    """Builds an engine's strategy from what its runner loaded (speculative/registry.py's `make_strategy`).

    `debug`: the engine's debug checks are on; `adaptive`: the config asks for adaptive speculation. A module-level
    function, so that tensor-parallel workers receive it pickled by name."""

    def __call__(self, runner: ModelRunner, debug: bool = False, adaptive: bool = False) -> DecodeStrategy: ...


class PlainDecoding(DecodeStrategy):
    """One target token per step. The DECODE phase (graph-capturable) runs the target, takes the greedy token
    and advances the rows' state; a batch with sampled requests then re-selects their tokens eagerly. `phase`: its
    graphs' name (adaptive speculation also captures a plain step that keeps the draft current)."""

    def __init__(self, runner: ModelRunner, phase: str = "decode"):
        super().__init__(runner)
        self.phase = phase
        lim = runner.limits
        self.result = torch.zeros(lim.max_running_requests, lim.plain_result_width, dtype=torch.int64,
                                  device=runner.device)  # [R, 2]: accept length 0, then the token

    def decode(self, rows: list[int], max_kv: int, sampling: SamplingTensors,
               logprobs: LogprobPlan | None = None, grammar: GrammarBatch | None = None) -> torch.Tensor:
        r = self.runner
        bs = len(rows)
        self.fill_rows(rows)
        with r.timer.phase("decode"):
            logits, result = r.graphs.run(self.phase, self._decode_phase, bs, max_kv, plan=r.planner(Phase.DECODE))
        if not sampling.all_greedy or grammar is not None:
            with r.timer.phase("sample"):
                rows_t = self.rows[:bs]
                committed, _ = r.row_state.gather(rows_t)  # already advanced past the decoded token
                chosen_from = logits[:bs] if grammar is None else apply_token_mask(logits[:bs],
                                                                                   grammar.row_masks(r.device))
                tokens = select_tokens(chosen_from, sampling, committed,  # [bs] the token at position committed
                                       self.history(sampling, rows_t))
                r.row_state.set(rows_t, committed, tokens)
                result[:bs, 1] = tokens
        if logprobs is not None:
            with r.timer.phase("logprobs"):  # the decode logits of the rows that want them, at their tokens
                idx = torch.tensor(logprobs.rows, dtype=torch.int64).to(r.device, non_blocking=True)
                logprobs.pack = pack_logprobs(logits[idx], result[idx, 1], logprobs.k)
        return result[:bs]

    def _decode_phase(self, P: int, max_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [P, V] and the result [P, 2]; each row's state advances by the greedy token."""
        r = self.runner
        rows = self.rows[:P]
        positions, tokens = r.row_state.gather(rows)
        batch = r.builder.decode(rows, positions, tokens, max_kv)
        hidden = self.target_hidden(batch, P)
        logits = r.target.compute_logits(hidden)  # [P, V]
        greedy = logits.argmax(dim=-1)  # [P]
        r.row_state.set(rows, positions + 1, greedy)
        self.result[:P, 1] = greedy
        return logits, self.result[:P]

    def target_hidden(self, batch, P: int) -> torch.Tensor:
        """The target's hidden [P, H] over the step's batch (inside the DECODE phase); no draft features kept."""
        hidden, _ = self.runner.target_forward(batch, aux=False)
        return hidden

    def capture_graphs(self, show_progress: bool) -> None:
        """Every bucket's decode graph."""
        phases = [(self.phase, self._decode_phase, self.runner.planner(Phase.DECODE))]
        self.runner.graphs.capture(phases, lambda padded: self.prepare_padding(0, padded), "capturing decode graphs",
                                   show_progress)
