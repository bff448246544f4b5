"""Adaptive speculation (`speculative_adaptive`, issue 16): before every decode step, run the configured EAGLE
round or a plain step, whichever the cost model expects to commit more tokens per second for this batch.

Pieces:
- the EAGLE worker (the configured (S, K, N) round) and `DraftTrackingDecoding` (a plain step that keeps the
  draft current, so switching either way costs nothing and changes no token: speculative/draft_tracking.py);
  both read and advance the same device row state and share the KV pools;
- `AdaptivePolicy` (speculative/adaptive_policy.py): the rule, the acceptance EMAs and the host-time clock;
- the device time table it needs, measured here at start-up (`measure_costs`): every cost bucket
  (Limits.cost_buckets), each candidate's decode step run over padding rows (the dummy row) and timed, the
  median of a few runs. Graph buckets replay their captured graphs; larger batches run eagerly, as they will
  when serving. On CUDA the time is the device's (events around the call); on the CPU it is the call's wall
  time, which is the device work there. Padding rows attend to no cached token, so the table leaves out
  attention over the context: a long context costs both candidates more (a tree more, N tokens per request
  read it), and the online host term does not see that. What it measures is what the engine replays.

Losslessness: a committed token is the target's choice at its position whichever candidate ran (greedy:
the argmax; sampled: the draw keyed by (seed, position), DESIGN §9), so adaptive output equals plain output.
"""

from __future__ import annotations

import statistics
import time

import torch

from spruce.runtime.grammar import GrammarBatch
from spruce.runtime.logprobs import LogprobPlan
from spruce.runtime.sampler import SamplingTensors
from spruce.speculative.adaptive_policy import PLAIN, SPECULATIVE, AdaptivePolicy, Decision
from spruce.speculative.draft_tracking import DraftTrackingDecoding
from spruce.speculative.strategy import DecodeStrategy, PrefillChunk

WARMUP_RUNS = 2
TIMED_RUNS = 5


class AdaptiveDecoding(DecodeStrategy):
    """Runs the worker's rounds or draft-tracking plain steps, as `AdaptivePolicy` decides per step."""

    speculative = True

    def __init__(self, worker):
        super().__init__(worker.runner)
        self.worker = worker
        self.plain = DraftTrackingDecoding(worker)
        self.policy: AdaptivePolicy | None = None  # made by measure_costs (after graph capture)
        self.last_decision: Decision | None = None

    # --- the interface ---------------------------------------------------------------------------------------
    def prefill(self, chunks: list[PrefillChunk], sampling: SamplingTensors,
                logprobs: LogprobPlan | None = None, grammar: GrammarBatch | None = None) -> torch.Tensor:
        if self.policy is not None:
            self.policy.break_chain()  # the time until the next decode launch is not a decode step's
        return self.worker.prefill(chunks, sampling, logprobs, grammar)

    def decode(self, rows: list[int], max_kv: int, sampling: SamplingTensors,
               logprobs: LogprobPlan | None = None, grammar: GrammarBatch | None = None) -> torch.Tensor:
        raise TypeError("AdaptiveDecoding runs no step itself: the engine asks choose(requests) which strategy "
                        "runs the step")

    def choose(self, requests: list) -> DecodeStrategy:
        """The strategy that runs the next decode step over `requests`: the worker (a round) or the plain step."""
        self.last_decision = self.policy.decide(requests)
        return self.worker if self.last_decision.choice == SPECULATIVE else self.plain

    def resolved(self, requests: list, results: list[list[int]], speculated: bool, waited_s: float) -> None:
        """A step's results were read after waiting `waited_s` on the device: feed the policy."""
        self.policy.waited(waited_s)
        if speculated:
            for q, row in zip(requests, results):
                if not q.finished:
                    self.policy.accepted(q, row[0])

    def capture_graphs(self, show_progress: bool) -> None:
        self.worker.capture_graphs(show_progress)
        self.plain.capture_graphs(show_progress)

    def measure_costs(self) -> None:
        """Time each candidate's step per cost bucket and build the policy (see the module docstring)."""
        r, lim = self.runner, self.runner.limits
        cuda = r.device.type == "cuda"
        device_seconds = {}
        for b in lim.cost_buckets:
            for choice, strategy in ((PLAIN, self.plain), (SPECULATIVE, self.worker)):
                device_seconds[(choice, b)] = _time_step(strategy, [lim.dummy_row] * b, lim.page_size, cuda)
        self.policy = AdaptivePolicy(lim.cost_buckets, device_seconds, overlapped=cuda and lim.overlap,
                                     device_on_host=not cuda, max_accept=lim.num_steps)

    def stats(self) -> dict | None:
        return None if self.policy is None else self.policy.snapshot()


def _time_step(strategy: DecodeStrategy, rows: list[int], max_kv: int, cuda: bool) -> float:
    """Median seconds of one greedy decode step over `rows` (padding rows): device time on CUDA (events),
    wall time on the CPU."""
    greedy = SamplingTensors.greedy()
    for _ in range(WARMUP_RUNS):
        strategy.decode(rows, max_kv, greedy)
    times = []
    for _ in range(TIMED_RUNS):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            strategy.decode(rows, max_kv, greedy)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            strategy.decode(rows, max_kv, greedy)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
