"""What a run of decode steps really costs the engine, everything included: busy wall seconds per request-step over
an epoch, and their ratio to what the policy's per-step parts model for the same steps.

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
when it decides a switch). Its figure is its busy seconds per request-step (each step counts the requests in its
batch): what one request's step of that choice really cost at that load, so `1 / figure` is the tokens per busy
second plain steps committed (rounds: times the tokens a request commits per round). It goes into a window per
(choice, load bucket) with the ratio of the busy seconds to what the policy's parts (`modelled`) give the same steps,
each at its own batch's cost bucket. Both are read as the window's low median, so two disturbed epochs move nothing
once the window holds five (on the H100 about one plain epoch in ten at concurrency 8 held a ~90 ms stall of the
whole process; with three, two of them set the figure). A step over `n` requests of that choice at that load is
priced at `n` times the figure (AdaptivePolicy._realized); the ratio says how far the parts are from it.

Why per request-step: it is what the choice is about (tokens per second), and it holds every cost of a choice's
steady state at a load, those that do not scale with a step's parts included. The serving runs' debug logs (H200
`serving-...-20261123-230915`, H100 `-190652`, 1k shared prefix) show it: the median over epochs of 1 / figure
read 2952 / 13546 / 24758 / 26496 tokens/s for plain steps at concurrency 1 / 8 / 32 / 64 against the plain server's
2908 / 14187 / 26486 / 26470, and for rounds (times their 1.18 tokens) 1522 / 8600 / 16300 / 21200 against the
fixed server's 1423 / 8066 / 15411 / 18316. The figure used until 2026-11-24, the epoch's ratio times the parts of a
step at the load's bucket, read 36571 for plain steps at 64 and 27372 for rounds: it scales a prefill's cost
(additive, per arrival) by the parts, and the requests that end together under plain steps leave a batch of a few
for many steps while their successors arrive (`{32: 54, 1: 73}` steps per cost bucket at load 32), which the parts
model as cheap steps.

A drain is not a load's steady state: requests end and none arrive, so its steps run over ever fewer requests and
cost a full batch's fixed part each. An epoch whose arrivals (prompts its prefills completed) are fewer than half
the requests that ended in it (`first batch + arrivals - last batch`) looks like one. It is judged with the epoch
after it: if that one is of the same choice and load, the two are one epoch (requests that end together, under
plain steps, and their successors, which arrive after a client's round trip: an epoch boundary between the two
makes the first look like a drain and the second like a ramp: on the H200 (c2ece4a, 2026-11-24), which dropped
such epochs, 22 epochs of one concurrency-32 level were dropped and plain steps there read 19.5k tokens/s against
the plain server's 29k); else it is dropped (`drained`). Without that, a
level's drain passed through every smaller load and left its epochs there: on the H200 (`-033247`, 2026-11-24, 1k
shared prefix) plain steps' ratio at load 8 read 0.87 after the first concurrency-8 level and 1.76 after the
concurrency-32 level that followed it, 1.05 after the third concurrency-8 level and 2.15 after the concurrency-64
one (the level's tables also held figures at loads 2, 4, 16, 24, 40 and 48, which no level has), and the fourth
concurrency-8 level, priced by it from its start, ran rounds (1.19 tokens) for 97% of its steps, 40% behind the
plain server. A level's ramp (arrivals, few ended) is kept: it is one epoch per
level, and its prefills are the level's.

Unless the load grew under it: an epoch takes its load bucket when it starts, and the steps of a standing decision
join it whatever their batch (AdaptivePolicy.repeat), so a served level that opens with one request decoding while
the others are still on their way (the load counts the requests the engine holds, and they come a few milliseconds
apart) ran its whole ramp, its prefills of 55-63 arrivals and steps over batches of up to 64, as an epoch at load
1: 250-810 us a request-step against ~300 us for a concurrency-1 level's epochs. Each concurrency-64 level left one
to three such epochs at load 1, and on the H200 (8b04568, 2026-11-25) two levels of them put plain steps' figure
there at 1.18 ms, the next concurrency-1 level switched to rounds (1.16 tokens each) and ran them for all its
requests at 0.72x the plain server's tokens/s. An epoch any of whose steps ran at a cost bucket above its load's
(`Epoch.outgrown`) is dropped (`outgrown`). So is one into which more prompts arrived than its load takes in as many
steps: under plain steps the requests of a concurrency-8 level end together, the engine idles, and the load window
starts over at the first successor (AdaptivePolicy.idle), so the level's decisions alternated between loads 8 and
1, and an epoch at load 1 that ended before the others joined (21-35 steps, 2 arrivals; at a larger level's ramp
70-128 steps and 11-35 arrivals) held their prefills: on the H100 (e3014e6, 2026-11-25, 1k shared prefix) such
epochs read 490-830 us a request-step against ~270 for concurrency 1's and the window at load 1 rose to 577 us;
at ac9b1e4 the adaptive server switched into rounds at load 1 at level openings (plain priced at 670 us there),
and its levels that ran rounds (2-44 catch-ups each) were mostly behind the plain server's.

A choice's epochs from while it was the load's model choice stop pricing it at its first probe's epoch there
after a switch away (`record`): the switch froze them, the host they measured may have moved since, and with
them in the window one fresh epoch is outvoted by the low median. On the H100 (b32202e, 2026-11-26, 128-token
prompts, four bar runs at once on an x4 machine) rounds' window at load 8, five epochs, read 289 us a request-step (the
fixed server's level, ~24k tokens/s at 4.2 tokens a round, implies ~175), plain steps' 52; the concurrency-8 level
switched to plain steps, and each of the two probes of rounds that followed could add one epoch to a window of five
stale ones, whose low median it cannot move: the level ran 9406 plain steps and 127 rounds, 26% behind the fixed
server. A figure of probes' epochs alone must win by PROBED_MARGIN (AdaptivePolicy._margin).

An epoch during which the process stalled (`stalls`, a count that grows at each stall: the engine passes Triton's
compilations, ops/compile_watch.py) is dropped: its busy time holds the stall, not the choice's cost. On the H100
(1k shared prefix, 2026-11-23, e2444fb) a kernel compiled at the first prefill of the concurrency-8 level stalled
it ~0.5 s inside the first plain epoch at that load: plain steps' ratio read 7.75 (against 1.0-1.9 in other runs),
priced a plain step at 4.5 ms against 0.6 ms steps, and the level ran rounds for all of its three passes (rounds
commit 1.18 tokens there) at half a plain server's tokens/s: the one figure stood alone in its window, and the
probe that would have re-measured it was priced by it (the excess of 128 steps at 4.5 ms) out of the budget.
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
    request_seconds: float  # busy seconds per request-step
    probe: bool = False  # a probe's epoch (AdaptivePolicy._explore): the other choice's state, not its own


@dataclass
class Epoch:
    """The run of decode steps under way."""

    choice: str
    bucket: int  # the load's
    target: int  # steps
    stalls: int = 0  # the clock's stall count when it began
    steps: int = 0
    request_steps: int = 0  # the steps' batch sizes, summed
    first_batch: int = 0  # the batch size of its first step
    last_batch: int = 0  # ... and of its latest
    prefills: int = 0  # prefill launches within it
    arrivals: int = 0  # prompts those prefills completed
    busy: float = 0.0  # seconds
    step_buckets: collections.Counter = field(default_factory=collections.Counter)  # steps per own cost bucket
    probe: bool = False  # run by a probe (AdaptivePolicy._explore)

    def add(self, step_bucket: int, batch_size: int) -> None:
        """One more step, over a batch of `batch_size` requests (of cost bucket `step_bucket`)."""
        if not self.steps:
            self.first_batch = batch_size
        self.steps += 1
        self.request_steps += batch_size
        self.last_batch = batch_size
        self.step_buckets[step_bucket] += 1

    def add_many(self, step_bucket: int, batch_sizes: list[int]) -> None:
        """`add(step_bucket, b)` for each b in `batch_sizes` (at least one), in one pass."""
        if not self.steps:
            self.first_batch = batch_sizes[0]
        self.steps += len(batch_sizes)
        self.request_steps += sum(batch_sizes)
        self.last_batch = batch_sizes[-1]
        self.step_buckets[step_bucket] += len(batch_sizes)

    def merged(self, later: Epoch) -> Epoch:
        """This epoch and the `later` one of the same choice and load right after it, as one epoch."""
        return Epoch(self.choice, self.bucket, self.target, self.stalls, self.steps + later.steps,
                     self.request_steps + later.request_steps, self.first_batch, later.last_batch,
                     self.prefills + later.prefills, self.arrivals + later.arrivals, self.busy + later.busy,
                     self.step_buckets + later.step_buckets, self.probe and later.probe)

    @property
    def drained(self) -> bool:
        """Fewer requests arrived than half of those that ended (first batch + arrivals - last batch): a drain."""
        ended = self.first_batch + self.arrivals - self.last_batch
        return 2 * self.arrivals < ended

    @property
    def outgrown(self) -> bool:
        """The load grew under it: some of its steps ran over a batch of a larger cost bucket than its load's, or
        more prompts arrived than its load takes in as many steps (a load of n takes in about n per `target` steps,
        one request's life; twice that and one more are allowed): the requests of a larger load arrived while its
        batch stayed small (module docstring)."""
        return (max(self.step_buckets, default=0) > self.bucket
                or self.arrivals > 2 * self.bucket * self.steps / self.target + 1)

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
        self.drained = 0  # epochs dropped as a drain
        self.outgrown = 0  # epochs dropped as a ramp into a larger load (Epoch.outgrown)
        self.current: Epoch | None = None
        self._pending: Epoch | None = None  # an ended epoch that looked drained, judged with the next one
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

    def standing_step(self, now: float, step_bucket: int, batch_size: int) -> None:
        """A decode step over `batch_size` requests (cost bucket `step_bucket`) that joins the epoch under way is
        being launched at `now` (AdaptivePolicy.repeat: a standing decision's step, which never starts an epoch):
        `event(now)`, then the epoch counts it."""
        self.event(now)
        self.current.add(step_bucket, batch_size)

    def standing_steps(self, times: list[float], step_bucket: int, batches: list[int],
                       prefills: list[tuple[float, int]] = ()) -> None:
        """`standing_step(times[i], step_bucket, batches[i])` for each i and `prefill(t, arrivals)` for each
        (t, arrivals) in `prefills`, in one pass (AdaptivePolicy.stood replays a ticket's steps, all of one cost bucket,
        and the prefills launched among them, with nothing else between them): the busy time from the last launch to the
        first of them, then the span to the last, and the steps and prefills added at once."""
        if not times and not prefills:
            return
        launches = [*times[:1], *times[-1:], *(t for t, _ in prefills[:1]), *(t for t, _ in prefills[-1:])]
        first, last = min(launches), max(launches)
        self.event(first)
        span = last - first
        if span > 0.0 and self.current is not None:
            self.current.busy += span
            self.busy_total += span
        self._last = last
        if times:
            self.current.add_many(step_bucket, batches)
        if prefills and self.current is not None:
            self.current.prefills += len(prefills)
            self.current.arrivals += sum(arrivals for _, arrivals in prefills)

    def prefill(self, now: float, arrivals: int = 0) -> None:
        """A prefill that completes `arrivals` prompts is being launched at `now` (an `event` that the epoch under
        way also counts as a prefill, with its arrivals)."""
        self.event(now)
        if self.current is not None:
            self.current.prefills += 1
            self.current.arrivals += arrivals

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

    def skip(self, busy: float) -> None:
        """Steps this clock was not told of ran for `busy` seconds (AdaptivePolicy.unparked): busy time of no epoch
        but of the total; the epoch under way (and one held as drained) ends unmeasured, its steps not all counted,
        and the next launch starts afresh."""
        self.busy_total += max(busy, 0.0)
        self.current = None
        self._pending = None
        self._last = None
        self._excluded = 0.0

    def step(self, choice: str, bucket: int, target: int, step_bucket: int, batch_size: int,
             probe: bool = False) -> None:
        """A decode step of `choice` at load `bucket`, over a batch of `batch_size` requests (cost bucket
        `step_bucket`), is launched (after `event`): it joins the epoch under way, or ends it (another choice or
        load, or the epoch is full) and starts one of `target` steps (a probe's, if `probe`)."""
        cur = self.current
        if cur is None or cur.full or (cur.choice, cur.bucket) != (choice, bucket):
            self._end()
            cur = self.current = Epoch(choice, bucket, epoch_steps(target), self.stalls(), probe=probe)
        cur.add(step_bucket, batch_size)

    def _end(self) -> None:
        """The epoch under way ends: recorded, dropped, or, if it looks drained, held for the next one (module
        docstring); one held before it is merged into it if of the same choice and load, else dropped."""
        cur, pending, self._pending = self.current, self._pending, None
        if pending is not None:
            if cur is not None and (cur.choice, cur.bucket) == (pending.choice, pending.bucket):
                cur = pending.merged(cur)
            else:
                self.drained += 1
                log.debug("epoch dropped (drained): %s at load %d, %d steps, batch %d to %d, %d arrivals",
                          pending.choice, pending.bucket, pending.steps, pending.first_batch, pending.last_batch,
                          pending.arrivals)
        if cur is None or cur.steps < EPOCH_MIN or cur.busy <= 0:
            return
        if cur.outgrown:
            self.outgrown += 1
            log.debug("epoch dropped (outgrown): %s at load %d, %d steps (per cost bucket %s), batch %d to %d, "
                      "%d arrivals", cur.choice, cur.bucket, cur.steps, dict(cur.step_buckets), cur.first_batch,
                      cur.last_batch, cur.arrivals)
            return
        if self.stalled(cur):
            self.dropped += 1
            log.debug("epoch dropped (stall): %s at load %d, %d steps", cur.choice, cur.bucket, cur.steps)
            return
        modelled = sum(n * self.modelled(cur.choice, b) for b, n in cur.step_buckets.items())
        if modelled <= 0:
            return
        ratio = cur.busy / modelled
        request_seconds = cur.busy / cur.request_steps
        log.debug("epoch %s at load %d: %d steps (per cost bucket %s), %d request-steps, batch %d to %d, %d prefills, "
                  "%d arrivals, busy %.6f s, modelled %.6f s, ratio %.3f, %.3f us a request-step%s", cur.choice,
                  cur.bucket, cur.steps, dict(cur.step_buckets), cur.request_steps, cur.first_batch, cur.last_batch,
                  cur.prefills, cur.arrivals, cur.busy, modelled, ratio, request_seconds * 1e6,
                  " (looks drained: judged with the next)" if cur.drained else "")
        if cur.drained:
            self._pending = cur
            return
        self.record(cur.choice, cur.bucket, ratio, request_seconds, cur.probe)
        self.epochs += 1

    def stalled(self, epoch: Epoch) -> bool:
        """The process stalled during `epoch` (its busy time holds the stall, not its choice's cost)."""
        return self.stalls() != epoch.stalls

    def steady(self, epoch: Epoch) -> bool:
        """`epoch` measures its load's steady state: not a drain, not a ramp into a larger load, no stall in it
        (each of which `_end` holds or drops)."""
        return not epoch.drained and not epoch.outgrown and not self.stalled(epoch)

    def record(self, choice: str, bucket: int, ratio: float, request_seconds: float, probe: bool = False) -> None:
        """One epoch's figure for `choice` at load `bucket`: busy over modelled seconds, and busy seconds per
        request-step (a probe's epoch, if `probe`). A probe's epoch first drops the window's epochs up to its last
        that was not a probe's: those are what `choice` measured while it was the load's model choice, before the
        switch away that the probe now checks, and they price it no longer (module docstring)."""
        window = self._windows.setdefault((choice, bucket), collections.deque(maxlen=EPOCH_WINDOW))
        if probe:
            while any(not f.probe for f in window):
                window.popleft()
        window.append(EpochFigure(ratio, request_seconds, probe))

    def ratio(self, choice: str, bucket: int) -> float | None:
        """Busy over modelled seconds of `choice` at load `bucket` (low median of its last epochs), None before its
        first."""
        window = self._windows.get((choice, bucket))
        return statistics.median_low(f.ratio for f in window) if window else None

    def request_seconds(self, choice: str, bucket: int) -> float | None:
        """Realized busy seconds per request-step of `choice` at load `bucket` (low median of its last epochs), None
        before its first."""
        window = self._windows.get((choice, bucket))
        return statistics.median_low(f.request_seconds for f in window) if window else None

    def count(self, choice: str, bucket: int, probes: bool = True) -> int:
        """The epochs behind the figure of `choice` at load `bucket` (at most EPOCH_WINDOW); not counting probes'
        epochs unless `probes`."""
        window = self._windows.get((choice, bucket), ())
        return len(window) if probes else sum(not f.probe for f in window)

    def buckets(self, choice: str) -> list[int]:
        """The buckets `choice` has a figure at."""
        return [b for c, b in self._windows if c == choice]

    def table(self, figure: str = "ratio") -> dict[str, dict[int, float]]:
        """{choice: {bucket: figure}} for every (choice, bucket) measured; `figure` "ratio" (busy over modelled
        seconds) or "request_seconds" (busy seconds per request-step)."""
        read = {"ratio": self.ratio, "request_seconds": self.request_seconds}[figure]
        out: dict[str, dict[int, float]] = {}
        for choice, bucket in sorted(self._windows):
            out.setdefault(choice, {})[bucket] = read(choice, bucket)
        return out
