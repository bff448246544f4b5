"""A plain decode step for a speculative engine: one target token per request, and the draft kept current.

Adaptive speculation (speculative/adaptive.py) runs this step instead of a round when speculation does not
pay. A plain step commits the token at position p+1 after the last token at p; the draft's cache must then hold
position p as a round's draft extend would have written it (the pair: target feature at p, token at p+1), and
the row's step-0 top-K must come from the draft's output there. This step does exactly that in the same step,
so the draft never lags the target: a round may follow any plain step with nothing to catch up, and a page
released to the prefix cache holds valid draft KV (DESIGN §14) whichever step wrote it.

Two graph-capturable phases, as in a round (DESIGN §9):
  PLAIN_DECODE  gather the rows' state; target forward at p (KV into the pages); logits; greedy token p+1.
  PLAIN_EXTEND  draft forward over (feature at p, token p+1) at p (draft KV into the pages); next step-0
                top-K; the rows' state advances by one.
A batch with sampled requests re-selects their tokens eagerly in between (the same (seed, position) draw as
plain decoding), so the draft reads the committed token, not the greedy one. Both forwards are DECODE batches
(one token per row at p): the draft one is a draft extend over exactly one pair.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spruce.attention.metadata import Phase
from spruce.runtime.grammar import GrammarBatch, apply_token_mask
from spruce.runtime.logprobs import LogprobPlan, pack_logprobs
from spruce.runtime.sampler import SamplingTensors, select_tokens
from spruce.speculative.strategy import DecodeStrategy


@dataclass
class TargetStep:
    """PLAIN_DECODE's output: the target's logits and draft features at each row's last token."""

    logits: torch.Tensor  # [P, V]
    features: torch.Tensor  # [P, F]

    @property
    def batch_rows(self) -> int:
        return self.logits.shape[0]


class DraftTrackingDecoding(DecodeStrategy):
    """Plain decoding through an EAGLE worker's draft: the worker's draft state stays valid after each step.

    Not a strategy of its own (prefill and the draft belong to the worker): `AdaptiveDecoding` runs it."""

    speculative = False

    def __init__(self, worker):
        super().__init__(worker.runner)
        self.worker = worker
        lim, dev = self.runner.limits, self.runner.device
        self.committed = torch.zeros(lim.max_running_requests, dtype=torch.int64, device=dev)  # [R] position p
        self.tokens = torch.zeros(lim.max_running_requests, dtype=torch.int64, device=dev)  # [R] token at p+1
        self.result = torch.zeros(lim.max_running_requests, lim.step_result_width, dtype=torch.int64,
                                  device=dev)  # [R, S+2]: accept length 0, the token, padding

    def decode(self, rows: list[int], max_kv: int, sampling: SamplingTensors,
               logprobs: LogprobPlan | None = None, grammar: GrammarBatch | None = None) -> torch.Tensor:
        """One plain step for `rows` ([bs, S+2] result; `sampling` and `grammar` have one row per request)."""
        r = self.runner
        bs = len(rows)
        self.fill_rows(rows)
        with r.timer.phase("plain_decode"):
            step = r.graphs.run("plain_decode", self._decode_phase, bs, max_kv, plan=r.planner(Phase.DECODE))
        if not sampling.all_greedy or grammar is not None:
            with r.timer.phase("sample"):  # the token at p+1 = committed + 1 under the request's parameters
                chosen_from = step.logits[:bs] if grammar is None else apply_token_mask(step.logits[:bs],
                                                                                        grammar.row_masks(r.device))
                self.tokens[:bs] = select_tokens(chosen_from, sampling, self.committed[:bs] + 1,
                                                 self.history(sampling, self.rows[:bs]))
        if logprobs is not None:
            with r.timer.phase("logprobs"):
                idx = torch.tensor(logprobs.rows, dtype=torch.int64).to(r.device, non_blocking=True)
                logprobs.pack = pack_logprobs(step.logits[idx], self.tokens[idx], logprobs.k)
        with r.timer.phase("plain_extend"):
            out = r.graphs.run("plain_extend", self._extend_phase, bs, max_kv, step, plan=r.planner(Phase.DECODE))
        return out[:bs]

    # --- phases (graph-capturable) -------------------------------------------------------------------------
    def _decode_phase(self, P: int, max_kv: int) -> TargetStep:
        r = self.runner
        rows = self.rows[:P]
        committed, last = r.row_state.gather(rows)
        self.committed[:P] = committed
        hidden, aux = r.target_forward(r.builder.decode(rows, committed, last, max_kv))  # [P, H]
        logits = r.target.compute_logits(hidden)  # [P, V]
        self.tokens[:P] = logits.argmax(dim=-1)
        return TargetStep(logits, r.target_features(hidden, aux))

    def _extend_phase(self, P: int, max_kv: int, step: TargetStep) -> torch.Tensor:
        """Draft over the pair (feature at p, token p+1) at p; next step-0 top-K; rows advance to p+1."""
        r = self.runner
        rows, committed, tokens = self.rows[:P], self.committed[:P], self.tokens[:P]
        h = r.draft_forward(r.builder.decode(rows, committed, tokens, max_kv), step.features)  # [P, Hd]
        self.worker.store_step0(rows, h)
        r.row_state.set(rows, committed + 1, tokens)
        self.result[:P, 1] = tokens
        return self.result[:P]

    def capture_graphs(self, show_progress: bool) -> None:
        plan = self.runner.planner(Phase.DECODE)
        self.runner.graphs.capture([("plain_decode", self._decode_phase, plan), ("plain_extend", self._extend_phase,
                                                                                 plan)],
                                   lambda p: self.prepare_padding(0, p), "capturing plain decode graphs",
                                   show_progress)
