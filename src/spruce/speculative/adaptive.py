"""Adaptive speculation (`speculative_adaptive`): before every decode step, a plain step or an EAGLE round at one of
the verify widths (the configured N, or a narrower one of `speculative_adaptive_widths`), whichever is expected to
commit the most tokens per second for the batch.

Two hooks on the decode step (DecodeStrategy): `choose(requests)` before it returns what runs the step, and
`on_round(step, requests, results)` after it reads the step's accept lengths. `AdaptivePolicy` holds the rule:

- costs: seconds of one step of each candidate per batch-size bucket (Limits.cost_buckets; plain: a plain engine's
  step, with no draft work), measured once at start-up over padding rows (captured graphs where the bucket has them,
  else eager; on a GPU, steps queued back to back: the slower of host and device work, as under overlap), the median
  of TIMED_RUNS runs. Padding rows attend to nothing, so served steps cost more (at Llama-3.1-8B on an H200, batch
  16, ~300 positions each: a plain step 7% more, a round 20%): served, each step's seconds (from the previous decode
  step's results to its own) move its entry by COST_WEIGHT; a figure above COST_OUTLIER times the entry counts as
  that much (a step held up by something else moves an entry by at most 25%, and a table several times too low,
  as at long contexts, still converges). Under tensor parallelism the ranks' clocks differ: every rank keeps rank 0's
  start-up table, unmoved (below).
- acceptance: an engine-wide EMA per verify width of the drafts a round accepts per request (a round's result row
  also says what each narrower width would have accepted: speculative/tree.py `accepted_within`), weighted per
  request round (SAMPLE_WEIGHT): a round over 64 requests moves it as far as 64 rounds over one, so that at batch 1,
  where one round accepts 0 or 1 drafts at acceptance 0.5, it does not swing across break-even (while it has read
  few, it is their plain mean). Until a width's EMA has read MEASURED_AFTER request rounds, the choice takes it to
  accept S. (At acceptance 0.5 a mean of 64 rounds is within 0.125 of it 95% of the time; an EMA of weight 1/256
  within 0.03.)
- collapse: a request whose mean accepted drafts over its rounds, plus CONFIDENCE_Z standard errors, is below
  COLLAPSE_MARGIN times `collapse_below` (the fewest accepted drafts at which some round, at some bucket, beats a
  plain step) after COLLAPSE_ROUNDS rounds has collapsed: it runs plainly to its end. (The mean with a margin and
  its error, not a fast EMA: at acceptance 0.5 a request's rounds accept 0 or 1 drafts, and an EMA of weight 0.3
  falls from 0.5 to 0.25 after two zeros in a row, which most requests see in 128 tokens; a bare mean of 16 such
  rounds is below 0.18 for 0.2% of requests at round 16 and for a few percent at some round after it. A request
  whose drafts are never accepted has no error: it collapses at round COLLAPSE_ROUNDS.)
- choice per bucket: plain commits 1 token per request, a round at width w 1 + EMA(w) per request that has not
  collapsed (1 for the others); the candidate with the most tokens per second wins, but a bucket leaves its current
  candidate only for one HYSTERESIS times faster. While a bucket's choice is not a round at N, every PROBE_EVERY-th
  step there is one, so that every width's EMA keeps moving. A width counts as accepting its EMA plus CONFIDENCE_Z
  standard errors of it (the EMA's variance over the request rounds it reads, min(read, 2 / SAMPLE_WEIGHT - 1) of
  them): a bucket whose choice is plain learns only from its probes, so a first estimate that chance put below
  break-even would hold it there for hundreds of steps at batch 1; the benefit of the doubt goes to speculation,
  and shrinks to 0.044 accepted drafts (acceptance 0.5) as the EMA settles.
- catch-up: a plain step leaves its requests' drafts behind (`stale`). A round wanted over a batch with a stale
  request not collapsed runs a drafted plain step first (CATCH_UP), which puts every draft at its position, and the
  round (a probe stays due) at the next step. So a bucket whose choice is plain pays for no draft work but one step
  per probe. (Served at Llama-3.1-8B on an H200 at acceptance 1.5, plain steps that all extended the draft took
  10-14% longer than a plain server's at batch 16 and 64, more than the bar's 5% allows.)

Under tensor parallelism nothing reads a clock after start-up: the choice is a function of rank 0's start-up cost
table and the accept lengths, which every rank computes alike, so every rank makes rank 0's choice.

Draft KV: a catch-up step runs the target and then the draft's extend over the token it committed (the target's
feature at p with the token at p + 1: a round's extend with nothing accepted), so the round after it starts from the
draft's state at the right position. The draft KV of the positions that plain steps committed stays unwritten, and a
collapsed request's draft falls behind for good; such a draft proposes worse tokens, never wrong ones, and the pages
filled meanwhile enter the prefix cache with stale draft KV, which can only lower a later request's acceptance
there. Whatever runs, a committed token is the target's choice at its position (greedy: the argmax; sampled: the
draw keyed by (seed, position)), so the output equals plain decoding's.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import Counter
from dataclasses import dataclass

import torch

from spruce.attention.metadata import Phase
from spruce.runtime.sampler import SamplingTensors
from spruce.runtime.strategy import DecodeStrategy, PlainDecoding
from spruce.speculative.eagle_worker import EagleWorker

PLAIN = 0  # the plain candidate; every other candidate is a verify width
CATCH_UP = -1  # not a candidate: a plain step with the draft's extend, run before a round over stale drafts
SAMPLE_WEIGHT = 1 / 256  # one request's round's weight in the engine-wide acceptance EMA (a round of n: 1 - (1 - w)^n)
MEASURED_AFTER = 64  # request rounds a width's EMA reads before the choice uses it (until then: S accepted)
COST_WEIGHT = 1 / 8  # one served step's weight in its cost entry
COST_OUTLIER = 3.0  # a served step slower than this times its entry is read as this times it
HYSTERESIS = 1.05  # a bucket changes candidate only for one expected this much faster
PROBE_EVERY = 64  # steps of a bucket whose choice is not N, per round at N there
CONFIDENCE_Z = 2.0  # the choice takes a width to accept its EMA plus this many standard errors
COLLAPSE_ROUNDS = 16  # rounds a request runs before its mean may collapse it ...
COLLAPSE_MARGIN = 0.5  # ... below this part of collapse_below (a request at break-even rarely collapses by chance)
WARMUP_RUNS, TIMED_RUNS, TIMED_STEPS = 1, 3, 4  # start-up timing of each candidate's step (TIMED_STEPS: on CUDA)

log = logging.getLogger(__name__)


@dataclass
class RequestAcceptance:
    """One request's record (`Request.accept_state`): its rounds, the drafts they accepted, collapsed, and stale
    (its last step was a plain one: its draft is behind)."""

    rounds: int = 0
    accepted: int = 0
    squares: int = 0  # the sum of the squares of its rounds' accepted drafts
    collapsed: bool = False
    stale: bool = False

    def upper_mean(self) -> float:
        """Its rounds' mean accepted drafts plus CONFIDENCE_Z standard errors."""
        return upper_bound(self.accepted / self.rounds, self.squares / self.rounds, self.rounds)


def upper_bound(mean: float, mean_square: float, count: float) -> float:
    """`mean` plus CONFIDENCE_Z standard errors of a mean of `count` samples whose squares average `mean_square`."""
    return mean + CONFIDENCE_Z * (max(mean_square - mean * mean, 0.0) / count) ** 0.5


class AdaptivePolicy:
    """The rule (module docstring), on numbers only: `costs[(candidate, bucket)]` seconds per step, `widths` the
    verify widths ascending (N last), `max_accept` S (what an unmeasured width is assumed to accept)."""

    def __init__(self, costs: dict[tuple[int, int], float], widths: tuple[int, ...], max_accept: int):
        self.costs = costs
        self.widths = widths
        self.candidates = (PLAIN, *widths)
        self.max_accept = max_accept
        self.measured_after = MEASURED_AFTER
        self.ema: dict[int, float] = {}  # width -> drafts a round accepts per request (unset until measured)
        self.square: dict[int, float] = {}  # width -> the same EMA of their square
        self.samples: Counter = Counter()  # width -> request rounds its EMA read
        self.current: dict[int, int] = {}  # bucket -> its candidate (N until the first switch)
        self.since_n: Counter = Counter()  # bucket -> its steps since its last round at N
        self.chosen: Counter = Counter()  # candidate -> steps (a catch-up counts as plain)
        self.probes = 0
        self.catch_ups = 0
        self.collapsed = 0  # requests collapsed so far ...
        self.collapsed_steps = 0  # ... and plain engine's steps over batches of collapsed requests only
        buckets = {b for _, b in costs}
        self.collapse_below = min(costs[(w, b)] / costs[(PLAIN, b)] - 1.0 for w in widths for b in buckets)

    def expected_tokens(self, candidate: int, healthy: int, total: int) -> float:
        """Tokens a step of `candidate` commits over `total` requests, `healthy` of them not collapsed."""
        if candidate == PLAIN:
            return float(total)
        if self.samples[candidate] < self.measured_after:
            return total + healthy * float(self.max_accept)
        read = min(self.samples[candidate], 2 / SAMPLE_WEIGHT - 1)  # the EMA's effective sample count
        return total + healthy * upper_bound(self.ema[candidate], self.square[candidate], read)

    def choose(self, bucket: int, healthy: int, total: int, drafts_current: bool = True) -> int:
        """What runs a step over `total` requests (`healthy` not collapsed, at least one) at cost `bucket`: a
        candidate, or CATCH_UP where a round is due but some healthy request's draft is behind (not
        `drafts_current`)."""
        current = self.current.get(bucket, self.widths[-1])
        speed = {c: self.expected_tokens(c, healthy, total) / self.costs[(c, bucket)] for c in self.candidates}
        best = max(self.candidates, key=speed.__getitem__)
        if best != current and speed[best] > HYSTERESIS * speed[current]:
            log.info("adaptive speculation: batch bucket %d now runs %s (expected tokens/s: %s)", bucket,
                     _name(best), ", ".join(f"{_name(c)} {s:.0f}" for c, s in speed.items()))
            current = self.current[bucket] = best
        n = self.widths[-1]
        if current != n and self.since_n[bucket] >= PROBE_EVERY - 1:
            current = n
            self.probes += 1
        if current != PLAIN and not drafts_current:
            self.probes -= current == n and self.current.get(bucket, n) != n  # still due: the next step runs it
            current = CATCH_UP
            self.catch_ups += 1
        self.since_n[bucket] = 0 if current == n else self.since_n[bucket] + 1
        self.chosen[max(current, PLAIN)] += 1
        return current

    def on_round(self, width: int, accepted: list[list[int]], states: list[RequestAcceptance]) -> None:
        """A round at `width` resolved: accepted[i] are request i's accepted drafts at each width up to `width`
        (ascending, `width`'s last), states[i] its record. The engine-wide EMAs read the requests not collapsed."""
        healthy = [(row, s) for row, s in zip(accepted, states) if not s.collapsed]
        n = len(healthy)
        for j, w in enumerate(self.widths[:len(accepted[0]) if accepted else 0]):
            if healthy:
                mean = sum(row[j] for row, _ in healthy) / n
                self.samples[w] += n
                weight = max(1 - (1 - SAMPLE_WEIGHT) ** n, n / self.samples[w])  # the plain mean while few
                self.ema[w] = self.ema.get(w, 0.0) + weight * (mean - self.ema.get(w, 0.0))
                square = sum(row[j] * row[j] for row, _ in healthy) / n
                self.square[w] = self.square.get(w, 0.0) + weight * (square - self.square.get(w, 0.0))
        for row, s in healthy:
            s.rounds += 1
            s.accepted += row[-1]
            s.squares += row[-1] * row[-1]
            if s.rounds >= COLLAPSE_ROUNDS and s.upper_mean() < COLLAPSE_MARGIN * self.collapse_below:
                s.collapsed = True
                self.collapsed += 1

    def on_cost(self, candidate: int, bucket: int, seconds: float) -> None:
        """A step of `candidate` at `bucket` took `seconds` served."""
        entry = self.costs[(candidate, bucket)]
        self.costs[(candidate, bucket)] = entry + COST_WEIGHT * (min(seconds, COST_OUTLIER * entry) - entry)

    def snapshot(self) -> dict:
        """What /metrics shows."""
        return {"choice": dict(sorted(self.current.items())), "accept_ema": dict(sorted(self.ema.items())),
                "chosen": dict(self.chosen), "probes": self.probes, "catch_ups": self.catch_ups,
                "collapsed_requests": self.collapsed,
                "collapsed_steps": self.collapsed_steps,
                "collapse_below": self.collapse_below,
                "step_seconds": {f"{c}@{b}": s for (c, b), s in sorted(self.costs.items())}}


class DraftedPlain(PlainDecoding):
    """A plain step that keeps the draft current: the target's step (its graph keeps the target's draft features),
    the tokens (sampled ones eagerly), then the draft's extend over them (a round's extend with nothing accepted)."""

    def __init__(self, worker: EagleWorker):
        super().__init__(worker.runner, phase="decode_drafted")
        r, lim = worker.runner, worker.runner.limits
        self.worker = worker
        self.stride = lim.draft_extend_stride
        i64 = dict(dtype=torch.int64, device=r.device)
        self.features = torch.zeros(lim.max_running_requests, self.stride, r.draft.feature_width_first_step,
                                    dtype=r.dtype, device=r.device)  # [R, S+1, F]: column 0 is the step's
        self.tokens = torch.zeros(lim.max_running_requests, self.stride, **i64)  # [R, S+1]: column 0 is the step's
        self.ones = torch.ones(lim.max_running_requests, **i64)  # [R]: one pair a row

    def target_hidden(self, batch, P: int) -> torch.Tensor:
        if not self.features.shape[-1]:  # a draft that reads no target features (a draft LM)
            return super().target_hidden(batch, P)
        hidden, aux = self.runner.target_forward(batch)
        self.features[:P, 0] = self.runner.target_features(hidden, aux)
        return hidden

    def decode(self, rows, max_kv, sampling, logprobs=None, grammar=None) -> torch.Tensor:
        result = super().decode(rows, max_kv, sampling, logprobs, grammar)
        r = self.runner
        with r.timer.phase("extend"):
            r.graphs.run("extend_plain", self._extend_phase, len(rows), max_kv, plan=r.planner(Phase.DRAFT_EXTEND))
        return result

    def _extend_phase(self, P: int, max_kv: int) -> None:
        """Pair (feature at p, token at p + 1) at each row's position p = committed - 1 (the rows' state is past
        the step's token; a draft LM, Limits.draft_ahead: the token at its own position, committed); the row's
        step-0 top-K from it."""
        r, rows = self.runner, self.rows[:P]
        committed, token = r.row_state.gather(rows)  # [P] each (padding rows: 0, 0)
        self.tokens[:P, 0] = token
        start = (committed - 1 + r.limits.draft_ahead).clamp(min=0)
        ext = r.builder.draft_extend(rows, start, self.ones[:P], self.tokens[:P], max_kv)
        h = r.draft_forward(ext, self.features[:P].reshape(P * self.stride, self.features.shape[-1]))
        self.worker.store_step0(rows, h.view(P, self.stride, h.shape[-1])[:, 0])  # h: [P*(S+1), Hd]

    def capture_graphs(self, show_progress: bool) -> None:
        r = self.runner
        for phase in ((self.phase, self._decode_phase, r.planner(Phase.DECODE)),
                      ("extend_plain", self._extend_phase, r.planner(Phase.DRAFT_EXTEND))):
            r.graphs.capture([phase], lambda p: self.prepare_padding(0, p), f"capturing {phase[0]} graphs",
                             show_progress)


class AdaptiveDecoding(DecodeStrategy):
    """Runs what `AdaptivePolicy` chooses per step: a plain step (`DraftedPlain`, or a plain engine's step when every
    request has collapsed) or the worker's round at a verify width."""

    speculative = True

    def __init__(self, worker: EagleWorker):
        super().__init__(worker.runner)
        self.worker = worker
        self.plain = PlainDecoding(worker.runner)
        self.drafted_plain = DraftedPlain(worker)
        self.launchers = {PLAIN: self.plain, **{w: worker.narrow(w) for w in worker.runner.limits.tree_widths}}
        lim = worker.runner.limits
        self.candidate_of = {id(launcher): c for c, launcher in self.launchers.items()}
        self.columns = {w: 1 + lim.step_advance + i for i, w in enumerate(lim.narrower_widths)}  # result columns
        self.policy: AdaptivePolicy | None = None  # made by measure_costs

    def prefill(self, *args, **kwargs) -> torch.Tensor:
        return self.worker.prefill(*args, **kwargs)

    def warm_eager(self) -> None:
        self.worker.warm_eager()

    def capture_graphs(self, show_progress: bool) -> None:
        self.plain.capture_graphs(show_progress)
        self.drafted_plain.capture_graphs(show_progress)
        self.worker.capture_graphs(show_progress)

    def measure_costs(self) -> None:
        """Time every candidate's step at every cost bucket (rank 0's figures under tensor parallelism)."""
        r, lim = self.runner, self.runner.limits
        cuda = r.device.type == "cuda"
        costs = {(c, b): _time_step(launcher, [lim.dummy_row] * b, lim.page_size, cuda)
                 for b in lim.cost_buckets for c, launcher in self.launchers.items()}
        self.policy = AdaptivePolicy(_rank0_table(r.tp, costs), lim.tree_widths, lim.num_steps)

    def choose(self, requests: list):
        states = [_acceptance(q) for q in requests]
        healthy = [s for s in states if not s.collapsed]
        if not healthy:
            self.policy.collapsed_steps += 1
            choice = PLAIN
        else:
            bucket = self.runner.limits.cost_bucket_for(len(requests))
            choice = self.policy.choose(bucket, len(healthy), len(requests), not any(s.stale for s in healthy))
        for s in states:
            s.stale = choice == PLAIN
        return self.drafted_plain if choice == CATCH_UP else self.launchers[choice]

    def on_round(self, step, requests: list, results: list[list[int]], seconds: float | None = None) -> None:
        candidate = self.candidate_of.get(id(step))  # None: a catch-up step (no entry of its own)
        if seconds is not None and candidate is not None and self.runner.tp is None and requests:
            self.policy.on_cost(candidate, self.runner.limits.cost_bucket_for(len(requests)), seconds)
        if not step.speculative:
            return
        width = step.tree_width
        narrower = [self.columns[w] for w in self.runner.limits.narrower_widths if w < width]
        accepted = [[row[c] for c in narrower] + [row[0]] for row in results]
        self.policy.on_round(width, accepted, [_acceptance(q) for q in requests])

    def stats(self) -> dict | None:
        return None if self.policy is None else self.policy.snapshot()


def _name(candidate: int) -> str:
    return "plain" if candidate == PLAIN else f"width {candidate}"


def _acceptance(request) -> RequestAcceptance:
    """The request's record, made at its first step."""
    if request.accept_state is None:
        request.accept_state = RequestAcceptance()
    return request.accept_state


def _rank0_table(tp, costs: dict) -> dict:
    """Rank 0's `costs` on every rank of the tensor-parallel group `tp` (None: this process's own)."""
    if tp is None:
        return costs
    keys = sorted(costs)
    values = torch.tensor([costs[k] for k in keys], dtype=torch.float64)
    torch.distributed.broadcast(values, src=0, group=tp.control_group)
    return dict(zip(keys, values.tolist()))


def _time_step(launcher, rows: list[int], max_kv: int, cuda: bool) -> float:
    """Median seconds per greedy step of `launcher` over `rows` (padding rows) over TIMED_RUNS runs: on CUDA, the
    wall time of TIMED_STEPS steps queued back to back between two synchronizations, so that a step costs the slower
    of its host work and its device work, as under the engine's overlap (device time alone leaves the host work
    out); on the CPU the call's wall time."""
    greedy = SamplingTensors.greedy()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    steps = TIMED_STEPS if cuda else 1
    for _ in range(WARMUP_RUNS):
        launcher.decode(rows, max_kv, greedy)
    seconds = []
    for _ in range(TIMED_RUNS):
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            launcher.decode(rows, max_kv, greedy)
        sync()
        seconds.append((time.perf_counter() - t0) / steps)
    return statistics.median(seconds)
