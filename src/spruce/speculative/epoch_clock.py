"""What a run of decode steps really costs the engine, everything included: busy wall seconds over an epoch, as a
ratio to what the policy's per-step parts model for the same steps.

Adaptive speculation (speculative/adaptive_policy.py) prices each candidate from parts it can time per step:
device time, launch, resolve, the rest of the host interval. On the H100 with the engine in its own process
(pycode-19m, 128-token requests, 2026-11-23) those parts put EAGLE-3 rounds at concurrency 8 at 0.86 ms for 33
tokens, ~38k tokens/s, while a server running only rounds committed ~10k: most of its time went to prefill
steps. Each prefill is ~7.7 ms of eager launches (the target's, then the draft's extend), rounds end requests at
different steps so each arrival gets a prefill of its own (offline at concurrency 64: 1,693 prefill launches
for 4,096 requests against 192 for plain steps, whose requests end together), and a prefill breaks every
per-step clock. Rather than model that, this clock measures it.

An epoch is a run of decode steps of one choice at one cost bucket: it lasts `target` steps (about one request's
lifetime, so that it holds its share of arrivals and their prefills), or ends early when a step of another
choice or bucket comes (kept if it lasted EPOCH_MIN steps, else dropped: too short to hold an arrival). Its
busy time is the wall time from its first step's launch to the launch after its last step, prefills and the draft's
extends on arriving prompts included, less idle gaps (the engine had nothing to run: `idle`) and less catch-ups
(`exclude` for their launch, `deduct` for their device time once read: a switch's cost, which the policy prices
when it decides a switch). Its figure, those busy seconds over the seconds `modelled` gives its steps (each at its
own batch's cost bucket), goes into a window per (choice, load bucket) with the seconds that ratio makes a step
over a batch of the load's own bucket under the parts of that moment (`seconds`: anchored). `ratio` and `seconds`
are the window's low medians, so two disturbed epochs move nothing once the window holds five (on the H100 about
one plain epoch in ten at concurrency 8 held a ~90 ms stall of the whole process; with three, two of them set the
figure). A step of that choice at that load is priced at `seconds`, whatever its batch (AdaptivePolicy._realized).
Not the ratio times the parts of the moment of pricing: the parts drift (on the H100 a plain step's over 8
requests between 0.54 and 1.17 ms while its epochs measured 0.6-0.7 ms), and the price drifted with them.

An epoch during which the process stalled (`stalls`, a count that grows at each stall: the engine passes Triton's
compilations, ops/compile_watch.py) is dropped: its busy time holds the stall, not the choice's cost. On the H100
(1k shared prefix, 2026-11-23, e2444fb) a kernel compiled at the first prefill of the concurrency-8 level stalled
it ~0.5 s inside the first plain epoch at that load: plain steps' ratio read 7.75 (against 1.0-1.9 in other runs),
priced a plain step at 4.5 ms against 0.6 ms steps, and the level ran rounds for all of its three passes (rounds
commit 1.18 tokens there) at half a plain server's tokens/s: the one figure stood alone in its window, and the
probe that would have re-measured it was priced by it (the excess of 128 steps at 4.5 ms) out of the budget.

Why a ratio and not seconds per step: the bucket is the load's (the largest batch of the last decisions,
AdaptivePolicy._load_bucket), and an epoch's steps run at whatever batch the requests in flight make, smaller while
arrivals wait or a level drains. Per step, an epoch that caught a drain priced each small step as a full batch's,
and two choices measured at different batch mixes were compared as if alike: on the H100 (1k shared prefix,
2026-11-23, commit 420bc7f) the adaptive server's realized plain steps at load 64 read 0.34 ms a step, against 1.55
ms between back-to-back plain steps at batch 64 and 4.08 ms for its rounds there. Per request in a step is biased
the other way where a step's cost is mostly fixed (host-bound: on that H100 a plain step took 0.27 ms at batch 1
and 0.6 ms at 32), as a drain's small steps then cost several times a full step's per request. The modelled
seconds carry each step's own shape, fixed and per-request parts, and the ratio what they miss.
"""

from __future__ import annotations

import collections
import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

log = logging.getLogger("spruce.adaptive.epochs")

EPOCH_MIN = 16  # steps: a shorter run (ended by a step of another choice or bucket) measures nothing
EPOCH_MAX = 512  # steps: the longest epoch, however long requests are
EPOCH_WINDOW = 5  # epochs per (choice, bucket) behind its figure (low median: two disturbed epochs move nothing)
SETTLED_EPOCHS = 3  # epochs behind a figure before it may price its choice out of a probe (AdaptivePolicy._probe_price)


def epoch_steps(target: int) -> int:
    """An epoch's length in steps for a wanted `target` (about one request's life): within EPOCH_MIN..EPOCH_MAX."""
    return max(EPOCH_MIN, min(target, EPOCH_MAX))


class EpochFigure(NamedTuple):
    """What one epoch measured (EpochClock.record)."""

    ratio: float  # busy over modelled seconds
    seconds: float  # that ratio times the parts' seconds of a step at the load's own cost bucket, at its end


@dataclass
class Epoch:
    """The run of decode steps under way."""

    choice: str
    bucket: int  # the load's
    target: int  # steps
    stalls: int = 0  # the clock's stall count when it began
    steps: int = 0
    prefills: int = 0  # prefill launches within it
    busy: float = 0.0  # seconds
    step_buckets: collections.Counter = field(default_factory=collections.Counter)  # steps per own cost bucket

    def add(self, step_bucket: int) -> None:
        """One more step, over a batch of cost bucket `step_bucket`."""
        self.steps += 1
        self.step_buckets[step_bucket] += 1

    @property
    def full(self) -> bool:
        return self.steps >= self.target


class EpochClock:
    """Busy seconds over modelled seconds of each (choice, load bucket), measured over epochs (module docstring).
    `modelled(choice, cost_bucket)`: the seconds the policy's parts give one step of `choice` over a batch of that
    cost bucket; `stalls()`: a count that grows at each stall of the process (default: none). The policy calls
    `event` at every step launch (decode or prefill), `step` for each decode step, `idle` when the engine runs out
    of work."""

    def __init__(self, modelled: Callable[[str, int], float], stalls: Callable[[], int] = lambda: 0):
        self.modelled = modelled
        self.stalls = stalls
        self.dropped = 0  # epochs dropped for a stall
        self.current: Epoch | None = None
        self._last: float | None = None  # the last launch's time; None after an idle gap
        self._excluded = 0.0  # seconds since the last launch that are not busy time of any epoch
        self._windows: dict[tuple[str, int], collections.deque] = {}
        self.epochs = 0  # epochs measured
        self.busy_total = 0.0  # busy seconds of every epoch so far (what a budget of them is a fraction of)

    def event(self, now: float) -> None:
        """A step (decode or prefill) is being launched at `now`: the time since the last launch was busy time
        of the epoch under way."""
        busy = now - self._last - self._excluded if self._last is not None else 0.0
        if busy > 0.0 and self.current is not None:
            self.current.busy += busy
            self.busy_total += busy
        self._last = now
        self._excluded = 0.0

    def standing_step(self, now: float, step_bucket: int) -> None:
        """A decode step that joins the epoch under way is being launched at `now` (AdaptivePolicy.repeat: a standing
        decision's step, which never starts an epoch): `event(now)`, then the epoch counts it."""
        self.event(now)
        self.current.add(step_bucket)

    def prefill(self, now: float) -> None:
        """A prefill is being launched at `now` (an `event` that the epoch under way also counts as a prefill)."""
        self.event(now)
        if self.current is not None:
            self.current.prefills += 1

    def exclude(self, seconds: float) -> None:
        """`seconds` since the last launch (a catch-up before a switch) are not busy time of the epoch."""
        self._excluded += seconds

    def deduct(self, seconds: float) -> None:
        """`seconds` already counted as busy time of the epoch under way were not its (the device work of a
        catch-up, known once its events are read)."""
        if self.current is not None:
            self.current.busy = max(self.current.busy - seconds, 0.0)

    def idle(self) -> None:
        """The engine has nothing to launch: the time until the next launch is not busy time."""
        self._last = None

    def step(self, choice: str, bucket: int, target: int, step_bucket: int) -> None:
        """A decode step of `choice` at load `bucket`, over a batch of cost bucket `step_bucket`, is launched (after
        `event`): it joins the epoch under way, or ends it (another choice or load, or the epoch is full) and
        starts one of `target` steps."""
        cur = self.current
        if cur is None or cur.full or (cur.choice, cur.bucket) != (choice, bucket):
            self._end()
            cur = self.current = Epoch(choice, bucket, epoch_steps(target), self.stalls())
        cur.add(step_bucket)

    def _end(self) -> None:
        cur = self.current
        if cur is None or cur.steps < EPOCH_MIN or cur.busy <= 0:
            return
        if self.stalls() != cur.stalls:
            self.dropped += 1
            log.debug("epoch dropped (stall): %s at load %d, %d steps", cur.choice, cur.bucket, cur.steps)
            return
        modelled = sum(n * self.modelled(cur.choice, b) for b, n in cur.step_buckets.items())
        if modelled <= 0:
            return
        ratio = cur.busy / modelled
        seconds = ratio * self.modelled(cur.choice, cur.bucket)
        log.debug("epoch %s at load %d: %d steps (per cost bucket %s), %d prefills, busy %.6f s, modelled %.6f s, "
                  "ratio %.3f, %.6f s a step at the load", cur.choice, cur.bucket, cur.steps, dict(cur.step_buckets),
                  cur.prefills, cur.busy, modelled, ratio, seconds)
        self.record(cur.choice, cur.bucket, ratio, seconds)
        self.epochs += 1

    def record(self, choice: str, bucket: int, ratio: float, seconds: float) -> None:
        """One epoch's figure for `choice` at load `bucket`: busy over modelled seconds, and the seconds that makes a
        step over a batch of the load's own cost bucket, under the parts of that moment."""
        window = self._windows.setdefault((choice, bucket), collections.deque(maxlen=EPOCH_WINDOW))
        window.append(EpochFigure(ratio, seconds))

    def ratio(self, choice: str, bucket: int) -> float | None:
        """Busy over modelled seconds of `choice` at load `bucket` (low median of its last epochs), None before its
        first."""
        window = self._windows.get((choice, bucket))
        return statistics.median_low(f.ratio for f in window) if window else None

    def seconds(self, choice: str, bucket: int) -> float | None:
        """Realized seconds of a step of `choice` over a batch of the load `bucket`'s own cost bucket (low median of
        its last epochs, each anchored to the parts of its own moment: see the module docstring), None before its
        first."""
        window = self._windows.get((choice, bucket))
        return statistics.median_low(f.seconds for f in window) if window else None

    def count(self, choice: str, bucket: int) -> int:
        """The epochs behind the figure of `choice` at load `bucket` (at most EPOCH_WINDOW)."""
        return len(self._windows.get((choice, bucket), ()))

    def buckets(self, choice: str) -> list[int]:
        """The buckets `choice` has a figure at."""
        return [b for c, b in self._windows if c == choice]

    def table(self, figure: str = "ratio") -> dict[str, dict[int, float]]:
        """{choice: {bucket: figure}} for every (choice, bucket) measured; `figure` "ratio" (busy over modelled
        seconds) or "seconds" (anchored)."""
        read = {"ratio": self.ratio, "seconds": self.seconds}[figure]
        out: dict[str, dict[int, float]] = {}
        for choice, bucket in sorted(self._windows):
            out.setdefault(choice, {})[bucket] = read(choice, bucket)
        return out
