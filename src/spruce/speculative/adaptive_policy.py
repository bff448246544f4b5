"""The choice adaptive speculation makes before each decode step: a speculative round or a plain step.

Rule: pick the candidate with the most expected committed tokens per second for this batch,

    tokens/s(c) = bs * E[tokens per step | c] / t(c, bucket)

- E[tokens | plain] = 1. E[tokens | speculative] = the mean over the batch's requests of 1 + a_i, where a_i is
  request i's running mean of accepted drafts per round (an exponential moving average, EMA). A request without
  rounds of its own takes the engine-wide EMA; before any round at all, the tree depth S (optimistic, so the
  first rounds measure it). A request whose acceptance collapsed thus counts ~1 token in both candidates: it
  neither forces the batch to plain nor makes speculation look better than it is for the others.
- t(c, b) = D(c, b) (+) H(c, b): D is the device time of one step of c over a batch of bucket b, measured at
  start-up (speculative/adaptive.py); H is the host's time per step around it (scheduling, launching, reading
  results, detokenizing, serving), measured online as (time between consecutive decode launches) - (time the
  host waited on the device) [- D, on the CPU, where the device work is host time]. A choice not yet run at a
  bucket borrows the other's H. (+) is max when the host and the device overlap (CUDA with overlap
  scheduling), + otherwise. The host term is what makes the model right for small models, whose steps are
  host-bound: a plain step then costs as much wall time as a round that commits several tokens.
- While plain steps run, no acceptance is measured, so the estimates could stay stale forever: after a run of
  `probe_after` plain choices at a bucket the next step speculates once ("probe"); a probe that does not change
  the choice doubles that interval (16 .. 1024), a model choice of speculation resets it.
- Ties go to plain (the cheaper step).

Pure Python and torch-free: the unit tests feed it numbers.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

PLAIN, SPECULATIVE = "plain", "speculative"
CHOICES = (PLAIN, SPECULATIVE)
REQUEST_ALPHA = 0.5  # per-request acceptance EMA: reacts within a few rounds when a request's text changes
GLOBAL_ALPHA = 0.05  # engine-wide acceptance EMA (the prior of requests without rounds)
HOST_ALPHA = 0.1  # host time per step EMA
OUTLIER_FACTOR = 8.0  # a period sample this many times the EMA is an idle gap, not a step: ignored
PROBE_FIRST, PROBE_MAX = 16, 1024


@dataclass
class Decision:
    """One step's choice and its reason: each candidate's expected tokens per step and seconds per step."""

    bucket: int
    batch_size: int
    choice: str  # PLAIN or SPECULATIVE
    reason: str  # "model" (the higher expected tokens/s) or "probe" (re-measuring acceptance after plain steps)
    tokens_per_step: dict[str, float]  # per request: 1 (plain), mean 1 + a_i (speculative)
    step_seconds: dict[str, float]  # t(c, bucket)

    def tokens_per_second(self, choice: str) -> float:
        t = self.step_seconds[choice]
        return self.batch_size * self.tokens_per_step[choice] / t if t > 0 else float("inf")

    def as_dict(self) -> dict:
        return {"choice": self.choice, "reason": self.reason, "batch_size": self.batch_size,
                "tokens_per_step": dict(self.tokens_per_step), "step_seconds": dict(self.step_seconds),
                "tokens_per_second": {c: self.tokens_per_second(c) for c in CHOICES}}


@dataclass
class _BucketState:
    probe_after: int = PROBE_FIRST
    plain_streak: int = 0
    last: Decision | None = None


@dataclass
class AdaptivePolicy:
    """Chooses plain or speculative per decode step; fed by the engine through the strategy's hooks.

    buckets: the cost buckets (Limits.cost_buckets); device_seconds: {(choice, bucket): D} for every pair;
    overlapped: host and device run concurrently (max) rather than one after the other (+); device_on_host:
    the device work is the host's own time (CPU), so it is taken out of the measured host time;
    max_accept: S (the optimistic prior); clock: seconds (tests pass a fake one)."""

    buckets: tuple[int, ...]
    device_seconds: dict[tuple[str, int], float]
    overlapped: bool
    device_on_host: bool
    max_accept: int
    clock: Callable[[], float] = time.perf_counter
    host_seconds: dict[tuple[str, int], float] = field(default_factory=dict)
    global_accept: float | None = None
    chosen: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CHOICES, 0))
    probes: int = 0

    def __post_init__(self):
        missing = [(c, b) for c in CHOICES for b in self.buckets if (c, b) not in self.device_seconds]
        if missing:
            raise ValueError(f"device_seconds lacks {missing} (buckets {self.buckets})")
        self._accept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # request -> its acceptance EMA
        self._state = {b: _BucketState() for b in self.buckets}
        self._last_launch: tuple[float, str, int] | None = None  # (time, choice, bucket) of the last decode launch
        self._waited = 0.0  # seconds the host waited on the device since then

    # --- the choice ---------------------------------------------------------------------------------------------
    def bucket_for(self, batch_size: int) -> int:
        for b in self.buckets:
            if b >= batch_size:
                return b
        raise ValueError(f"batch size {batch_size} exceeds the largest cost bucket {self.buckets[-1]}")

    def expected_accept(self, request) -> float:
        """Request's expected accepted drafts per round: its EMA, else the engine's, else S."""
        own = self._accept.get(request)
        if own is not None:
            return own
        return self.global_accept if self.global_accept is not None else float(self.max_accept)

    def step_seconds(self, choice: str, bucket: int) -> float:
        """t(choice, bucket) = D (+) H; H borrowed from the other choice until this one has run here."""
        d = self.device_seconds[(choice, bucket)]
        other = SPECULATIVE if choice == PLAIN else PLAIN
        h = self.host_seconds.get((choice, bucket), self.host_seconds.get((other, bucket), 0.0))
        return max(d, h) if self.overlapped else d + h

    def decide(self, requests: list) -> Decision:
        """The choice for a decode step over `requests` (also marks the step's launch for the host clock)."""
        bs = len(requests)
        bucket = self.bucket_for(bs)
        spec_tokens = sum(1.0 + self.expected_accept(q) for q in requests) / bs
        d = Decision(bucket, bs, PLAIN, "model", {PLAIN: 1.0, SPECULATIVE: spec_tokens},
                     {c: self.step_seconds(c, bucket) for c in CHOICES})
        st = self._state[bucket]
        if d.tokens_per_second(SPECULATIVE) > d.tokens_per_second(PLAIN):
            d.choice = SPECULATIVE
            st.plain_streak, st.probe_after = 0, PROBE_FIRST
        else:
            st.plain_streak += 1
            if st.plain_streak > st.probe_after:
                d.choice, d.reason = SPECULATIVE, "probe"
                st.plain_streak, st.probe_after = 0, min(2 * st.probe_after, PROBE_MAX)
                self.probes += 1
        st.last = d
        self.chosen[d.choice] += 1
        self._launched(d.choice, bucket)
        return d

    # --- what the engine reports back ------------------------------------------------------------------------------
    def _launched(self, choice: str, bucket: int) -> None:
        """A decode step is being launched: the time since the previous one (if it was a decode step, with no
        prefill between) minus the host's waits is one host-time sample of the previous step's choice."""
        now = self.clock()
        if self._last_launch is not None:
            t0, prev_choice, prev_bucket = self._last_launch
            host = now - t0 - self._waited
            if self.device_on_host:
                host -= self.device_seconds[(prev_choice, prev_bucket)]
            self._add_host_sample(prev_choice, prev_bucket, max(host, 0.0))
        self._last_launch = (now, choice, bucket)
        self._waited = 0.0

    def _add_host_sample(self, choice: str, bucket: int, seconds: float) -> None:
        key = (choice, bucket)
        old = self.host_seconds.get(key)
        if old is None:
            self.host_seconds[key] = seconds
        elif seconds <= OUTLIER_FACTOR * max(old, 1e-6):
            self.host_seconds[key] = old + HOST_ALPHA * (seconds - old)

    def break_chain(self) -> None:
        """A non-decode step (prefill) or an idle gap: the next decode launch starts a new measurement."""
        self._last_launch = None
        self._waited = 0.0

    def waited(self, seconds: float) -> None:
        """The host blocked this long on the device (reading a step's results)."""
        self._waited += seconds

    def accepted(self, request, drafts: int) -> None:
        """A speculative round of `request` accepted `drafts` draft tokens."""
        own = self._accept.get(request)
        self._accept[request] = float(drafts) if own is None else own + REQUEST_ALPHA * (drafts - own)
        g = self.global_accept
        self.global_accept = float(drafts) if g is None else g + GLOBAL_ALPHA * (drafts - g)

    # --- reporting ----------------------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """What /metrics shows: per bucket the last decision and its reason, the cost table, the counts."""
        def per_choice(table: dict) -> dict:
            return {c: {b: v for (c2, b), v in table.items() if c2 == c} for c in CHOICES}

        return {
            "buckets": {b: st.last.as_dict() for b, st in self._state.items() if st.last is not None},
            "device_seconds": per_choice(self.device_seconds), "host_seconds": per_choice(self.host_seconds),
            "chosen": dict(self.chosen), "probes": self.probes, "global_accept": self.global_accept,
        }
