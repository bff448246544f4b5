"""Adaptive speculation (`speculative_adaptive`, issue 16): before every decode step, run the configured EAGLE
round or a plain step, whichever the cost model expects to commit more tokens per second for this batch.

Pieces:
- the EAGLE worker (the configured (S, K, N) round) and a plain step (`PlainDecoding` with a feature ring): the
  plain step costs what a plain engine's step costs, the target alone. The draft falls behind by one position
  per plain step; the step keeps the target's draft feature at its position (speculative/feature_ring.py), and
  each request counts the positions its draft misses (`Request.draft_lag`, host side: every plain step commits
  exactly one token, so the host knows the lag even before it reads the step's result);
- the catch-up (`EagleWorker.catch_up`): before a round over requests whose draft lags, one ragged draft extend
  over their missing pairs, which also gives the round its step-0 top-K. The round then runs exactly as after a
  fresh prefill. A plain step whose batch holds a request lagging by `Limits.draft_lag_window` positions catches
  up first too (the ring would overwrite a feature not consumed yet);
- `AdaptivePolicy` (speculative/adaptive_policy.py): the rule, the acceptance EMAs and the cost clocks, fed here
  with each deciding step's device time (events around its launch, read when its result is read: no extra sync),
  the host time of its launch and of reading its results, and the catch-up's cost;
- the fast path: while the policy's last decision (a model choice) stands (`AdaptivePolicy.repeat`: the same
  cost bucket, within its reuse budget), `choose` returns the plain strategy or the worker itself (or the
  `NarrowRound` of the chosen verify width, below). Such a step is
  exactly a plain engine's step plus one lag increment per request, or a fixed engine's round plus keeping its
  results for the policy (read READ_EVERY rounds at a time, `_read_rounds`): no decision object, no timing events,
  no wrapper. After one such step has asked the policy, the steps that would stand after it (same cost bucket, within
  the budget) are taken without asking it (`_Ticket`) and replayed to it before anything else reaches it (the
  `policy` property). A standing plain choice needs every lag below the
  ring's window, a standing round every draft current (a request that joined by a lazy prefill is caught up by a
  decided round);
- the start-up cost table (`measure_costs`): every cost bucket (Limits.cost_buckets), each candidate's decode
  step run over padding rows (the dummy row) and timed, the median of a few runs: its device time and the host
  time of its launch. It is the policy's prior until a candidate has run at a bucket. Two catch-ups over the
  dummy row, a small and a large one, seed the policy's catch-up cost fits the same way. Graph buckets replay their
  captured graphs; larger batches run eagerly, as they will when serving. On CUDA the time is the device's
  (events around the call); on the CPU it is the call's wall time, which is the device work there;
- the lazy prefill (`prefill`): while the policy's model prefers plain steps, a request's final prompt chunk runs
  the target alone and its features go to the ring; its draft lags by the chunk and the first round catches it up;
- detached requests (`AdaptivePolicy.detachable`): where no round is expected over a joining request's life (at the
  load it lives at, rounds are not the model choice, plain steps are settled or rounds priced far behind them, and no
  probe of rounds waits), a lazy chunk is detached instead: no feature goes to the ring, no lag is counted, and the
  request decodes plainly to its end (`Request.detached_at`; the prefix cache takes its pages from there with the
  target's KV alone, and such pages serve only a request that joins detached: `joins_without_draft`, which the
  scheduler asks where a cached path holds one; that request is then detached whatever its prefill finds). A batch of
  detached requests runs `detached_plain`, a plain engine's own step (its graphs keep no draft features; the same
  kernels, though where its graphs land in memory is this process's, and the launch gaps between their kernels move
  with it by a few percent either way: bench/graph_replays_alone.py, session 54); a batch holding one runs no round
  (`AdaptivePolicy.decide`'s rounds_blocked): rounds the model chooses, and a due probe, wait until they have ended.
  On the H100 x4 (e64eb1c, 2026-11-27, 1k shared prefix, four runs) an adaptive server whose engine did a plain
  engine's work (an experiment: no choice, no ring, no lazy bookkeeping, a plain step that computed the target's
  draft features and dropped them) was within the control's spread of the plain server at 8-64, where the adaptive
  one was 2-4% behind it: its own per-step and per-prefill work was the difference there;
- parks (`AdaptivePolicy.park`): once plain steps have measured an epoch, a decided plain step over a batch whose
  every request is detached, at a load where a joining request would be detached too, parks: for up to PARK_EPOCHS
  epochs' steps `choose` returns the plain engine's step after one count, the policy told nothing (no ticket, no
  epoch, no decided step at a client's round-trip gap), and the answers arrivals need (steady choice, detach
  blocker) are asked once per key; a request that joins with its draft, a batch or load above the park's, an idle
  gap longer than DETACH_GAP, or any read of `policy` ends it, and the policy counts its steps then
  (`AdaptivePolicy.unparked`). Between parks one epoch runs told, so PARK_EPOCHS sets the told share: with 8 it was
  12-23% of the plain steps, and at concurrency 8-64, where the served engine's host work is as long as the device's
  step, each told step's bookkeeping showed in throughput (session 60);
- the verify width (`speculative_adaptive_widths`): rounds run the tree of the width `WidthChooser` picks for the
  batch's cost bucket (speculative/tree_width.py), fed with each round's per-width acceptance (its result row) when
  the policy reads the rounds; a decided round takes the width then, standing rounds the one chosen at the last
  decision or read.

Losslessness: a committed token is the target's choice at its position whichever candidate ran (greedy:
the argmax; sampled: the draw keyed by (seed, position), DESIGN §9), so adaptive output equals plain output.
"""

from __future__ import annotations

import collections
import itertools
import statistics
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from spruce.errors import InvariantError
from spruce.memory.prefix_cache import PrefixCache
from spruce.ops import compile_watch
from spruce.runtime.grammar import GrammarBatch
from spruce.runtime.logprobs import LogprobPlan
from spruce.runtime.sampler import SamplingTensors
from spruce.speculative.adaptive_policy import DETACH_GAP, PLAIN, SPECULATIVE, AdaptivePolicy, Decision
from spruce.speculative.eagle_worker import EagleWorker, LaggingDraft, NarrowRound
from spruce.speculative.feature_ring import FeatureRing
from spruce.speculative.strategy import DecodeStrategy, PlainDecoding, PrefillChunk, warm_spans
from spruce.speculative.tree_width import WidthChooser

READ_EVERY = 8  # standing rounds whose acceptance the policy reads at once (`AdaptiveDecoding._read_rounds`)
WARMUP_RUNS = 2
TIMED_RUNS = 5
CATCH_UP_SMALL, CATCH_UP_LARGE = 16, 64  # positions per request of the start-up catch-ups (`_time_catch_ups`) ...
CATCH_UP_REQUESTS = 64  # ... and requests of the large one (at most R)


@dataclass
class AdaptiveStep:
    """What `AdaptiveDecoding.choose` hands the engine for one decode step: the decision, the drafts to catch up
    first, and (once launched) the marks that time it (CUDA events, or perf_counter seconds on the CPU)."""

    owner: "AdaptiveDecoding"
    decision: Decision
    lagging: list[LaggingDraft]
    round: "EagleWorker | NarrowRound | None" = None  # what launches the round (its verify width), if a round
    detached: bool = False  # every request of the batch is detached: a plain step is a plain engine's
    marks: dict = field(default_factory=dict)  # start, end, and with a catch-up catch_up_start, catch_up_end
    catch_up_host_s: float = 0.0  # host seconds of the catch-up's launch (CUDA)

    @property
    def speculative(self) -> bool:
        return self.decision.choice == SPECULATIVE

    @property
    def tree_width(self) -> int:
        """Sampling rows per request (DecodeStrategy.tree_width): the round's tree, 1 for a plain step."""
        return self.round.tree_width if self.round is not None else 1

    @property
    def catch_up_positions(self) -> int:
        return sum(g.pairs for g in self.lagging)

    def decode(self, rows: list[int], max_kv: int, sampling: SamplingTensors,
               logprobs: LogprobPlan | None = None, grammar: GrammarBatch | None = None) -> torch.Tensor:
        """Launch the step (DecodeStrategy.decode's contract)."""
        return self.owner.run(self, rows, max_kv, sampling, logprobs, grammar)


@dataclass(slots=True)
class _Ticket:
    """Standing steps the policy granted ahead (`AdaptivePolicy.stand_ahead`): up to `left` more steps of `choice`
    over batches of lo..hi requests (the cost bucket of the step that asked) stand without asking it; each one taken
    is kept (its launch time on the policy's clock, its batch size) and replayed to the policy
    (`AdaptivePolicy.stood`) before anything else reaches it. The ticket also keeps the prefills launched
    meanwhile: nothing a prefill tells the policy under standing steps but its launch and its arrivals
    (`prefill`; one that extends the drafts of requests joining standing plain steps ends them: `drafts_joined`).
    Ended at each arrival, a ticket of rounds cost the next round a `repeat` per arrival, and one of plain steps
    was replayed inside the prefill's timed launch, whose mean sets how long prefill batching holds arrivals
    (runtime/prefill_batching.py). `answers`: the steady choice per batch size asked under this ticket
    (`AdaptiveDecoding._lazy_chunks`), kept for the ticket's steps (at most an epoch's) as the decision is
    (`_kept`)."""

    choice: str
    lo: int
    hi: int
    left: int
    clock: Callable[[], float]
    times: list[float] = field(default_factory=list)
    batches: list[int] = field(default_factory=list)
    prefills: list[tuple[float, int]] = field(default_factory=list)  # (launch time, prompts completed)
    answers: dict = field(default_factory=dict)  # ("steady", batch size) -> AdaptivePolicy.steady_choice


@dataclass(slots=True)
class _Park:
    """Plain steps over an all-detached batch that run untold (`AdaptivePolicy.park`): up to `left` more steps over
    batches of at most `load` requests while the engine holds at most `load` (of `granted`); the policy's
    answers that arrivals meanwhile need (its steady choice, the detach blocker, rounds' reach), asked once per key:
    nothing reaches it while parked, so they cannot change; the idle gaps met (`idle`), left out of its busy time,
    and one longer than DETACH_GAP (a change of level, not a client's round trip) ends it."""

    load: int
    granted: int
    left: int
    since: float
    idle_since: float | None = None
    idle_seconds: float = 0.0
    answers: dict = field(default_factory=dict)

    @property
    def steps(self) -> int:
        """The steps it took."""
        return self.granted - self.left


def _kept(answers: dict, key: tuple, compute: Callable[[], object]):
    """The answer a grant (`_Ticket`, `_Park`) keeps under `key`, computed once: the policy it came from is told
    nothing new while the grant stands."""
    try:
        return answers[key]
    except KeyError:
        answer = answers[key] = compute()
        return answer


class AdaptiveDecoding(DecodeStrategy):
    """Runs the worker's rounds or plain steps, as `AdaptivePolicy` decides per step, and catches the draft up."""

    speculative = True

    def __init__(self, worker: EagleWorker, prefix_cache: PrefixCache | None = None):
        super().__init__(worker.runner)
        r = worker.runner
        self.worker = worker
        self.prefix_cache = prefix_cache  # the engine's (None: off): which prompts repeat (_lazy_chunks)
        self.ring = FeatureRing(r.limits, r.draft.feature_width_first_step, r.dtype, r.device,
                                aux=bool(r.target.aux_layers))
        self.lag_window = r.limits.draft_lag_window  # read at every step (a Limits property computes it)
        self.plain = PlainDecoding(r, self.ring)
        self.detached_plain = PlainDecoding(r, None, phase="decode_detached")  # a plain engine's step (no features)
        self._policy: AdaptivePolicy | None = None  # made by measure_costs (after graph capture): `policy`
        self._ticket: _Ticket | None = None  # standing steps taken ahead, not yet replayed to the policy
        self._park: _Park | None = None  # plain steps over an all-detached batch that run untold (`_park_here`)
        self._idle_since: float | None = None  # when the idle gap the policy has not been told of began (`idle`)
        self.last_decision: Decision | None = None
        self.cuda = r.device.type == "cuda"
        self._stream = torch.cuda.current_stream(r.device) if self.cuda else None  # the engine's: where marks go
        self._events: list[torch.cuda.Event] = []  # timing events of resolved steps, reused
        self._batch_size = 0  # requests in the last decode step
        self._lag_bound = 0  # no request's draft lags by more (host): `choose` sets every lag of a decided step's
        # batch and grows them by one per plain step, `add_lag` by a lazy prefill's chunk (see `choose`)
        self._lazy: frozenset[int] = frozenset()  # chunks of the prefill being launched whose draft extend waits
        self._detach: frozenset[int] = frozenset()  # ... and those of them detached instead (their drafts never
        # run again)
        self._all_detached = False  # every request of the decode batch is detached: exact at each decided step,
        # cleared when a request with a draft joins (`extend_draft`)
        self.detached_requests = 0  # requests detached so far (/metrics) ...
        self.attached_requests = collections.Counter()  # ... and why the others joined with their drafts: rounds
        # expected, extended eagerly, or what kept a lazy one from detaching (AdaptivePolicy.detach_blocker)
        self._lazy_in_flight: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # request -> its lazy prefill
        self._prefill_extends: collections.deque = collections.deque()  # per prefill in flight, oldest first: its
        # eager draft extend's (requests completed, start mark, end mark, host seconds), or None
        self._unread_rounds: list[tuple[list, list[int]]] = []  # resolved rounds (requests, drafts each accepted:
        # its result row's first entry) the policy has not read yet, oldest first
        self.widths: WidthChooser | None = None  # the verify width's choice (made by measure_costs; None: N only)
        self._width_columns = 1 + r.limits.step_advance  # where a result row's per-width acceptance starts
        self._unread_widths: list[tuple[int, list[list[int]]]] = []  # per unread round: its width, its result rows
        self.standing_round: EagleWorker | NarrowRound = worker  # what a standing round launches (its width)
        self._width_bucket = 1  # the cost bucket that width was chosen for

    @property
    def policy(self) -> AdaptivePolicy | None:
        """The policy, told first of the standing steps taken ahead since it last heard (`_Ticket`), then of an
        idle gap that began after them (`idle`): whatever reads or feeds it through here sees every step as if each
        had asked it (`AdaptivePolicy.repeat`), and the gap where the engine met it."""
        return self._told()

    def _told(self) -> AdaptivePolicy | None:
        """The policy, once told what is pending (`policy`): a park under way ends (`_unpark`)."""
        if self._park is not None:
            self._unpark()
        if self._ticket is not None:
            ticket, self._ticket = self._ticket, None
            self._policy.stood(ticket.choice, ticket.times, ticket.batches, ticket.prefills)
        if self._idle_since is not None:
            since, self._idle_since = self._idle_since, None
            self._policy.idle(since)
        return self._policy

    @policy.setter
    def policy(self, policy: AdaptivePolicy | None) -> None:
        self._ticket = None
        self._park = None
        self._idle_since = None
        self._policy = policy

    def _park_here(self, d: Decision) -> None:
        """After decision `d` over a batch whose every request is detached: park if the policy grants it
        (AdaptivePolicy.park): the next steps are a plain engine's, each taken by `choose` with one count, until the
        grant is spent, a batch or the engine's load outgrows the park's load, a request joins with its draft
        (`prefill`), or an idle gap outlasts DETACH_GAP (`_resume`); then the policy is told (`_unpark`)."""
        grant = self._policy.park(d)
        if grant is not None:
            load, steps = grant
            self._park = _Park(load, steps, steps, self._policy.clock())

    def _unpark(self) -> None:
        """The park ends: the policy counts its steps and busy time (AdaptivePolicy.unparked); an idle gap under way
        is told to it at its next use (`policy`)."""
        park, self._park = self._park, None
        now = self._policy.clock()
        gap = now - park.idle_since if park.idle_since is not None else 0.0
        self._policy.unparked(park.steps, now - park.since - park.idle_seconds - gap)
        if park.idle_since is not None:
            self._idle_since = park.idle_since

    def _resume(self) -> None:
        """Something arrives while parked: the idle gap before it, if any, is left out of the park's busy time, or
        ends the park where it outlasted DETACH_GAP (a change of level: the load it was granted for is gone)."""
        park = self._park
        if park is None or park.idle_since is None:
            return
        gap = self._policy.clock() - park.idle_since
        if gap > DETACH_GAP:
            self._unpark()
        else:
            park.idle_seconds += gap
            park.idle_since = None

    # --- the interface ---------------------------------------------------------------------------------------
    def prefill(self, chunks: list[PrefillChunk], sampling: SamplingTensors,
                logprobs: LogprobPlan | None = None, grammar: GrammarBatch | None = None,
                held: int = 0) -> torch.Tensor:
        """The target's prefill, then the draft's extend over the chunks, except over lazy ones (`_lazy_chunks`,
        which judges detaching at the `held` requests too), whose features go to the ring instead: their drafts lag
        like a plain step's.

        Under a ticket of standing steps the prefill joins the ticket (its launch time and arrivals, replayed with
        its steps, as `break_chain` would have told them). Under standing rounds no chunk is lazy and the drafts
        joining end nothing (`drafts_joined` ends only standing plain steps). Told at once, each arrival replayed
        the ticket and the next round asked the policy again: on the CPU (128-token prompts at concurrency 32,
        rounds standing, ~0.5 arrivals a round) the adaptive engine's own host work was 78-80 us a round, 24-25 of
        them in this method and the extend's timing (65 and 16 since). Under standing plain steps the prefill
        ends them only if it extends drafts that rounds may pay for; replayed at each arrival, the ticket and the
        steady choice took ~65 and ~80 us of each prefill's launch on the H100 (in process, 1k shared prefix,
        concurrency 32, 2026-11-26). Served, the adaptive server's mean prefill launch was 2.28 ms against the plain
        servers' 1.80 at 32 (5cd14df, four runs on the H100 x4), so prefill batching held its arrivals longer (8%
        fewer prefills per request, TTFT p50 +11%); joining the ticket did not shorten it there (2.25 ms against
        1.71, four runs at 6fd5dbb). The lazy chunks' ring stores built on the host were half the difference
        (`extend_draft`): 1.98 ms against 1.66-1.77 without them (four runs at 3a56c35; DESIGN §16, session 41)."""
        self._resume()
        if self._idle_since is not None:  # the arrivals come after the gap
            self._told()
        ticket = self._ticket
        finals = sum(c.final for c in chunks)  # the prompts this prefill completes
        if ticket is not None:
            ticket.prefills.append((ticket.clock(), finals))
        if self._policy is not None and (ticket is None or ticket.choice == PLAIN):
            parked = self._park is not None  # (no ticket then): the park's answers judge the chunks, and it ends
            if ticket is None and not parked:  # here unless every chunk is detached
                self._policy.break_chain(finals)  # the time until the next decode launch is not a decode step's;
                # the prompts it completes arrive in the epoch under way
            self._lazy, steady_plain, self._detach = self._lazy_chunks(chunks, finals, held)
            if parked and len(self._detach) < len(chunks):
                self._unpark()
                self._policy.break_chain(finals)
            if not steady_plain and any(c.final and i not in self._lazy for i, c in enumerate(chunks)):
                self.policy.drafts_joined()  # arrivals with current drafts, for which rounds may pay: a standing
                # plain choice is decided again (not where the steady choice is plain even with every draft current)
        else:
            self._lazy = self._detach = _detached_by_cache(chunks)
        self._prefill_extends.append(None)  # extend_draft replaces it if it extends eagerly
        try:
            return DecodeStrategy.prefill(self, chunks, sampling, logprobs, grammar, held)  # calls extend_draft
        finally:
            self._lazy = self._detach = frozenset()

    def _lazy_chunks(self, chunks: list[PrefillChunk], finals: int,
                     held: int = 0) -> tuple[frozenset[int], bool, frozenset[int]]:
        """The chunks (`finals` of them final) whose draft extend is left to a later catch-up, whether the steady
        choice was asked and is plain, and those of them that are detached instead (`AdaptivePolicy.detachable`;
        why each final chunk that is not joins with its draft is counted: `attached_requests`). Every chunk of a
        request detached by its cached prefix (admitted onto pages without the draft's KV, `joins_without_draft`)
        is detached whatever else holds. Otherwise none is lazy unless
        the policy prefers plain steps for the batch these requests join with current drafts
        (`AdaptivePolicy.steady_choice`; the batch: about the last decode batch's size, as requests come as others
        finish; or these alone); then each final chunk of a request whose draft is
        current and that is at most Limits.lazy_prefill_tokens long (half the ring stays for plain steps before a
        catch-up is due), unless its pages repeat a prompt seen before.

        Where the steady choice is plain, the chunks extended eagerly all the same (a repeated prompt, a long one)
        do not end a standing choice of plain steps (`prefill`): rounds do not pay for that batch even with every
        draft current, so a decision would only confirm plain steps. Ended at every such prefill, each cost a
        decided step (~0.26 ms of host work on the H100, session 27) at every arrival whose prompt is longer than
        Limits.lazy_prefill_tokens, and at every prompt's second sight (CPU, the serving bar's 53 held-out prompts
        after the 1k shared prefix at concurrency 8: 9, 40 and 4 eager prefills in their first, second and third
        cycles; from the third the prefix cache holds each prompt but its last page).

        The prefix cache takes a lazy prompt's pages with their target KV alone, which serve only requests that
        join detached (memory/prefix_cache.py); for a request that may run rounds, a prompt whose next page the cache
        holds so (PrefixCache.seen_before) is extended eagerly, so that its pages get their draft KV: a shared system
        prompt is computed twice for such requests, then cached whole (once for detached ones, as in a plain
        engine, since 2026-11-27; before, the cache took only pages with their draft KV, for every request). (Had
        every lazy prompt stayed out, an adaptive server that decoded plainly from its start would have computed
        its shared system prompt for every request; had every prompt with a full page been extended eagerly, as
        until 2026-11-23, every request would have paid the draft's extend over its own unique prompt: on the
        H100 with a 1k-token shared prefix, TTFT 32.6 ms against a plain server's 20.9 at concurrency 8, with
        every step plain.) A draft that would catch up at once anyway, or whose rounds are expected, is extended
        now. Not a repeated prompt where rounds are priced out of reach (AdaptivePolicy.rounds_out_of_reach): there
        a request joins with its draft only while a probe of rounds is under way, owed or waiting, and its draft's
        work waits for the probe's catch-up (batched, ~1 ms + 1.2 us a position on the H100) or for nothing if the
        probe ends first. Extended eagerly, each such prompt's launch took ~5 ms of the batch's time (H100 x4,
        c5ed8ad, 1k shared prefix: the first concurrency-8 levels' ~40 eager prefills a run lengthened their mean
        prefill launch from ~1.3 to 2.0-2.3 ms), and once most requests detached (fce3728) such prompts rarely got
        their draft KV, so every request a probe held with its draft paid it (39 at concurrency 32, 50 at 8, over
        four runs' later passes).

        While rounds are the standing model choice (the last decision's, not a probe's), the steady choice is not
        asked: the decision already priced rounds over the batch with its catch-ups and arrivals, which only weigh
        against them, so rounds are expected and the draft is extended now. Asked at every arrival, it took 45 us a
        prefill on the CPU (128-token prompts at concurrency 8, every step a round): the adaptive engine's own host
        work (choose, resolved, this) went from 53 to 45-49 us a round (two runs each); on the H100 (2026-11-25,
        b726f34) an adaptive server running only rounds there launched each round ~150 us slower than a fixed
        server."""
        forced = _detached_by_cache(chunks)
        if self._policy is None or not finals:
            return forced, False, forced
        finals -= sum(chunks[i].final for i in forced)  # (the forced ones are counted as detached requests)
        if not finals:  # no prompt to judge: the steady choice is not asked (~50-60 us a prefill on the H100)
            return forced, False, forced
        if self._rounds_chosen():
            self.attached_requests["rounds"] += finals
            return forced, False, forced
        size = min(max(self._batch_size, finals), self._policy.buckets[-1])  # the running batch, or these alone
        if self._steady_choice(size) != PLAIN:
            self.attached_requests["rounds"] += finals
            return forced, False, forced
        longest = self.runner.limits.lazy_prefill_tokens
        cache = self.prefix_cache

        within_reach = None  # rounds within reach of plain steps (asked once, if a prompt repeats)

        def repeats(c: PrefillChunk) -> bool:  # its first page past its path is cached without draft KV, and its
            nonlocal within_reach  # draft's KV may serve rounds
            if cache is None or not cache.seen_before(c.request.cached_path, c.request.token_ids):
                return False
            if within_reach is None:
                within_reach = not self._ask(("out_of_reach", size), lambda: self._policy.rounds_out_of_reach(size))
            return within_reach

        lazy = frozenset(i for i, c in enumerate(chunks) if c.final and c.request is not None and i not in forced
                         and c.request.draft_lag == 0 and len(c.tokens) <= longest and not repeats(c))
        if len(lazy) < finals:
            self.attached_requests["eager"] += finals - len(lazy)
        blocker = self._detach_blocker(size, held) if lazy else None  # (None: detachable)
        if blocker is not None:
            self.attached_requests[blocker] += len(lazy)
        return lazy | forced, True, (lazy if blocker is None else frozenset()) | forced

    def _rounds_chosen(self) -> bool:
        """The last decision is rounds as the model's choice (not a probe's): arrivals are expected to run rounds,
        so their drafts are extended now."""
        last = self.last_decision
        return last is not None and last.choice == SPECULATIVE and last.reason == "model"

    def _steady_choice(self, size: int) -> str:
        """The policy's steady choice for a batch of `size` whose drafts are current (AdaptivePolicy.steady_choice),
        asked once a ticket of standing plain steps (`_kept`)."""
        self._read_rounds()  # (nothing without unread rounds; else the ticket is replayed first and granted anew)
        ticket = self._ticket
        if ticket is None:
            return self._ask(("steady", size), lambda: self._policy.steady_choice(size))
        return _kept(ticket.answers, ("steady", size), lambda: self._policy.steady_choice(size))

    def _ask(self, key: tuple, compute: Callable[[], object]):
        """The policy's answer `compute()`, kept by the park under way for its life (`_kept`), else asked now."""
        park = self._park
        return compute() if park is None else _kept(park.answers, key, compute)

    def joins_without_draft(self, held: int = 0) -> bool:
        """Whether a request admitted now would join detached (DecodeStrategy.joins_without_draft): the steady
        choice for the running batch is plain steps and nothing holds detaching back (`_lazy_chunks`'s rule for a
        lazy chunk, asked before the request's prefill: the scheduler then gives it cached pages without the draft's
        KV, and its prefill detaches it). No: while rounds are the model's choice."""
        self._resume()
        if self._idle_since is not None:  # judged after the gap
            self._told()
        if self._policy is None or self._rounds_chosen():
            return False
        size = min(max(self._batch_size, 1), self._policy.buckets[-1])
        return self._steady_choice(size) == PLAIN and self._detach_blocker(size, held) is None

    def _detach_blocker(self, size: int, held: int) -> str | None:
        """AdaptivePolicy.detach_blocker for a request joining a batch of `size` while the engine holds `held`
        requests (running and queued): the load it lives at is at least the engine's. After an idle gap a served
        level's wave comes back all at once, but its first prefills find a small batch and a load window the gap
        emptied: judged at those small loads (plain steps unsettled there, or no model choice), the first wave of
        each concurrency-64 level joined with its drafts (H100 x4, 251813a, 2026-11-27: model_choice 262 and
        unsettled 333 requests over 11 later passes) and its batches kept the feature-keeping step."""
        load = min(max(size, held), self._policy.buckets[-1])
        return self._ask(("blocker", load), lambda: self._policy.detach_blocker(load))

    def wants_prefill_features(self, chunks: list[PrefillChunk]) -> bool:
        """A prefill whose every chunk is detached (`_lazy_chunks`) keeps no feature: none is stored or extended."""
        return len(self._detach) < len(chunks)

    def extend_draft(self, chunks: list[PrefillChunk], features: torch.Tensor | None, ends: list[int],
                     finals: list[int], new_tokens: torch.Tensor) -> None:
        """The draft extend over the prefill's eager chunks; each lazy chunk's features [its tokens, F] go to the
        ring at its positions, and its request's draft lags by its length from this launch on (`features`: None
        where every chunk is detached, `wants_prefill_features`).

        The ring takes every chunk's features in one indexed store at the rows and positions the prefill's batch
        already holds on the device (`ModelRunner.prefilled_tokens`): no index is built on the host. The eager
        chunks' land in their rows too, harmlessly: their drafts are current once extended, and the steps that make
        a draft lag write each position of its lag before a catch-up reads it. Built on the host per chunk, the
        stores took ~0.16 ms of each served prefill launch at concurrency 32 (H100, 1k shared prefix, ~4.5 chunks
        a prefill; py-spy over the served engine, 2026-11-27), the adaptive engine's largest own part of it.

        Detached lazy chunks (`_detach`, AdaptivePolicy.detachable) keep nothing: their requests' drafts never run
        again (`Request.detached_at`), so no lag is counted and no feature stored; they hold back standing rounds
        (the bound of the lags is raised to one) until a decided step, which keeps their batches plain."""
        detach = self._detach
        if features is None and len(detach) < len(chunks):  # always on: a chunk that keeps a draft needs them
            raise InvariantError(f"a prefill of {len(chunks)} chunks, {len(detach)} detached, kept no draft features")
        if any(c.final and i not in detach for i, c in enumerate(chunks)):
            self._all_detached = False  # a request with a draft joins the decode batch
        if self._park is not None and len(detach) < len(chunks):  # always on: `prefill` ends the park first
            raise InvariantError(f"a prefill of {len(chunks)} chunks, {len(detach)} detached, extends drafts while "
                                 f"parked")
        if not self._lazy:
            self._timed_extend(chunks, features, ends, finals, new_tokens)
            return
        dev = self.runner.device

        def token_indices(picked: list[int]) -> list[int]:  # the batch's tokens of the picked chunks
            return [t for i in picked for t in range(ends[i] - len(chunks[i].tokens) + 1, ends[i] + 1)]

        if detach:
            for i in detach:
                req = chunks[i].request
                req.detached_at = chunks[i].start if req.detached_at is None else min(req.detached_at,
                                                                                     chunks[i].start)
            self.detached_requests += sum(chunks[i].final for i in detach)
            self._lag_bound = max(self._lag_bound, 1)
        lagging = self._lazy - detach
        for i in lagging:
            req = chunks[i].request
            self.add_lag(req, len(chunks[i].tokens))
            self._lazy_in_flight[req] = self._lazy_in_flight.get(req, 0) + 1
        if lagging:
            self.ring.store(*self.runner.prefilled_tokens(features.shape[0]), features)
        eager = [i for i in range(len(chunks)) if i not in self._lazy]
        if not eager:
            return
        sub = [chunks[i] for i in eager]
        slot_of_final = {i: k for k, i in enumerate(finals)}  # new_tokens has one entry per final chunk
        sub_finals = [k for k, i in enumerate(eager) if chunks[i].final]
        host = torch.tensor(token_indices(eager), dtype=torch.int64)
        picks = torch.tensor([slot_of_final[eager[k]] for k in sub_finals], dtype=torch.int64)
        self._timed_extend(sub, features[host.to(dev, non_blocking=True)],
                           [n - 1 for n in itertools.accumulate(len(c.tokens) for c in sub)], sub_finals,
                           new_tokens[picks.to(dev, non_blocking=True)])

    def _timed_extend(self, chunks: list[PrefillChunk], features: torch.Tensor, ends: list[int], finals: list[int],
                      new_tokens: torch.Tensor) -> None:
        """The worker's draft extend over eager chunks, timed for the policy's price of a new request's prompt
        (AdaptivePolicy.drafted_prompts, fed when the prefill resolves)."""
        t0 = time.perf_counter()
        start = self._mark()
        self.worker.extend_draft(chunks, features, ends, finals, new_tokens)
        end = self._mark()
        launch_s = time.perf_counter() - t0
        ticket = self._ticket
        if ticket is None or ticket.choice != SPECULATIVE:  # (under standing rounds the epoch is theirs: it pays
            self.policy.prompt_extend_launched(launch_s)  # the extend, AdaptivePolicy.prompt_extend_launched)
        self._prefill_extends[-1] = (len(finals), start, end, launch_s if self.cuda else 0.0)

    def decode(self, rows: list[int], max_kv: int, sampling: SamplingTensors,
               logprobs: LogprobPlan | None = None, grammar: GrammarBatch | None = None) -> torch.Tensor:
        raise TypeError("AdaptiveDecoding runs no step itself: the engine asks choose(requests) for the step")

    def choose(self, requests: list, held: int = 0) -> AdaptiveStep | PlainDecoding | EagleWorker | NarrowRound:
        """The next decode step over `requests` (called right before its launch; `held`: the requests the engine
        holds, AdaptivePolicy.decide): a round, or a plain step (the plain strategy or `standing_round`, the worker
        or a NarrowRound, while the last decision stands: see the module docstring).

        Updates each request's draft lag as of this step's launch: 0 after a round (it catches up first), one
        more after a plain step.

        Whether the last decision may stand is read from a bound of every lag (`_lag_bound`) instead of a loop over
        the batch's lags: set exactly at each decided step (every later batch member was in its batch, or joined
        since, current or lagging by a lazy prefill's chunk, `add_lag`), one more per standing plain step; a
        request that finishes leaves it loose, so at worst a step that could have stood is decided instead
        (the lags then read exactly: a catch-up only where one is due). With the loop `choose` took 4.1-4.7 us
        a standing plain step at a batch of 32 and 5.2-5.5 at 64 (CPU, in process, bench/adaptive_plain_overhead.py;
        a plain engine's 0.8-1.1), without it 3.8-4.0 and 4.4-4.5 (the lag increments stay); served at 32-64 the
        adaptive engine took ~1 us a token more than a plain one (2.5-3%, eight H100 x4 runs, 2026-11-27)."""
        park = self._park
        if park is not None:  # plain steps over an all-detached batch, untold (`_park_here`)
            if park.left and len(requests) <= park.load and held <= park.load:
                park.left -= 1
                return self.detached_plain
            self._unpark()
        window = self.lag_window
        last = self.last_decision
        if last is not None:  # the last decision may stand: plain steps while no lag fills the ring, rounds while
            plain = last.choice == PLAIN  # every draft is current (else a catch-up is due first)
            if self._lag_bound < (window if plain else 1):  # every lag below the limit (see above)
                batch_size = len(requests)
                ticket = self._ticket  # steps granted ahead (`_grant`): the standing steps' fast path
                if ticket is not None and ticket.left and ticket.lo <= batch_size <= ticket.hi:
                    ticket.left -= 1
                    ticket.times.append(ticket.clock())
                    ticket.batches.append(batch_size)
                    stands = True
                else:
                    stands = self._stand(last.choice, batch_size)
                if stands:
                    if not plain:
                        return self.standing_round
                    if self._all_detached:  # no draft to keep: a plain engine's step
                        return self.detached_plain
                    self._lag_bound += 1
                    for q in requests:
                        q.draft_lag += 1
                    return self.plain
        bs = self._batch_size = len(requests)
        tokens_left = sum(max(q.token_limit - q.num_tokens, 0) for q in requests) / bs
        request_tokens = sum(q.token_limit - len(q.prompt_ids) for q in requests) / bs
        new_positions = sum(len(q.prompt_ids) - q.cached_tokens for q in requests) / bs
        detached = [q.detached_at is not None for q in requests]
        lags = [0 if gone else q.draft_lag for q, gone in zip(requests, detached)]  # (a detached draft: none)
        self._read_rounds()
        d = self.policy.decide(requests, lags, tokens_left, request_tokens, new_positions, held,
                               rounds_blocked=any(detached), all_detached=all(detached))
        self.last_decision = d
        spec = d.choice == SPECULATIVE
        if spec and any(detached):  # always on: its draft KV is missing and no catch-up has its features
            raise InvariantError(f"a round was chosen over a batch holding {sum(detached)} detached request(s)")
        catch_up = spec or any(lag >= window for lag in lags)
        lagging = ([_lagging(q, self._lazy_in_flight.get(q, 0)) for q, lag in zip(requests, lags) if lag]
                   if catch_up else [])
        for q, gone in zip(requests, detached):
            q.draft_lag = 0 if spec or gone else (1 if lagging else q.draft_lag + 1)
        self._lag_bound = max((q.draft_lag for q in requests), default=0)
        self._all_detached = all(detached)
        if spec:
            self._choose_width(d.bucket)
        elif self._all_detached:
            self._park_here(d)
        return AdaptiveStep(self, d, lagging, self.standing_round if spec else None, detached=self._all_detached)

    def add_lag(self, req, positions: int) -> None:
        """`req`'s draft misses `positions` more positions (a lazy prefill's chunk): every lag that grows outside
        `choose` grows through here, so that the bound its fast path reads stays one."""
        req.draft_lag += positions
        self._lag_bound = max(self._lag_bound, req.draft_lag)

    def _choose_width(self, bucket: int) -> None:
        """Rounds over a batch of cost bucket `bucket` run the width the chooser picks (standing ones too, until
        the next decision or read)."""
        self._width_bucket = bucket
        if self.widths is not None:
            self.standing_round = self.worker.narrow(self.widths.choose(bucket))

    def _stand(self, choice: str, batch_size: int) -> bool:
        """Whether the last decision stands for a step of `choice` over `batch_size` requests that no ticket covers
        (`AdaptivePolicy.repeat`, which counts it); if so, the steps that may stand after it are granted (`_grant`).
        A standing step asked the policy, an object of some fifty fields, on cold caches: `choose` took 10-13 us on
        the H100's host against a fixed engine's 1.3-1.9 (in process, 2026-11-25), and at concurrency 1 an adaptive
        engine's plain steps took 8-10 us more wall time each than a plain engine's, 2.5-3.3% behind it. Taking the
        ticket through this method after a `max(map(attrgetter))` over the lags still cost ~9-10 us a step on the
        CPU at concurrency 1 with the shared prefix (the engine loop's own caches cold after each forward); taken in
        `choose` after a loop over the lags, 5-6.5 (15-16 us a round against 19 at concurrency 32, rounds only;
        session 27)."""
        policy = self.policy  # (replays the ticket, if any)
        if not policy.repeat(choice, batch_size):
            return False
        self._grant(policy, choice, batch_size)
        return True

    def _grant(self, policy: AdaptivePolicy, choice: str, batch_size: int) -> None:
        """The steps of `choice` that would stand after one over `batch_size` requests that the policy just let
        stand (`AdaptivePolicy.stand_ahead`) become the ticket, which the next steps take without asking it."""
        left, lo, hi = policy.stand_ahead(batch_size)
        if left > 0:
            self._ticket = _Ticket(choice, lo, hi, left, policy.clock)

    def run(self, step: AdaptiveStep, rows: list[int], max_kv: int, sampling: SamplingTensors,
            logprobs: LogprobPlan | None, grammar: GrammarBatch | None) -> torch.Tensor:
        """Launch `step`: the catch-up it needs, then the chosen candidate's step; both timed."""
        t0 = time.perf_counter()
        step.marks["start"] = self._mark()
        if step.lagging:
            with self.runner.timer.phase("catch_up"):
                step.marks["catch_up_start"] = step.marks["start"]
                self.worker.catch_up(step.lagging, self.ring)
                step.marks["catch_up_end"] = self._mark()
            catch_up_s = time.perf_counter() - t0
            self._policy.catch_up_launched(catch_up_s)
            if self.cuda:  # its launch is host time of the catch-up, not of the step
                step.catch_up_host_s = catch_up_s
                self._policy.waited(step.catch_up_host_s)
        strategy = step.round if step.speculative else self.detached_plain if step.detached else self.plain
        t1 = time.perf_counter()
        out = strategy.decode(rows, max_kv, sampling, logprobs, grammar)
        step.marks["end"] = self._mark()
        # (straight to the policy: nothing is pending at a decided step, and a park it began goes on)
        if self.cuda:  # the launch's host time (E)
            self._policy.launched_host(step.decision.choice, step.decision.bucket, time.perf_counter() - t1)
        else:  # the device work ran on the host: in D, not host overhead
            self._policy.waited(time.perf_counter() - t0)
        return out

    def resolved(self, step, requests: list, results: list[list[int]], waited_s: float,
                 resolve_s: float = 0.0) -> None:
        """A step's results were read after waiting `waited_s` on the device and applied in `resolve_s` host
        seconds: feed the policy (a decided step's device time from its marks, which completed before its result,
        and its resolve time; a round's acceptance)."""
        if step is self.detached_plain and self._park is not None:  # a parked step: nothing to tell
            return
        if self._ticket is None and self._park is None:  # (under standing or parked steps no decided step's
            self.policy.waited(waited_s + resolve_s)  # interval is open: AdaptivePolicy.stood, unparked)
        if step is None:  # a prefill: its lazy requests' positions are all committed now
            for q in requests:
                left = self._lazy_in_flight.pop(q, 0) - 1
                if left > 0:
                    self._lazy_in_flight[q] = left
            if not self._prefill_extends:
                raise InvariantError("a prefill resolved that AdaptiveDecoding.prefill never launched")
            extend = self._prefill_extends.popleft()  # prefills resolve in launch order
            if extend is not None:
                completed, start, end, host_s = extend
                # straight to the policy: the prompt-extend price is none of what standing steps feed, so the
                # ticket (if any) goes on (through `policy` it would be replayed and end at every arrival)
                self._policy.drafted_prompts(completed, self._elapsed(start, end), host_s)
                if self.cuda:
                    self._events.extend((start, end))
            return
        if step is self.plain or step is self.detached_plain:  # a plain step the last decision stood for
            return
        if type(step) is not AdaptiveStep:  # a round the last decision stood for (the worker, or a NarrowRound: the
            # width may have changed since its launch): only its acceptance is read, later
            self._unread_rounds.append((requests, [row[0] for row in results]))  # (read while the rows are warm)
            if self.widths is not None:
                self._unread_widths.append((step.tree_width, results))
            if len(self._unread_rounds) >= READ_EVERY:
                self._read_rounds()
            return
        d, m = step.decision, step.marks
        # the step's own cost samples go straight to the policy: none of them is what standing steps feed, so the
        # ticket that the first standing step after this one took goes on (through `policy` it would end here, one
        # step after it began, and the next step would ask again)
        self._policy.resolved_host(d.choice, d.bucket, resolve_s)
        catch_up_s = 0.0
        if step.lagging:  # (its device time leaves the epoch's busy time: after the ticket's steps are in)
            catch_up_s = self._elapsed(m["catch_up_start"], m["catch_up_end"])
            self.policy.caught_up(step.catch_up_positions, catch_up_s, step.catch_up_host_s)
        self._policy.measured(d.choice, d.bucket, max(self._elapsed(m["start"], m["end"]) - catch_up_s, 0.0))
        if self.cuda:
            self._events.extend(v for k, v in m.items() if k != "catch_up_start")
        if step.speculative:
            self._unread_rounds.append((requests, [row[0] for row in results]))
            if self.widths is not None:
                self._unread_widths.append((step.tree_width, results))
            self._read_rounds()

    def _read_rounds(self) -> None:
        """The policy reads the acceptance of the rounds resolved since it last did, in their order, in one call:
        every READ_EVERY standing rounds, and before anything reads acceptance (a decision, the steady choice of a
        prefill, a snapshot). A standing round thus costs its resolve one list append; read per round, an adaptive
        engine's standing round took ~20 us more than a fixed engine's (CPU, batch 8, 2026-11-25), mostly the
        call's fixed cost on cold caches. A request that the round finished counts too: its first result entry is
        the device's acceptance of real drafts (the host cuts the committed tokens at the request's end, not it).

        The ticket's steps are replayed first (a drift of the acceptance ends the standing decision: its budget is
        then 0, and the steps taken before the read were granted before it); if the decision still stands, the
        ticket is granted again at once, as the next standing step's `repeat` and `stand_ahead` would grant it:
        ended at every read, it cost standing rounds a `repeat` every READ_EVERY rounds."""
        unread = self._unread_rounds
        if not unread:
            return
        self._unread_rounds = []
        ticket = self._ticket if self._idle_since is None else None  # (none granted anew across a gap: `idle`)
        policy = self.policy  # replays the ticket
        policy.accepted_rounds(unread)
        if self.widths is not None:
            self._read_widths()
        if ticket is not None:
            self._grant(policy, ticket.choice, ticket.hi)

    def _read_widths(self) -> None:
        """The chooser reads the unread rounds' per-width acceptance and picks the width of the standing rounds
        again."""
        start = self._width_columns
        stop = start + len(self.widths.widths) - 1
        for width, results in self._unread_widths:
            columns = list(zip(*results))  # each result column over the round's requests
            totals = [*map(sum, columns[start:stop]), sum(columns[0]) if columns else 0]  # (the last: N's, if N ran)
            self.widths.add(width, totals, len(results))
        self._unread_widths = []
        self._choose_width(self._width_bucket)

    def idle(self) -> None:
        """The engine has nothing to launch: the policy is told at its next use (`policy`), with the time the gap
        began, after the ticket's steps; no step is taken ahead across the gap (the ticket's grant ends: the next
        step asks `AdaptivePolicy.repeat`, which judges a batch after a gap). The engine meets the gap while the
        step that ends the last request is in flight, before it reads that step's tokens: told at once, the ticket's
        replay and the gap took ~70 us of the host's time there at every request's end at concurrency 1 (H100, in
        process, session 49), where a plain engine's host has ~60 us to spare within a step. Served, the engine
        process takes the idle engine's stats after sending those tokens (`AdaptiveDecoding.stats` reads the policy),
        so the gap is told while the client's next request is on its way."""
        if self._policy is None:
            return
        park = self._park
        if park is not None:  # told at the park's end, if it outlasts DETACH_GAP (`_resume`)
            if park.idle_since is None:
                park.idle_since = self._policy.clock()
            return
        if self._idle_since is None:  # (the engine may call again before anything launches: the gap began first)
            self._idle_since = self._policy.clock()
        if self._ticket is not None:
            self._ticket.left = 0

    def capture_graphs(self, show_progress: bool) -> None:
        """The plain steps' graphs first (the detached one's, a plain engine's step, then the one keeping the draft's
        features), then the worker's. Graphs replay with the same kernels either way, but the
        set captured second replays with longer gaps between its kernels (H100, in process, concurrency 1, session
        30: plain steps 283-286 us captured second against 266-268 first and a plain engine's 266-268; rounds
        782-794 against 752-754 first and a fixed engine's 747-754; under the profiler 0.52-0.56 against 0.34-0.41 us
        a gap, kernels alike). With CUDA_MODULE_LOADING=EAGER every engine's graphs replay with the long gaps (fixed
        796, plain 276): consistent with the gaps following where the lazily loaded kernels land, the set loaded
        first keeping the short ones (cause not proven). Plain steps first: they lose more to the long gaps
        (+6.4% against rounds' +4.5%), and a plain step is what must cost what a plain engine's does. Served (the
        engine process), the order made no difference (a round's device span 664-667 us either way, a fixed
        server's 666-669; a plain step's 248.5-250.6 either way, a plain server's 244.4-246.3 in that run, while in
        a later run the adaptive server's ITL p50 at concurrency 1 was the lowest of three, 243-245 us against two
        plain servers' 246-247 and 249-250): there a step's time differs between server processes by a few
        microseconds whatever they hold."""
        self.detached_plain.capture_graphs(show_progress)
        self.plain.capture_graphs(show_progress)
        self.worker.capture_graphs(show_progress)

    def warm_eager(self) -> None:
        """The worker's eager prefill path (DecodeStrategy.warm_eager), then the catch-up over the same spans of
        the dummy row: its draft extend reads the ring and runs at lags and batches no prefill has (on the H200,
        2026-11-23, the one compilation of a whole serving run was the adaptive server's, and without this
        warm-up a mixed workload compiled two attention variants in an adaptive engine, none in a plain or a
        fixed one). It writes the dummy row's step-0 top-K, which only padding rows read."""
        self.worker.warm_eager()
        for spans in warm_spans(self.runner.limits):
            self.worker.catch_up([self._padding_lag(start, n) for start, n in spans], self.ring)

    def _padding_lag(self, start: int, pairs: int) -> LaggingDraft:
        """The dummy row's draft lagging over [start, start + pairs), token 0 throughout (start-up work only)."""
        return LaggingDraft(self.runner.limits.dummy_row, start, start + pairs, [0] * (pairs - 1))

    def measure_costs(self) -> None:
        """Time each candidate's step per cost bucket and build the policy (see the module docstring)."""
        lim = self.runner.limits
        device_seconds, launch_seconds = {}, {}
        for b in lim.cost_buckets:
            for choice, strategy in ((PLAIN, self.plain), (SPECULATIVE, self.worker)):
                device_seconds[(choice, b)], launch_seconds[(choice, b)] = _time_step(
                    strategy, [lim.dummy_row] * b, lim.page_size, self.cuda)
        self.policy = AdaptivePolicy(lim.cost_buckets, device_seconds, overlapped=self.cuda and lim.overlap,
                                     max_accept=lim.num_steps, launch_prior=launch_seconds if self.cuda else {},
                                     stalls=_compilations, catch_up_prior=self._time_catch_ups(),
                                     probe_budget=self.runner.config.speculative.adaptive_probe_budget)
        if lim.narrower_widths:
            width_seconds = {(w, b): (device_seconds[(SPECULATIVE, b)] if w == lim.num_draft_tokens else _time_step(
                self.worker.narrow(w), [lim.dummy_row] * b, lim.page_size, self.cuda)[0])
                for b in lim.cost_buckets for w in lim.tree_widths}
            policy = self._policy
            self.widths = WidthChooser(lim.tree_widths, width_seconds, lambda b: policy.host_seconds(SPECULATIVE, b),
                                       policy.join)

    def _time_catch_ups(self) -> dict[str, list[tuple[int, float]]]:
        """The catch-up's cost at two sizes far apart, over the dummy row: one request lagging CATCH_UP_SMALL
        positions, and min(R, CATCH_UP_REQUESTS) requests lagging CATCH_UP_LARGE each (within one forward): the
        seed of the policy's catch-up fits (AdaptivePolicy.catch_up_prior), {"device": [(positions, seconds)],
        "host": [...]}, each the median of TIMED_RUNS runs after WARMUP_RUNS (device: events around it on CUDA,
        else its wall time; host: its launch's time on CUDA, else 0, as `resolved` feeds them online)."""
        lim = self.runner.limits
        large = min(CATCH_UP_LARGE, lim.max_tokens_per_forward, lim.context_length - 1)
        requests = max(min(lim.max_running_requests, CATCH_UP_REQUESTS, lim.max_tokens_per_forward // large), 1)
        small = min(CATCH_UP_SMALL, large)
        prior = {"device": [], "host": []}
        for lagging in ([self._padding_lag(0, small)], [self._padding_lag(0, large)] * requests):
            positions = sum(g.pairs for g in lagging)
            device, host = _time_call(lambda lagging=lagging: self.worker.catch_up(lagging, self.ring), self.cuda)
            prior["device"].append((positions, device))
            prior["host"].append((positions, host))
        return prior

    def stats(self) -> dict | None:
        if self._policy is None:
            return None
        self._read_rounds()
        policy = self._policy if self._park is not None else self.policy  # (a park goes on: its steps added below)
        snapshot = {**policy.snapshot(), "detached_requests": self.detached_requests,
                    "attached_requests": dict(self.attached_requests)}
        if self._park is not None:  # the steps of the park under way, counted as the policy will count them
            steps = self._park.steps
            snapshot["chosen"][PLAIN] = snapshot["chosen"].get(PLAIN, 0) + steps
            snapshot["parked_steps"] += steps
        return snapshot if self.widths is None else {**snapshot, "tree_width": self.widths.snapshot()}

    # --- timing marks -----------------------------------------------------------------------------------------
    def _mark(self):
        """A point in the stream's work: a recorded timing event (CUDA), or the host clock (CPU, where the
        device work is the host's)."""
        if not self.cuda:
            return time.perf_counter()
        event = self._events.pop() if self._events else torch.cuda.Event(enable_timing=True)
        event.record(self._stream)  # named: record() alone looks the current stream up in Python each time
        return event

    def _elapsed(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


def _detached_by_cache(chunks: list[PrefillChunk]) -> frozenset[int]:
    """The chunks of requests admitted onto cached pages without the draft's KV (`Request.detached_at` set before
    their prefill, `joins_without_draft`): their drafts cannot be brought up to them, so they join detached."""
    return frozenset(i for i, c in enumerate(chunks) if c.request is not None and c.request.detached_at is not None)


def _compilations() -> int:
    """Triton's compilations in this process so far: each stalls the step that launched it (ops/compile_watch.py),
    so an epoch holding one measures the stall, not its choice (speculative/epoch_clock.py)."""
    return sum(compile_watch.compiles().values())


def _lagging(q, prefills_in_flight: int) -> LaggingDraft:
    """The pairs request `q`'s draft misses, as of a launch: its target holds positions up to q.committed plus one
    per decode step in flight (a lagging request's decode steps in flight are all plain steps: at most draft_lag of
    them; a lazy prefill in flight, `prefills_in_flight`, committed its positions at its launch)."""
    decodes = q.inflight - prefills_in_flight
    if decodes > q.draft_lag:
        raise InvariantError(f"request {q.request_id}: {decodes} decode steps in flight but its draft lags by only "
                             f"{q.draft_lag} positions, so a round's commits are not resolved yet")
    end = q.committed + decodes
    start = end - q.draft_lag
    return LaggingDraft(q.row, start, end, q.token_ids[start + 1:end])


def _time_step(strategy: DecodeStrategy, rows: list[int], max_kv: int, cuda: bool) -> tuple[float, float]:
    """Medians of one greedy decode step over `rows` (padding rows): (device seconds, host seconds of its launch).
    On CUDA the device's (events) and the launch call's; on the CPU the call's wall time, which is the device work
    there, and 0."""
    greedy = SamplingTensors.greedy()
    return _time_call(lambda: strategy.decode(rows, max_kv, greedy), cuda)


def _time_call(launch, cuda: bool) -> tuple[float, float]:
    """Medians over TIMED_RUNS calls of `launch` (after WARMUP_RUNS): (device seconds, host seconds of the call).
    On CUDA the device's (events around it) and the call's; on the CPU the call's wall time, which is the device
    work there, and 0."""
    for _ in range(WARMUP_RUNS):
        launch()
    device, host = [], []
    for _ in range(TIMED_RUNS):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            launch()
            host.append(time.perf_counter() - t0)
            end.record()
            end.synchronize()
            device.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            launch()
            device.append(time.perf_counter() - t0)
            host.append(0.0)
    return statistics.median(device), statistics.median(host)
