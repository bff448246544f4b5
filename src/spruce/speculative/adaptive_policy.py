"""The choice adaptive speculation makes before each decode step: a speculative round or a plain step.

Rule: pick the candidate with the most expected committed tokens per second for this batch,

    tokens/s(c) = bs * E[tokens per step | c] / t(c, bucket)

- E[tokens | plain] = 1. E[tokens | speculative] = the mean over the batch's requests of 1 + a_i, where a_i is
  the engine-wide mean of accepted drafts per round over the last ACCEPT_WINDOW request-rounds, every round but a
  collapsed request's retries (the population's mean: see `accepted_round`; before any round at all, the tree
  depth S: optimistic, so the first rounds measure it; over the first PRIOR_DECAY ones, shrunk towards S, see
  `prior_accept`), except for a request whose own EMA
  collapsed (below COLLAPSE_FRACTION, a tenth, of the engine-wide one): its own. Such a request thus counts ~1
  token in both candidates: it neither forces the batch to plain nor makes speculation look better than it is for
  the others. The line was half the engine-wide one until 2026-11-23. bench/replay_adaptive.py replays the
  acceptance a (5, 4, 8) round would have at every position of the short workload's 53 held-out requests (every
  request's mean 1.7 accepted drafts or more; bench/results/accept-trace-*) through this policy at concurrency 1:
  at half, dips put requests in plain steps, each left to be caught up for a retry, and the policy ran 2.4-9.1%
  behind fixed rounds under three cost models fitted to the H100 runs (5,580-9,632 plain steps, 38-66 catch-ups);
  at a quarter 0.6-3.1%; at a tenth 0.5-0.8% (~460 plain steps, the probes; 5 catch-ups). On the H100 itself the
  adaptive server at half ran 46-57% plain steps at concurrency 1 and 3-5% behind a fixed one. A request's own
  EMA above that line is not used: it is noisy (acceptance varies round to round), it is not re-measured while
  the request decodes plainly, and at concurrency 1 on the H100 (2026-11-23, rounds at 0.98 ms for 4.2 tokens
  against 0.32 ms plain steps: rounds pay from 3.4 tokens) requests whose EMA dipped below that stayed plain for
  the rest of their lives: 90% of the steps were plain, and the server was 16-19% behind a fixed one.
- A request's EMA is not measured while it decodes plainly, so a dip below the engine-wide one would stand for
  the rest of the request. On the H100 (128-token prompts, rounds committing ~4.3 tokens), runs of rejected rounds
  put 103 of 256 requests at concurrency 1 in plain steps until they ended: 42% of the steps were plain at ~3x a
  round's cost per token. So a collapsed request (EMA below a tenth of the engine-wide one) is retried (priced at
  the engine-wide acceptance) once its draft lags by `retry_after` positions (plain steps since its last round):
  RETRY_FIRST, doubled (up to RETRY_MAX) after each retry round that accepts less than half the engine-wide one,
  so a request whose text truly defeats the draft pays a catch-up ever more rarely; a retry that accepts resets
  its EMA to that round's count (the text moved on) and its backoff. A lower REQUEST_ALPHA makes a collapse take
  several rejected rounds in a row, and a request needs COLLAPSE_ROUNDS rounds before it can collapse at all: at
  concurrency 1 on the H100 a few rejected rounds early in a request read as a collapse, and such requests decoded
  plainly at 0.4x a round's tokens/s, though their rounds would have committed more.
- t(c, b), the seconds a step of c over bs requests costs, is bs times what a request's step of c really cost the
  engine at the load bucket once measured: busy wall seconds over the request-steps of epochs of c at the load
  (runs of about one request's life; prefills and everything between steps included; a drain, whose requests end
  while none arrive, dropped), whatever the step's own batch (a dip below the load's bucket takes the load's price
  per request, so its choice) (speculative/epoch_clock.py, which says why per request-step; before c has an epoch
  at the load, the figure at the nearest measured load, scaled as the other choice's figures scale, `_realized`;
  that share of the parts alone until c has any epoch). From 2026-11-23 to 2026-11-24 the figure was the epochs'
  ratio to their parts times the parts of a step at the load's bucket, and until 2026-11-23 busy seconds per step,
  whose drains priced their small steps as a full batch's. The parts below, which the policy times per step, price
  c until then. They miss what lies between decode steps: on the H100 with the engine in its own process
  (2026-11-23) they put rounds at concurrency 8 at 3.8x plain steps' tokens/s while a plain server was 1.3-1.5x
  faster than one running only rounds, whose arrivals each took a ~7.7 ms prefill.
  Realized figures are kept per load bucket, the bucket of the largest load among the last LOAD_WINDOW
  decisions, a decision's load being the requests the engine held (its batch, requests in their prefill, queued
  ones): a batch that dips while arrivals wait for their prefills is priced as the load it belongs to (at
  concurrency 32 on the H100, dips to bucket 24 met a figure measured in a level's drain, without arrivals, and
  each switched to rounds, caught the batch up and switched back). The requests held, not the batch alone: a
  level's first decode steps run over the first arrivals while the others prefill, and with the batch's size the
  ramp of every level on the H200 (2026-11-24, 1k shared prefix) was priced at load 1, its prefills in a batch-1
  step's epochs: plain steps there read 0.7-1.0 ms a step against 0.27 ms steps at concurrency 1, and concurrency
  1 ran rounds (1.18 tokens each) for half its steps in two passes of four, at 0.65x a plain server's tokens/s.
  Catch-ups are not in them (a switch's cost, priced when a switch is decided, below).
- Until then, t(c, b) = D(c, b) (+) H(c, b), both measured online per step of c over a batch of bucket b:
  - D, the step's device time: the span between events recorded at its launch's start and end (CUDA; on the
    CPU the launch's wall time, which is the device work there). Until c has run at b, the start-up table
    (speculative/adaptive.py, padding rows) stands in.
  - H, the host's time per step (launching, reading results, scheduling, serving), in three parts:
    - E, the host seconds of launching the step itself (CUDA; measured around the launch; until c has run at b,
      the start-up table's launch time). On the CPU the launch is the device work: it is in D, and E is 0;
    - R, the host seconds of reading and applying the step's own results (its resolve). Under overlap a step's
      results are read after the next step's launch, so without this split a round's resolve (more tokens per
      request, the acceptance bookkeeping) was charged to the step after it, usually a plain step: rounds looked
      cheaper and plain steps dearer than they are (test_round_resolve_is_charged_to_the_round). Until c has run
      at b it borrows the other candidate's R;
    - X, everything else between one decode launch and the next (scheduling, building outputs, sending them to
      the server): the interval less waits on the device, less E and R. A candidate is priced by its own X, the
      median of its last samples from steady steps (the step before had the same choice: under overlap the
      interval after a switch holds the other choice's result work), once it has OWN_HOST_SAMPLES of them; until
      then by the bucket's pool over both candidates. A candidate that runs rarely gets steady samples from probe
      epochs (below). Pooled alone, X misprices: with the engine in its own process (H100, 2026-11-23) a round's X
      was ~0.7 ms at batch 8 (four tokens per request to detokenise, output and send) against ~0.1 ms for a plain
      step, and the pool, made of rounds' samples, priced plain steps at 2.3x their real cost.
  - (+) is max when the host and the device overlap (CUDA with overlap scheduling), + otherwise.
  - D, E and R are each the median of their last MEDIAN_WINDOW samples (a start-up table's value, or the other
    choice's R, counted as the first), so one stalled step (a garbage collection, say) moves nothing; X and W are
    running means (an EMA once they have enough samples) that drop a sample OUTLIER_FACTOR times their value.
  - W, the whole launch-to-launch interval of a steady step (the step before it had the same choice, with no
    prefill between), is a floor: t = max(D (+) H, W). The parts miss what a step costs the serving process
    outside the engine: on the H100 at concurrency 8-32, a server running only rounds took 1.3-2x a plain
    server's time per step while D, E, R and X put rounds within 10% of plain steps (the event loop's work per
    committed token, and its GIL, fall on later intervals). A candidate without W is priced by its parts (so it
    gets tried), and its first steady steps measure W. A W not re-measured in WALL_TTL decisions at its bucket
    lapses: W is measured only while its choice runs, and a stale one (a plain step's at batch 1 measured while a
    concurrency-64 level drained) kept the next level's batch-1 steps in rounds for 12% of them.
  H never sees device time (the waits are taken out), so a wrong D is corrected only by measuring D: the
  start-up table runs padding rows, which attend to no context, and a round reads its context more than a plain
  step does.
- A round over requests whose draft lags (adaptive plain steps or a lazy prefill since its last catch-up) first
  runs the draft's catch-up over the missing positions; its cost, D_c(n) and H_c(n) for n missing positions (each
  fitted online as fixed + per-position seconds, seeded by two catch-ups timed at start-up: `LinearCost`), is taken
  out of the samples of the step that ran it and added to the round's D and H for that batch, shared by the rounds it
  opens: the batch's mean tokens left per request over the expected tokens per round (at least one round). Charged
  to one round, a lazy prefill's catch-up (128 prompt positions: 4 ms against 0.7 ms rounds) kept a batch that gains
  2.5x from rounds decoding plainly.
- A round also pays the draft's work on new prompts: while rounds go on, every request that replaces a finished
  one needs its draft extended over its prompt (eagerly after its prefill, or by a catch-up), which plain steps
  never need. Requests finish at (tokens per round) / (tokens per request) per round, so that many prompt
  extends are added to a round's cost; a prompt extend costs what the eager extends cost per request they
  completed (EMA), or, before any, a catch-up over one prompt. Prefill steps break the clock, so no other term
  sees this cost: on the H100 at concurrency 8 it was ~2.7 ms per request against 1.1 ms rounds.
- While one candidate runs, the other is not measured (acceptance is measured only in rounds; costs only by
  running): when an epoch of the model's choice at a bucket completes and `probe_after` such epochs have since the
  last probe, the next epoch runs the other candidate ("probe"). `probe_after` is 1 .. 64 epochs (a probe that
  leaves the model's choice as it was doubles it, a change of the model's choice resets it); once the other
  candidate has a realized figure, probes are also spaced so they cost at most PROBE_BUDGET of the time: a probe
  epoch commits about an epoch's tokens at the other's price, (ratio - 1) epochs of the model's choice more. Over
  every load bucket together, probes' expected excess stays within PROBE_BUDGET of the busy time plus
  PROBE_ALLOWANCE seconds (a probe that would exceed it waits; the engine's budget is `probe_budget`, set by
  speculative_adaptive_probe_budget, PROBE_BUDGET by default); under rounds a load's own spacing takes only
  (SWITCH_MARGIN over rounds' lead) squared of the budget, a twentieth at least (`_probe_share`; linear and a
  quarter at least from 2026-11-26, replaying the 128-token trace at concurrency 1: 400 plain steps against 640 and
  0.5% behind fixed rounds against 0.9%; squared, session 34: 0.39% behind), and under plain steps so do its probes
  of rounds by plain steps' lead where other loads' rounds have re-measured the engine-wide acceptance since rounds
  last ran at this load (session 46; else the whole budget: only rounds measure the acceptance).
  A probe of rounds under plain steps ends early once its request-rounds have settled the acceptance and plain
  steps still lead by PROBE_CUT_LEAD at it (`_cut`, session 37): from 8 requests up a probe's first 32-40 rounds
  measure what its ~110 would; at any load once they lead rounds priced at its own rounds' acceptance plus
  PROBE_CUT_Z standard errors (session 53: at concurrency 1 a probe's ~100 rounds cut to ~32).
  Those prices are scaled by what probes of that choice were measured to cost over their price (`_probe_factor`,
  1 to PROBE_COST_FACTOR_MAX; `_measured_probe`, 2026-11-26: on the H100 a pass with a probe trailed those without
  by several times the probe's price), at a load where such probes were measured by that load's own figure (1 to
  PROBE_COST_FACTOR_LOAD_MAX; session 38: at 64 with the 1k shared prefix a probe of rounds cost ~58 times its price);
  at a load where the probed choice has no epoch, the price takes its figure from the nearest load unscaled where
  that is dearer than the figure carried as the model choice's scale (`_probe_price`, session 39). A probe of rounds
  is priced at the acceptance measured (the window's mean), not the cold start's prior, which is optimism for
  decisions, not a forecast of what the probe will cost (`_at_measured_acceptance`, session 57).
  PROBE_BUDGET was 1% until 2026-11-25: the H200's bar runs with the 1k shared prefix had adaptive 2-4% behind a
  plain server at concurrency 1 in every run, the passes with a probe epoch of rounds (~110 rounds of 1.2 tokens,
  0.74 ms each against 0.27 ms plain steps: ~48 ms more on a 2.6 s level) 3-6% behind and those without 1-3%;
  replaying such
  acceptance (0.19 drafts a round) at concurrency 1 with those costs (bench/replay_adaptive.py's replay, 1024
  requests), probes cost 0.96% of plain's tokens/s at 1%, 0.45% at 0.5% (387 rounds against 819), 0.21% at 0.25%.
  Half the budget doubles the time a change of workload waits for its probe (the run's spacing at concurrency 1
  was 139 epochs of one 40 ms request each: ~6 s, now ~11 s). 0.5% until session 58 (2026-11-28), 0.2% since: with
  probes of rounds priced at the measured acceptance (session 57), every H200 x4 bar run with the 1k shared prefix
  still made one at load 1 within its 256 concurrency-1 requests (~40 ms served: its request's rounds, the catch-up,
  the arrivals that joined with their drafts while it waited), its pass ~1.7 points below the others and the level
  ~0.4 below plain, which "never slower" cannot absorb; at 0.2% the spacing there is ~600 requests
  (bench/replay_probe_budget.py at the bar's step costs: -0.13% against plain over 1024 requests, -0.23% at 0.5%;
  after a change of workload to rounds winning 2:1, rounds back within a mean of 286 requests, 562 at most, against
  124 and 225 at 0.5%). While the other's realized figure rests on fewer than three epochs and prices it above its
  parts, both take it at its parts (`_probe_price`): a lone epoch that caught a stall must not keep its choice from
  the probe that re-measures it. The catch-up a probe epoch of plain
  steps leaves to the next round lands in that round's epoch, which the low median over its window keeps out of
  the rounds' figure (it is the probe's cost), and it is counted in the probe's expected cost (`_probe_cost`): on
  the H200 (2026-11-23, 128-token prompts) the first decision after a probe at concurrency 1 weighed a catch-up of
  30-99 positions against the request's last tokens and found rounds within the 2% margin of plain steps, so the
  request ended plainly (9 of the 14 switches to plain steps at concurrency 1 in five passes, with 13 probes).
- A switch of a load's model choice needs the challenger expected to commit SWITCH_MARGIN (10%) more tokens per second
  than the incumbent, either way once both are priced by realized figures at the load (`_margin`; before that, and
  before a load has a model choice, plain steps are the incumbent: ties go to the cheaper step with nothing to catch
  up). A realized figure is the low median of a few epochs, each about one request's life, and epochs of one choice at
  one load read +-30% of each other (H200 `-065410`, rounds at concurrency 8: 207-408 us a request-step within 1.6 s),
  so the figures of two candidates that truly differ by 20% cross now and then; a margin below that noise turns each
  crossing into a switch and its catch-up. On the H100 (16296f6, 2026-11-26, 128-token prompts, where rounds lead
  plain steps by ~19% at concurrency 8 and 30-50% at 32-64), with rounds held only while 2% ahead, the switches to
  plain steps came with plain steps priced from 1.9% behind to 6.7% ahead (rounds' figure at 8 read 197-228 us a
  request-step at those moments against the level's 144-150), and one at concurrency 32 ran 2144 plain steps, 23%
  behind the fixed server there; with the 1k shared prefix (rounds 2x behind) a switch into rounds came with rounds
  8.6% ahead as priced and ran ~1 s of rounds (704 in that pass), 20% behind the plain server. The margin costs at
  most its fraction where the loser truly loses by less.
  A challenger whose figure there is mostly probes' epochs (fewer than SETTLED_EPOCHS of its own) must win by
  PROBED_MARGIN (25%): each probe epoch starts over the state the model choice left, and a few of them read the
  probed choice anywhere from its steady cost to 1.7x it (`_margin` has the figures). The first probe's epoch after
  a switch away from a choice is its figure alone (EpochClock.record drops the epochs the switch froze, which may
  have measured a host that has moved since); until 2026-11-26 it joined them and could not move their low median.
  Where plain steps are the load's model choice and rounds' realized figure rests on fewer than SETTLED_EPOCHS
  epochs while plain steps' is settled, rounds must also win by SWITCH_MARGIN by their parts (`_rounds_win`): that
  figure is one or two probe epochs, which inherit the state plain steps left (a probe of rounds after plain steps
  starts over requests that arrived together), and one probe epoch begun over a level's first 5 requests put
  rounds 15% ahead of plain steps while the fixed server made 0.55x the plain one's tokens/s (H200, 697c8ca,
  2026-11-25). Until 2026-11-26 the margin was 10% into rounds by the parts and 2% once both were realized (on the
  H100 at concurrency 1, 2026-11-23, rounds' realized figure put them 10% ahead while a fixed server was 23-40%
  ahead of a plain one, and a 10% margin without hold kept the adaptive server in plain steps for half its steps),
  and plain steps took over from rounds as soon as rounds were not 2% ahead.
- A drain: a decision while the requests held (the batch, those in their prefill and queued ones) are below half
  its load bucket (`_steady`: a level's last requests) runs the load's model choice, changes it not, and starts no
  probe (`_explore`). Such a batch's own price is the catch-up its few requests owe over the few tokens they have
  left, which says nothing of the load's steady state, and the changed choice stood for the load's next level: on
  the H100 (762c84e, 2026-11-26, 128-token prompts, where rounds lead by 20-40% at 8-64) a plain probe that began in
  a concurrency-64 level's drain left its 4 last requests 35 positions behind, rounds over them priced at 30k
  tokens/s against plain steps' 33k, the load switched to plain steps, and the next concurrency-64 level ran plain
  steps until it switched back 0.4 s in (17% behind the fixed server); loads 8 and 32 switched so at batches of 2.
  Until session 35 only a batch with no other request held was a drain: on the H200 x4 (834dffed, 2026-11-26) a
  concurrency-64 level's last 5 requests, another held (in its prefill or queued), started a plain probe and, 2
  left, switched the load to plain steps. A small batch with half its load or more held behind it (a ramp, or a KV
  pool too full to admit them) decides as any other: a load whose batch never reaches half of it would otherwise
  never change its choice.
- A decision, a model choice or a probe's, stands for further steps whose batch falls in the same cost bucket, or in
  one whose latest model choice was the same (`repeat`): rounds for up to `REUSE_STEPS`, plain steps to the end of
  their epoch (and, a model choice in its cost bucket with no probe due, through up to STANDING_EPOCHS more:
  `_epoch_stands`) or to a prefill that extends arriving requests' drafts (`drafts_joined`: they would need no
  catch-up; otherwise, while rounds do not run, nothing that prices them moves but the batch, whose bucket `repeat`
  checks, and lags and tokens left, which only favour plain steps further); a decided step took ~275 us more than a
  standing one served at concurrency 1 on the H200 (2026-11-25), and with REUSE_STEPS one came every ~26 steps, every
  ~64 since). Those steps skip the evaluation and the timing, so an
  adaptive engine costs the host what a plain engine does while it decodes plainly, and what a fixed one does while it
  runs rounds. Only the steps that decide are timed (host interval, resolve, device events); every step counts in its
  epoch. Deciding each step cost the H100's host ~0.26 ms (pycode-19m, 2026-11-23, offline at concurrency 1: a plain
  step that decided took 0.53 ms launch to launch against a plain engine's 0.27 ms), so rounds, which decided every
  step, were priced (correctly) below a plain engine's steps, and at concurrency 64 a batch that changed at almost
  every step (a request ends every second step) decided almost every plain step too. A probe's steps decided each
  until 2026-11-25 (session 27): a probe epoch of plain steps under rounds was 128 decided steps, each ~0.26 ms of
  host work more than a standing one, which both cost the probe that much and put it into the probe's epoch, so the
  challenger's realized figure read its steps at up to twice their steady cost. Another bucket, an
  epoch's end (a probe may be due), a collapsed request's retry and an engine-wide acceptance that drifted by more
  than REUSE_ACCEPT_DRIFT from the one the decision was priced at decide afresh (standing rounds' acceptance is read
  every few rounds, speculative/adaptive.py READ_EVERY); a request's own acceptance is read at the next decision.

Pure Python and torch-free: the unit tests feed it numbers.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import itertools
import operator
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

from spruce.config import ADAPTIVE_PROBE_BUDGET
from spruce.errors import InvariantError
from spruce.runtime.linear_cost import LinearCost
from spruce.speculative.epoch_clock import EPOCH_MIN, SETTLED_EPOCHS, Epoch, EpochClock, epoch_steps

log = logging.getLogger("spruce.adaptive")

PLAIN, SPECULATIVE = "plain", "speculative"
CHOICES = (PLAIN, SPECULATIVE)
REQUEST_ALPHA = 0.25  # per-request acceptance EMA: a few rejected rounds in a row do not read as a collapse
COLLAPSE_ROUNDS = 8  # rounds a request must have had before its EMA can count as collapsed
COLLAPSE_FRACTION = 0.1  # ... and the fraction of the engine-wide acceptance its EMA must fall below
RETRY_FIRST, RETRY_MAX = 16, 1024  # plain positions before a collapsed request is retried (doubling backoff)
ACCEPT_WINDOW = 512  # request-rounds behind the engine-wide acceptance (the prior of requests without rounds)
ACCEPT_STALE_STEPS = 4096  # plain steps after which a request-round no longer prices rounds (`accepted_rounds`) ...
ACCEPT_FRESH_MIN = 64  # ... once this many request-rounds have come since (the window never thins below it)
PRIOR_ROUNDS = 32  # pseudo-rounds at S the prior holds beside an empty window, fewer as rounds are counted ...
PRIOR_DECAY = 128  # ... none from this many request-rounds on (`prior_accept`)
COST_ALPHA = 0.1  # the EMAs of X and W (after their first samples), and the catch-up fits' forgetting
OUTLIER_FACTOR = 8.0  # an X or W sample this many times its value is an idle gap or a stall: ignored
PROBE_FIRST, PROBE_MAX = 1, 64  # epochs of the model's choice between probe epochs (doubling while nothing changes)
OWN_HOST_SAMPLES = 3  # steady host samples (X) of a choice at a bucket before they price it instead of the pool
PROBE_BUDGET = ADAPTIVE_PROBE_BUDGET  # at most this fraction of decode time goes to probes (their modelled excess
# cost; `AdaptivePolicy.probe_budget`, speculative_adaptive_probe_budget, is the engine's) ...
PROBE_ALLOWANCE = 0.15  # ... plus these seconds, so that the first probes (learning a load) need not wait
PROBE_SHARE_MIN = 0.05  # plain probes under rounds get PROBE_BUDGET times (SWITCH_MARGIN over rounds' lead) squared,
# down to this share of it (`_probe_share`)
PROBE_STEPS_FACTOR = 2  # a probe ends after this many times its epoch's steps even if no epoch completed
PROBE_CUT_REQUEST_ROUNDS = 256  # a probe of rounds under plain steps ends once it counted this many request-rounds
# (and plain steps still lead by PROBE_CUT_LEAD, below) ...
PROBE_CUT_MIN_ROUNDS = 32  # ... or once it counted this many and plain steps lead by it even at its own rounds'
PROBE_CUT_Z = 3.0  # acceptance plus this many standard errors (`_cut`)
PROBE_COST_ALPHA = 0.25  # the EMA of probes' measured over priced cost, per probed choice (`_measured_probe`) ...
PROBE_COST_FACTOR_MAX = 16.0  # ... which scales their price by 1 to this much (`_probe_factor`) ...
PROBE_COST_FACTOR_LOAD_MAX = 64.0  # ... or, at a load where probes of that choice were measured, to this much
REUSE_STEPS = 32  # a model choice of rounds stands for at most this many more steps in its cost bucket
STANDING_EPOCHS = 4  # epochs of plain steps after a decided one that may open without a decision (`repeat`)
PARK_EPOCHS = 64  # epochs' steps an all-detached batch's plain steps may run parked, untold (`park`): with 8, one
# epoch of every nine ran told (tickets, epoch ends, decisions); 12-23% of the plain steps at concurrency 1-64 on the
# H200 x4 (38205a6, 1k shared prefix), and an adaptive server on 64 beside it in the same runs led it by +3.1 +- 1.8%,
# +3.2 +- 3.6% and +3.9 +- 3.8% at 8/32/64 (-0.7 +- 0.7% at 1; four runs, session 60). A probe of rounds comes due
# at most that many epochs late (64 epochs of 128 plain steps: ~2 s at concurrency 1 there)
REUSE_ACCEPT_DRIFT = 0.2  # ... while the engine-wide acceptance stays within this fraction of what it was priced at
SWITCH_MARGIN = 0.1  # a load's model choice changes when the other is expected to commit this much more per second
PROBED_MARGIN = 0.25  # ... or this much, while the other's figure there is mostly probes' epochs (`_margin`)
PROBE_CUT_LEAD = PROBED_MARGIN  # a probe of rounds that counted PROBE_CUT_REQUEST_ROUNDS ends if plain steps, priced
# at their acceptance, still commit this much more per second (`_cut`)
MEDIAN_WINDOW = 7  # a step's device, launch and resolve seconds: the median of this many recent samples
WALL_TTL = 128  # decisions at a bucket after which a choice's whole-interval floor (W), not re-measured, lapses
LOAD_WINDOW = 32  # decisions: the load bucket is the bucket of the largest load among this many recent ones
STALL_RATIO = 2.0  # a lone epoch reading more than this over its parts is taken for a stall (`_probe_price`)
STEADY_WAIT = 16  # epochs a due probe waits for a steady batch (`_steady`) before it starts over any batch
DETACH_GAP = 0.05  # seconds: an idle gap shorter than this (a client's round trip) keeps the load before it for
# `detach_blocker` (`_detach_load`); a served level's change of concurrency leaves seconds


def _other(choice: str) -> str:
    return SPECULATIVE if choice == PLAIN else PLAIN


@dataclass
class Decision:
    """One step's choice and its reason: each candidate's expected tokens per step and seconds per step."""

    bucket: int
    batch_size: int
    choice: str  # PLAIN or SPECULATIVE
    reason: str  # "model" (the higher expected tokens/s), "probe" (re-measuring the other candidate) or
    # "detached" (plain steps while a detached request is in the batch, whatever the model or a probe would run)
    tokens_per_step: dict[str, float]  # per request: 1 (plain), mean 1 + a_i (speculative)
    step_seconds: dict[str, float]  # t(c, bucket), the round's including its catch-up
    catch_up_positions: int = 0  # positions the batch's drafts miss (a round catches them up first)

    def tokens_per_second(self, choice: str) -> float:
        return self.tokens_per_second_at(choice, self.step_seconds[choice])

    def tokens_per_second_at(self, choice: str, seconds: float) -> float:
        """The batch's expected tokens per second if a step of `choice` took `seconds`."""
        return self.batch_size * _rate(self.tokens_per_step[choice], seconds)

    def as_dict(self) -> dict:
        return {"choice": self.choice, "reason": self.reason, "batch_size": self.batch_size,
                "tokens_per_step": dict(self.tokens_per_step), "step_seconds": dict(self.step_seconds),
                "catch_up_positions": self.catch_up_positions,
                "tokens_per_second": {c: self.tokens_per_second(c) for c in CHOICES}}


@dataclass(slots=True)
class _RequestAcceptance:
    """One request's acceptance: its EMA, and when a low estimate is retried (see the module docstring)."""

    ema: float
    rounds: int = 1  # rounds measured
    retry_after: int = RETRY_FIRST  # draft lag (positions) from which a collapsed EMA is retried
    retrying: bool = False  # a round was launched on the prior: the next acceptance judges the retry

    def collapsed(self, engine_accept: float) -> bool:
        """After COLLAPSE_ROUNDS rounds at least, its EMA is below COLLAPSE_FRACTION of the engine-wide acceptance
        (AdaptivePolicy.engine_accept)."""
        return self.rounds >= COLLAPSE_ROUNDS and self.ema < COLLAPSE_FRACTION * engine_accept


@dataclass
class _BucketState:
    probe_after: int = PROBE_FIRST  # epochs
    epochs_since_probe: int = 0  # epochs of `model_choice` completed since the last probe epoch
    spacing: int = PROBE_FIRST  # epochs between probes as `_explore` last computed them (probe_after or the budget's)
    probe_waiting: bool = False  # a probe of rounds was due at an epoch's end over a steady batch, affordable, and
    # held back by detached requests: requests join with their drafts until it starts (`detach_blocker`)
    probing: bool = False  # steps run the other choice until its epoch is complete ...
    probe_left: int = 0  # ... or until this many more of its decisions at this load came without one completing
    probe_counted: int = 0  # the request-rounds the policy had counted when the probe began (`_cut`) ...
    probe_drafts: float = 0.0  # ... the drafts they had accepted ...
    probe_squares: float = 0.0  # ... and the sum of those drafts' squares
    rounds_counted: int = 0  # ... and when rounds last ran here (a probe of rounds ended, or rounds stopped being the
    # model's choice): request-rounds counted since came from other loads (`_probe_share`'s fresh acceptance)
    model_choice: str | None = None
    check: bool = False  # the model's choice changed away from a settled one: its first probe is not budgeted
    last: Decision | None = None
    measure: _ProbeMeasure | None = None  # the probe under way (or just ended) whose cost is being measured


@dataclass
class _ProbeMeasure:
    """What a probe was priced at and what its cost is measured against (`AdaptivePolicy._measured_probe`)."""

    choice: str  # the probed choice
    priced: float  # its expected excess seconds as priced (`_probe_cost`, before `_probe_factor`) ...
    steps: int  # ... for an epoch of this many steps (a cut probe's price is scaled to the steps it ran)
    catch_up: float  # the part of that which is its catch-up (priced, not measured: epochs leave catch-ups out)
    model_seconds: float  # the model choice's realized busy seconds per request-step at the load
    model_tokens: float  # ... and its tokens per request-step (1 + the engine-wide acceptance for rounds)
    drafts: float  # the drafts of the request-rounds the policy had counted when the probe began ...
    rounds: int  # ... and those request-rounds (a probe of rounds commits 1 + its own rounds' drafts a request-step)
    excess: float | None = None  # the probe epoch's busy seconds over what its tokens cost at `model_seconds`


@dataclass
class AdaptivePolicy:
    """Chooses plain or speculative per decode step; fed by the adaptive strategy (speculative/adaptive.py).

    buckets: the cost buckets (Limits.cost_buckets); device_seconds: the start-up table {(choice, bucket): D} for
    every pair (the prior of D); overlapped: host and device run concurrently (max) rather than one after the other
    (+); max_accept: S (the optimistic prior); launch_prior: the start-up table's host seconds of launching each
    (choice, bucket) (the prior of E; none: 0); clock: seconds (tests pass a fake one); stalls: a count that grows
    at each stall of the process (Triton's compilations: an epoch holding one is dropped, speculative/epoch_clock.py;
    none: 0); catch_up_prior: catch-ups timed at start-up, the seed of the catch-up cost fits (none: unseeded)."""

    buckets: tuple[int, ...]
    device_seconds: dict[tuple[str, int], float]
    overlapped: bool
    max_accept: int
    launch_prior: dict[tuple[str, int], float] = field(default_factory=dict)
    clock: Callable[[], float] = time.perf_counter
    stalls: Callable[[], int] = lambda: 0
    catch_up_prior: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # the start-up catch-ups:
    # {"device": [(positions, seconds), ...], "host": [...]}, the seed of each catch-up fit (LinearCost)
    launch_seconds: dict[tuple[str, int], float] = field(default_factory=dict)  # E, measured
    other_host_seconds: dict[int, float] = field(default_factory=dict)  # X per bucket, pooled over choices
    own_host_seconds: dict[tuple[str, int], float] = field(default_factory=dict)  # X of steady steps per choice
    wall_seconds: dict[tuple[str, int], float] = field(default_factory=dict)  # W: launch to launch, steady steps
    wall_decision: dict[tuple[str, int], int] = field(default_factory=dict)  # its bucket's decision count then
    resolve_seconds: dict[tuple[str, int], float] = field(default_factory=dict)
    measured_device_seconds: dict[tuple[str, int], float] = field(default_factory=dict)
    global_accept: float | None = None
    chosen: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CHOICES, 0))
    probes: int = 0
    probes_cut: int = 0  # probes of rounds ended early, their acceptance settled (`_cut`)
    probe_seconds: float = 0.0  # the probes' expected excess seconds (`_probe_cost`), summed
    probe_cost_factor: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CHOICES, 1.0))  # per probed
    # choice, the EMA of probes' measured over priced cost (`_measured_probe`) ...
    probe_cost_factor_at: dict[tuple[str, int], float] = field(default_factory=dict)  # ... and per (choice, load)
    catch_ups: int = 0
    catch_up_positions: int = 0
    retries: int = 0  # requests retried in a round (collapsed: EMA below a tenth of the engine-wide one)
    draft_prompt_seconds: float | None = None  # EMA of the eager draft extends' seconds per prefill launch
    draft_prompt_requests: float | None = None  # EMA of the requests each of those prefills completed
    probe_budget: float | None = None  # the fraction of decode time probes may spend (None: PROBE_BUDGET)

    def __post_init__(self):
        if self.probe_budget is None:
            self.probe_budget = PROBE_BUDGET
        missing = [(c, b) for c in CHOICES for b in self.buckets if (c, b) not in self.device_seconds]
        if missing:
            raise ValueError(f"device_seconds lacks {missing} (buckets {self.buckets})")
        self._state = {b: _BucketState() for b in self.buckets}
        self._bucket_of = [next(b for b in self.buckets if b >= n) for n in range(self.buckets[-1] + 1)]  # by size
        self._last_launch: tuple[float, str, int, bool] | None = None  # the last decode launch: (time, choice,
        # bucket, whether the step before it (with no prefill between) had the same choice: a steady step)
        self._previous_choice: str | None = None  # the last decode step's choice (None after a prefill)
        self._not_host = 0.0  # seconds since then that were not host overhead (waits, ...)
        self.catch_up_device = LinearCost(COST_ALPHA, self.catch_up_prior.get("device"))
        self.catch_up_host = LinearCost(COST_ALPHA, self.catch_up_prior.get("host"))
        self._reuse_left = 0  # further steps the last decision (a model choice or a probe's) stands for
        self._epochs_stood = 0  # epochs the last decision (plain steps) opened since, undecided (`repeat`)
        self._reuse_bucket = 0  # ... in this cost bucket
        self._reuse_choice: str | None = None  # ... of this choice (a model choice or a probe's)
        self._reuse_idle = False  # an idle gap came since: a batch of a lower cost bucket may not reuse it
        self._reuse_accept = 0.0  # ... priced at this engine-wide acceptance
        self._probe_stood: tuple[_BucketState, str, int] | None = None  # after a probe's decision: its load's
        # state, its choice, and that choice's steps counted then (the steps that stood after it shorten the probe)
        self._probe_load: int | None = None  # the load bucket whose probe is under way (at most one: `_leave_probe`)
        self._arrivals = (0.0, 0.0)  # the last decision's (request_tokens, new_positions): steady_choice prices the
        # draft's work on arriving prompts as decide does
        self._model_choice: dict[int, str] = {}  # per (batch) bucket, its latest model choice
        self._accept_window: collections.deque = collections.deque(maxlen=ACCEPT_WINDOW)  # counted rounds' drafts
        self._accept_sum = 0.0  # their sum
        self._accept_stamps: collections.deque = collections.deque(maxlen=ACCEPT_WINDOW)  # plain steps before each
        self._accept_counted = 0  # request-rounds counted since the start (the prior's shrinkage ends at a window's)
        self._accept_drafts = 0.0  # ... and the drafts they accepted (a probe's own acceptance: `_ProbeMeasure`)
        self._accept_squares = 0.0  # ... and the sum of their squares (its spread: `_cut`)
        self.epochs = EpochClock(self._parts_seconds, self.stalls)  # realized over modelled seconds (prefills in)
        # (speculative/epoch_clock.py)
        self._recent_loads: collections.deque = collections.deque(maxlen=LOAD_WINDOW)  # loads decided
        self._peak_load = 0  # the largest load decided or batch stepped in this epoch since the last idle gap ...
        self._peak_before = 0  # ... and in the epoch before it (`_saw_load`, `_detach_load`) ...
        self._peak_epoch: Epoch | None = None  # (the epoch `_peak_load` is this one's)
        self._gap: tuple[int, float] | None = None  # ... and, from an idle gap until the next ask, the one before it
        # and when the gap began
        self._carried_load = 0  # the load before the last idle gap, if that gap was a round trip (`_detach_load`)
        self._decisions: collections.Counter = collections.Counter()  # decide() calls per (batch) bucket
        self._parked: tuple[int, int] | None = None  # while the strategy runs parked steps (`park`): the load
        # bucket and the epoch target they were granted at
        self._epochs_at_unpark = -1  # epochs measured when the last park ended: the next waits for one more
        self._all_detached = False  # the last decided batch held detached requests only (`decide`): a park may follow
        self.parks = 0  # parks granted (/metrics) ...
        self.parked_steps = 0  # ... and the plain steps they ran
        self._tables: dict | None = None  # snapshot's cost tables and decisions, rebuilt after they change
        self._counts: dict[str, dict] = {"other_host": {}, "wall": {}}  # samples behind those tables' entries
        self._windows: dict[str, dict] = {"device": {}, "launch": {}, "resolve": {}, "own_host": {}}  # their
        # recent samples

    # --- the choice ---------------------------------------------------------------------------------------------
    def bucket_for(self, batch_size: int) -> int:
        """The cost bucket of a batch of `batch_size` requests: the smallest bucket that holds it."""
        try:
            return self._bucket_of[batch_size]
        except IndexError:
            raise ValueError(f"batch size {batch_size} exceeds the largest cost bucket {self.buckets[-1]}") from None

    def steady_choice(self, batch_size: int) -> str:
        """The choice for a batch of `batch_size` requests whose drafts are current, at the engine-wide acceptance:
        what a request joining it should expect, so whether its prefill may leave the draft's extend to a later
        catch-up (speculative/adaptive.py). Not the last decision's choice: that one weighs the catch-ups the
        batch owes, and near a request's end a catch-up no longer pays, so a plain choice there made the next
        request's prefill lazy, whose catch-up (~10 ms for 128 prompt positions on the H100) then kept it plain
        too: at concurrency 1, 95% of the steps were plain while rounds were 2.3x plain's tokens/s.

        Priced as `decide` prices such a batch, the draft's work on arriving prompts included (the last decision's
        request and prompt lengths): without it, where rounds are priced by their parts, a batch that decide kept in
        plain steps had each new request's prefill extend its draft eagerly for nothing (offline on the H100 with
        the 1k shared prefix, 2026-11-23: TTFT +1.1 ms a request, every step plain)."""
        load = self._load_bucket(batch_size)
        spec_tokens, realized, parts = self._steady_prices(load, batch_size)
        return SPECULATIVE if self._rounds_win(load, spec_tokens, realized, parts) else PLAIN

    def _steady_prices(self, load: int, batch_size: int) -> tuple[float, dict[str, float],
                                                                  Callable[[], dict[str, float]]]:
        """A batch of `batch_size` requests at load bucket `load` whose drafts are current, as `decide` prices it:
        the tokens a round commits per request at the engine-wide acceptance, each choice's step seconds (realized
        figures), and a thunk of them by their parts alone; rounds' with the draft's work on arriving prompts (the
        last decision's request and prompt lengths)."""
        spec_tokens = 1.0 + self.prior_accept()
        request_tokens, new_positions = self._arrivals

        def price(choice: str, realized: bool) -> float:
            if choice == PLAIN:
                return self._priced(PLAIN, load, batch_size, 0, 1.0, 0.0, 0.0, 0.0, realized)
            return self._priced(SPECULATIVE, load, batch_size, 0, 1.0, batch_size * spec_tokens, request_tokens,
                                new_positions, realized)

        return spec_tokens, {c: price(c, True) for c in CHOICES}, lambda: {c: price(c, False) for c in CHOICES}

    def rounds_out_of_reach(self, batch_size: int, load: int | None = None) -> bool:
        """Rounds over a steady batch of `batch_size` requests whose drafts are current, at load bucket `load` (None:
        `_load_bucket`'s), are priced (realized figures, as `decide` prices them) more than PROBED_MARGIN behind
        plain steps' tokens/s: no decision there takes them unless their price moves by about half (to SWITCH_MARGIN
        ahead). So plain steps need not be settled there before a request is detached (`detach_blocker`), and a
        request that joins with its draft there leaves its draft's work to a probe's catch-up
        (speculative/adaptive.py, `_lazy_chunks`)."""
        load = self._load_bucket(batch_size) if load is None else load
        spec_tokens, realized, _ = self._steady_prices(load, batch_size)
        return not _ahead(spec_tokens, realized, -PROBED_MARGIN)

    def detachable(self, batch_size: int) -> bool:
        """Whether a request joining a batch of `batch_size` may be detached: decode plainly to its end with no draft
        state at all (speculative/adaptive.py: no draft extend, no features kept, the plain engine's own step). Only
        where no round is expected over its life: at the load it joins (`_detach_load`) the model choice is plain steps,
        settled (SETTLED_EPOCHS epochs of its own), or not rounds where rounds are priced more than PROBED_MARGIN
        behind plain steps (`rounds_out_of_reach`: settling could not give them the load), no probe under way or
        owed (`check`), and no probe of rounds waiting
        for detached requests to end (`probe_waiting`, set by `_explore`: one was due, affordable, over a steady batch,
        and a detached request held it back (`decide`'s rounds_blocked); until it starts, arriving requests join with
        their drafts, so that it waits at most one request's life). Only where rounds are priced within PROBED_MARGIN of
        plain steps' tokens/s, both by their parts (rounds priced by a figure borrowed from another load, scaled,
        against plain steps' own figure came within it at load 32 on the H100 x4 at eb9d836, where their device time
        alone, 1.05 ms a round against 0.28 for a plain step at 1.18 tokens a round, put them at about a third): a probe
        of rounds further behind could not give them the load (they would have to win by PROBED_MARGIN on a figure of
        probes' epochs, and their realized figure has come out above their parts, not below), and it waits for a batch
        without a detached request instead. Forced for every due probe (4fb2ca6, H100 x4, 2026-11-27), a probe at load
        32 priced rounds at 0.55x plain steps' tokens/s, began over a batch of 7 after the requests joined with their
        drafts, was cut after 427 request-rounds, and its level ran 12.8% behind the plain server.

        A batch holding one request with a draft runs the step that keeps features (and its lag loop), so detaching pays
        only where every request of a batch is detached: the rule must hold for whole batches, not for most of their
        requests. Its first form (6867faa) detached 53-96% of the requests at concurrency 64 and 57-91% at 32 (H100 x4,
        ebce9a3, 2026-11-27, 1k shared prefix): the others joined at loads where plain steps were not settled (the
        buckets a level's wave passes through as it refills, after the idle gap that empties the load window) or where
        the next probe of rounds was near by the spacing and the budget's wait, recomputed at each epoch's end at that
        end's batch (a probe cheap over a wave's last requests, dear over a full batch), while no probe of rounds ran at
        32 or 64 in any of its sixteen levels."""
        return self.detach_blocker(batch_size) is None

    def detach_blocker(self, batch_size: int) -> str | None:
        """The first condition of `detachable` that the load a request joining a batch of `batch_size` lives at
        fails: "model_choice" (rounds, or none yet with rounds within reach), "probe" (one under way or owed),
        "unsettled" (fewer than SETTLED_EPOCHS epochs of plain steps, rounds within reach), "probe_waiting" (a due
        probe of rounds waits for detached requests to end); None when it fails none. Rounds out of reach
        (`rounds_out_of_reach`) need no settled plain steps: with the 1k shared prefix on the H100 x4 (c5ed8ad,
        2026-11-27, rounds at ~0.45x plain steps' tokens/s) each run's first concurrency-8 level held ~50 requests
        with their drafts while load 8 settled; they recomputed their cached prompts and extended their drafts
        (mean prefill launch 2.0-2.3 ms against the plain servers' 1.1), and those levels ran 10.7% behind the plain
        server (the later passes 1.5% behind)."""
        load = self._detach_load(batch_size)
        st = self._state[load]
        if st.model_choice == SPECULATIVE:
            return "model_choice"
        if st.probing or st.check:
            return "probe"
        settled = st.model_choice == PLAIN and self.epochs.count(PLAIN, load, probes=False) >= SETTLED_EPOCHS
        if not settled and not self.rounds_out_of_reach(batch_size, load):
            return "model_choice" if st.model_choice is None else "unsettled"
        if st.probe_waiting:
            return "probe_waiting"
        return None

    def _detach_load(self, batch_size: int) -> int:
        """The load bucket a request joining a batch of `batch_size` lives at: `_load_bucket`'s, or the largest batch or
        load of this epoch and the one before it since the last idle gap (`_saw_load`), or, where that gap was shorter
        than DETACH_GAP, the largest before it. Under plain steps the requests of a served level end together, the
        engine idles until their clients' next requests come (a round trip), and the load window starts over (`idle`):
        the wave refills through the small loads, where plain steps are not settled (their epochs are dropped as
        outgrown), and its first requests, judged there, joined with their drafts and kept the full batch's steps on
        features until they ended. A level's change of concurrency (a quiet gap of seconds in bench serving) is not
        carried over."""
        if self._gap is not None:  # the first ask since an idle gap began: was it a round trip?
            before, began = self._gap
            self._carried_load = before if self.clock() - began <= DETACH_GAP else 0
            self._gap = None
        return self.bucket_for(max(batch_size, max(self._recent_loads, default=0), self._peak_load,
                                   self._peak_before, self._carried_load))

    def _saw_load(self, load: int) -> None:
        """A decision over a load of `load` (the requests the engine held) or a step over a batch of `load` was
        counted: `_detach_load`'s memory of the largest in this epoch and the one before it (since the last idle
        gap), so that a load that fell with no idle gap is forgotten once two epochs and the load window have
        passed. Kept since the last idle gap alone (4fb2ca6), it judged requests at a load long gone for as long as
        the engine never idled."""
        if self.epochs.current is not self._peak_epoch:
            self._peak_epoch, self._peak_before, self._peak_load = self.epochs.current, self._peak_load, 0
        if load > self._peak_load:
            self._peak_load = load

    def _rounds_win(self, load: int, spec_tokens: float, seconds: dict[str, float],
                    parts: Callable[[], dict[str, float]]) -> bool:
        """Whether rounds committing `spec_tokens` per request-step beat plain steps at load bucket `load`, each
        step priced at `seconds[choice]` (the step at hand; `parts()`: priced by their parts alone): by the margin
        (`_margin`: the load's model choice holds unless the other wins by SWITCH_MARGIN) as priced; and, where
        rounds are not the load's model choice and their realized figure there rests on fewer than SETTLED_EPOCHS
        epochs while plain steps' rests on that many, by SWITCH_MARGIN by the parts as well. One rule for `decide`
        and `steady_choice`.

        A figure of one or two probe epochs is whatever those epochs met, and one that met the start of a level
        (its first requests decoding while the others prefill) priced rounds below what they cost: on the H200
        (697c8ca, 2026-11-25, 1k shared prefix, rounds committing 1.17 tokens) one probe epoch of rounds at load 64,
        begun over a batch of 5, put them 15% ahead of plain steps whose figure rested on many epochs, while
        their parts put them 2% behind and the fixed server made 0.55x the plain server's tokens/s; the level
        switched and ran 1018 rounds before it switched back. The parts miss the work between steps, which rounds
        have more of (prefills with draft extends, more tokens to send), so they rarely hold back rounds that do
        win: every H100 and H200 run where rounds won had them ahead by their parts too. (Where plain steps'
        figure is no more settled than rounds', the two are compared as measured: `_realized`.)"""
        if not _ahead(spec_tokens, seconds, self._margin(load)):
            return False
        unsettled = (self.epochs.count(SPECULATIVE, load) < SETTLED_EPOCHS <= self.epochs.count(PLAIN, load)
                     and self._state[load].model_choice != SPECULATIVE)
        if not unsettled or self._realized(SPECULATIVE, load) is None:
            return True
        return _ahead(spec_tokens, parts(), SWITCH_MARGIN)

    def _margin(self, load: int) -> float:
        """How much more tokens/s than plain steps rounds must be expected to commit at load bucket `load` (module
        docstring): before both choices have realized figures there, SWITCH_MARGIN (priced by their parts and the
        prior acceptance, the optimistic S while the window is thin, rounds are not held: their price is what moves
        first). Then the load's model choice holds unless the other wins by SWITCH_MARGIN, or by PROBED_MARGIN while
        fewer than SETTLED_EPOCHS of the other's epochs there were not probes' (rounds held: a negative margin,
        less by as much as plain steps must win by). A figure of probes' epochs alone is one to five epochs each
        taken right after the model choice's, over the state it left: plain steps probed under rounds read 44-77 us
        a request-step at load 8 (the plain server's level: 41-46), 27-32 at 32 (21) and 20-28 at 64 (17-19) (H100,
        cce3e5f and a0a7fec, 2026-11-26, 128-token prompts), and rounds probed under plain steps start over requests
        that arrived together (H200, c2ece4a, 2026-11-24: one probe epoch put rounds 4% ahead of plain steps at
        concurrency 64 where the plain server made 1.25x the fixed one's tokens/s). In the H100 bars of 2026-11-26
        (128-token prompts, where rounds lead by 19-50% at 8-64) switches to plain steps came with plain steps 10.5%
        and 21.7% ahead as priced by figures of probes' epochs alone (4766 and 3892 plain steps followed), and 13.5%
        by plain steps' own epochs of such a switch the pass before (6182), rounds' figure made of epochs that read
        +-30% of each other: those passes ran 7-17% behind the fixed server. The one rule for `decide`,
        `steady_choice` (whether a prefill extends the draft) and the switch log."""
        if any(self.epochs.ratio(c, load) is None for c in CHOICES):
            return SWITCH_MARGIN
        rounds_held = self._state[load].model_choice == SPECULATIVE
        challenger = PLAIN if rounds_held else SPECULATIVE
        settled = self.epochs.count(challenger, load, probes=False) >= SETTLED_EPOCHS
        margin = SWITCH_MARGIN if settled else PROBED_MARGIN
        return 1.0 / (1.0 + margin) - 1.0 if rounds_held else margin

    def _load_bucket(self, batch_size: int) -> int:
        """The bucket of the largest among `batch_size` and the loads of the last LOAD_WINDOW decisions (see the
        module docstring)."""
        return self.bucket_for(max(batch_size, max(self._recent_loads, default=0)))

    def engine_accept(self) -> float:
        """The engine-wide acceptance: the mean of the window's request-rounds, else S. What a request's own EMA is
        judged against (collapse, retries)."""
        return self.global_accept if self.global_accept is not None else float(self.max_accept)

    def prior_accept(self) -> float:
        """Expected accepted drafts per round of a request without rounds (or with a collapse being retried): the
        engine-wide acceptance, shrunk towards S while n < PRIOR_DECAY request-rounds have been counted, as if the
        window also held PRIOR_ROUNDS * (1 - n / PRIOR_DECAY) rounds that accepted S. The first rounds come from a
        request or two, and a low mean of theirs would stand (plain steps measure nothing; only probes add rounds):
        on the H100 (2026-11-25, 128-token prompts, concurrency 1) the first 34 rounds accepted 2.0 drafts where the
        workload's rounds accept ~3.4, the policy chose plain steps for the rest of the level and the level ran
        26% behind a fixed engine. Shrunk, 34 such rounds price at 3.4; rounds that accept ~1 draft (the shared
        prefix) bring it below a break-even of 2.7 within ~40 rounds. Collapses are judged against the unshrunk
        mean (`engine_accept`): the shrinkage prices new requests, it does not make a request look bad. It is the
        cold start's: once ACCEPT_WINDOW request-rounds have been counted, a window that stale rounds left thin
        (`accepted_rounds`) is taken as it is; before, the window's mean weighs as much as all the request-rounds
        counted, stale ones included, which were evidence all the same. Weighed by the window's size, a first level at
        concurrency 1 with the 1k shared prefix (~200 request-rounds at 0.22 drafts, then 8192 plain steps) left a
        window thinned to ACCEPT_FRESH_MIN = 64 whose prior was back at 1.67 drafts, 7.6x the acceptance measured, and
        the next level's first decisions at load 8 switched to rounds over 8 lagging drafts (H100 x2, session 39,
        -194247); weighed by the count (~195), 0.66.

        The pseudo-rounds faded over ACCEPT_WINDOW (512) request-rounds until session 46: with the 1k shared prefix
        (rounds accepting ~0.28 drafts) the first level at concurrency 1 ran ~150 rounds on the prior before plain
        steps took it (priced 1.28 drafts after 96 rounds: H100 x4, 4b3d27c), and the first passes at 1 ran 1.1-2.3%
        behind the plain server. Replayed at concurrency 1 through this policy (bench/replay_prior_decay.py; 0.3 ms
        plain steps, 0.745 ms rounds, acceptance drawn with mean ~0.28): the first 64 requests -4.9% against plain
        decoding fading over 512, -1.7% over 192, -0.9% over 128 or 96, -1.0% over 64; 256 requests
        -1.3/-0.7/-0.4/-0.4/-0.6%.
        The 128-token trace (rounds lead): 64 requests -1.4% against fixed rounds over 512, -0.7% over 128; 256
        requests -0.4% either way. Cold starts that read low at first: one request at 2.0 drafts, then the trace,
        equal or better over 128; two at 1.0, or half a request at 0, within 0.25% either way (over 128 at 512
        requests -0.49% and -0.08% against -0.32% and +0.14%; `replay-prior-decay-cpu--x86-64-20261127-111710`)."""
        mean = self.engine_accept()
        n = self._accept_counted
        if self.global_accept is None or n >= PRIOR_DECAY:
            return mean
        pseudo = PRIOR_ROUNDS * (1.0 - n / PRIOR_DECAY)
        return (mean * n + self.max_accept * pseudo) / (n + pseudo)

    def expected_accept(self, request, lag: int = 0) -> float:
        """Request's expected accepted drafts per round, its draft lagging by `lag` positions: the prior, unless
        its EMA collapsed (below COLLAPSE_FRACTION of the engine-wide acceptance, `engine_accept`): then its EMA,
        until it is retried (the prior) from a lag of its `retry_after`."""
        return self._expected(request.accept_state, lag)

    def _expected(self, own: _RequestAcceptance | None, lag: int) -> float:
        """`expected_accept` from a request's acceptance state (None: it has had no round)."""
        if own is not None and own.collapsed(self.engine_accept()) and lag < own.retry_after:
            return own.ema
        return self.prior_accept()

    def device(self, choice: str, bucket: int) -> float:
        """D(choice, bucket): measured, else the start-up table."""
        return self.measured_device_seconds.get((choice, bucket), self.device_seconds[(choice, bucket)])

    def launch(self, choice: str, bucket: int) -> float:
        """E(choice, bucket): measured, else the start-up table, else 0."""
        return self.launch_seconds.get((choice, bucket), self.launch_prior.get((choice, bucket), 0.0))

    def step_seconds(self, choice: str, bucket: int) -> float:
        """t(choice, bucket) from the parts: D (+) (E + R + X), R borrowed from the other choice until this one has
        run here, floored by a fresh W. (`_priced` adds a catch-up's share, or takes the realized figure.)"""
        t = self._parts_seconds(choice, bucket)
        wall = self._fresh_wall(choice, bucket)
        return t if wall is None else max(t, wall)

    def _fresh_wall(self, choice: str, bucket: int) -> float | None:
        """W of `choice` at `bucket` if re-measured within the last WALL_TTL decisions there, else None."""
        if self._decisions[bucket] - self.wall_decision.get((choice, bucket), -WALL_TTL) < WALL_TTL:
            return self.wall_seconds[(choice, bucket)]
        return None

    def _parts_seconds(self, choice: str, bucket: int) -> float:
        """D (+) (E + R + X): a step's seconds from its parts, without the floor W."""
        return self.join(self.device(choice, bucket), self.host_seconds(choice, bucket))

    def host_seconds(self, choice: str, bucket: int) -> float:
        """E + R + X: a step's host seconds (launching it, reading its results, and everything else between
        steps)."""
        return self.launch(choice, bucket) + _own_or_other(self.resolve_seconds, choice, bucket) + self.other_host(
            choice, bucket)

    def other_host(self, choice: str, bucket: int) -> float:
        """X(choice, bucket): the median of the choice's own steady samples once it has OWN_HOST_SAMPLES of them,
        else the bucket's pool (both choices), else 0."""
        if len(self._windows["own_host"].get((choice, bucket), ())) >= OWN_HOST_SAMPLES:
            return self.own_host_seconds[(choice, bucket)]
        return self.other_host_seconds.get(bucket, 0.0)

    def prompt_draft_seconds(self, new_positions: float) -> float:
        """Seconds the draft spends on one new request's prompt (its extend after the prefill, or the catch-up
        over it): the eager extends' seconds per request they completed, measured; until then a catch-up over
        `new_positions` positions, alone."""
        if self.draft_prompt_seconds is not None and self.draft_prompt_requests:
            return self.draft_prompt_seconds / self.draft_prompt_requests
        return self.catch_up_seconds(round(new_positions)) if new_positions > 0 else 0.0

    def catch_up_seconds(self, positions: int) -> float:
        """A catch-up over `positions` missing positions: its fitted device (+) host seconds."""
        return self.join(self.catch_up_device.predict(positions), self.catch_up_host.predict(positions))

    def join(self, device_seconds: float, host_seconds: float) -> float:
        """(+): max when host and device overlap, + when one waits for the other."""
        return max(device_seconds, host_seconds) if self.overlapped else device_seconds + host_seconds

    def decide(self, requests: list, lags: list[int] | None = None, tokens_left: float = 0.0,
               request_tokens: float = 0.0, new_positions: float = 0.0, held: int = 0,
               rounds_blocked: bool = False, all_detached: bool = False) -> Decision:
        """The choice for a decode step over `requests`, whose drafts miss `lags` positions each (none: 0) and
        which may each still generate `tokens_left` tokens on average, of `request_tokens` in all (0: unknown);
        `new_positions`: a new request's uncached prompt positions; `held`: the requests the engine holds (this
        batch, requests in their prefill and queued ones; 0: the batch alone), which the load window records in
        place of the batch's size when larger (`_load_bucket`). Also marks the step's launch for the clocks.
        A catch-up is shared by the rounds it opens: as many as the batch's requests have tokens left for (at
        least one). `rounds_blocked`: the batch holds a detached request (`detachable`), so the step is plain
        (reason "detached") whatever the model would choose, and no probe of rounds starts (one due starts at the
        first epoch's end after the detached requests have ended); `all_detached`: every request of it is, so a
        park may follow (`park`, `_epoch_stands`)."""
        now = self.clock()
        self._all_detached = all_detached
        self.epochs.event(now)
        if self._probe_stood is not None:  # a probe lasts PROBE_STEPS_FACTOR epochs' steps, standing ones included
            probed, probe_choice, counted = self._probe_stood
            probed.probe_left -= self.chosen[probe_choice] - counted
            self._probe_stood = None
        bs = len(requests)
        bucket = self.bucket_for(bs)
        holding = max(bs, held)  # the requests the engine holds, the batch at least
        self._recent_loads.append(min(holding, self.buckets[-1]))
        load = self._load_bucket(bs)
        if self._probe_load is not None and self._probe_load != load:
            self._leave_probe(self._state[self._probe_load])
        lags = lags if lags is not None else [0] * bs
        self._arrivals = (request_tokens, new_positions)
        owns = [q.accept_state for q in requests]  # each request's acceptance state
        catch_up_positions = sum(lags)
        spec_tokens = sum(1.0 + self._expected(own, lag) for own, lag in zip(owns, lags)) / bs
        rounds = max(tokens_left / spec_tokens, 1.0)

        def price(choice: str, realized: bool = True) -> float:
            return self._priced(choice, load, bs, catch_up_positions, rounds, bs * spec_tokens, request_tokens,
                                new_positions, realized)

        def parts() -> dict[str, float]:  # each choice priced by its parts alone
            return {c: price(c, False) for c in CHOICES}

        d = Decision(bucket, bs, PLAIN, "model", {PLAIN: 1.0, SPECULATIVE: spec_tokens},
                     {c: price(c) for c in CHOICES}, catch_up_positions)
        st = self._state[load]
        drain = st.model_choice is not None and not _steady(holding, load)
        if drain:
            d.choice = st.model_choice  # a drain takes its load's choice (module docstring, "A drain")
        elif self._rounds_win(load, spec_tokens, d.step_seconds, parts):
            d.choice = SPECULATIVE
        self._decisions[bucket] += 1
        if d.choice != st.model_choice:
            if st.model_choice is not None:
                self._log_switch(d, load, st.model_choice, owns)
            st.check = (st.model_choice is not None
                        and self.epochs.count(st.model_choice, load, probes=False) >= SETTLED_EPOCHS
                        and not self._collapsed(owns))
            st.model_choice, st.probe_after, st.epochs_since_probe, st.probing = d.choice, PROBE_FIRST, 0, False
            st.rounds_counted = self._accept_counted
            st.probe_waiting = False
            self._probe_load = None  # a probe under way was this load's (`_leave_probe`)
            st.measure = None
        if self._explore(st, d, load, request_tokens, drain, rounds_blocked, parts) != d.choice:
            d.choice, d.reason = _other(d.choice), "probe"
        if rounds_blocked and d.choice == SPECULATIVE:
            d.choice, d.reason = PLAIN, "detached"
        self.epochs.step(d.choice, load, self._epoch_steps(d, d.choice, request_tokens), bucket, bs,
                         d.reason == "probe")
        self._saw_load(self._recent_loads[-1])
        st.last = d
        self.chosen[d.choice] += 1
        self._launched(d.choice, bucket, now)
        self._reuse_bucket, self._reuse_accept = bucket, self.prior_accept()
        self._reuse_choice, self._reuse_idle = d.choice, False
        self._epochs_stood = 0
        if d.reason == "model":
            self._model_choice[bucket] = d.choice
        else:
            self._probe_stood = (st, d.choice, self.chosen[d.choice])
        left = self.epochs.current.target - self.epochs.current.steps  # steps left in the epoch
        if d.choice == PLAIN:  # stands to the epoch's end or the first retry (module docstring)
            self._reuse_left = min(left, self._retry_in(owns, lags, left))
        else:
            self._reuse_left = min(REUSE_STEPS, left)
        if d.choice == SPECULATIVE:
            self._mark_retries(owns, lags)
        self._tables = None
        return d

    def _log_switch(self, d: Decision, load: int, before: str, owns: list) -> None:
        """Log (INFO, logger spruce.adaptive, one JSON line) a change of the model's choice at load bucket `load`
        and what priced it: the prior, the margin, and per candidate its price, the realized ratio it used (the
        load's, or the nearest load's), the epochs behind its figure at the load, its parts and its fresh W.
        Switches are rare (each switch into rounds pays a catch-up), and they are what a serving run cannot
        otherwise explain: on the H100 with the shared prefix (2026-11-23) one pass at concurrency 8 ran rounds for
        4141 of 8486 steps in 8 stretches while the level's final tables priced rounds at half plain's tokens/s."""
        if not log.isEnabledFor(logging.INFO):
            return
        bucket = d.bucket

        def priced(choice: str) -> dict:
            ratio_at = self._ratio_load(choice, load)
            return {"seconds": d.step_seconds[choice], "tokens_per_second": d.tokens_per_second(choice),
                    "ratio": self.epochs.ratio(choice, ratio_at) if ratio_at is not None else None,
                    "realized_request_seconds": (self.epochs.request_seconds(choice, ratio_at)
                                                 if ratio_at is not None else None),
                    "ratio_load": ratio_at, "epochs": self.epochs.count(choice, load),
                    "parts": self._parts_seconds(choice, bucket),
                    "device": self.device(choice, bucket), "launch": self.launch(choice, bucket),
                    "resolve": _own_or_other(self.resolve_seconds, choice, bucket),
                    "other_host": self.other_host(choice, bucket),
                    "wall": self._fresh_wall(choice, bucket)}

        engine = self.engine_accept()
        log.info("adaptive switch %s", json.dumps({
            "from": before, "to": d.choice, "load": load, "bucket": bucket, "batch_size": d.batch_size,
            "prior": self.prior_accept(), "engine_accept": engine, "accept_window": len(self._accept_window),
            "margin": self._margin(load),
            "tokens_per_step": d.tokens_per_step[SPECULATIVE], "catch_up_positions": d.catch_up_positions,
            "collapsed": self._collapsed(owns),
            "priced": {c: priced(c) for c in CHOICES}}, default=float))

    def _collapsed(self, owns: list) -> int:
        """How many of the acceptance states `owns` (a batch's requests', None: no rounds yet) collapsed below the
        engine-wide acceptance."""
        engine = self.engine_accept()
        return sum(own is not None and own.collapsed(engine) for own in owns)

    def _priced(self, choice: str, load: int, batch_size: int, catch_up_positions: int, rounds: float,
                round_tokens: float, request_tokens: float, new_positions: float, realized: bool = True) -> float:
        """t(choice), the seconds of a step over `batch_size` requests at the load bucket `load`: that many times
        the realized seconds per request-step there (`_realized`; not if `realized` is False), else that share of
        its parts at the load's bucket (`step_seconds`, a round with its share of the draft's work on arriving
        prompts); a round over lagging
        drafts adds its share of the catch-up. A batch that dips below its load is priced per request as the load
        either way, so that it takes the load's choice, and so that one choice priced by its parts at the dip's
        bucket does not meet the other's realized figure at the load's."""
        per_request = self._realized(choice, load) if realized else None
        if per_request is not None:
            t = batch_size * per_request
        else:
            t = self.step_seconds(choice, load) * batch_size / load
            if choice == SPECULATIVE:
                t += self._arrival_seconds(round_tokens, request_tokens, new_positions)
        if choice == SPECULATIVE and catch_up_positions:
            t += self.catch_up_seconds(catch_up_positions) / rounds
        return t

    def _realized(self, choice: str, load: int) -> float | None:
        """The realized seconds per request-step of `choice` at the load bucket `load`, whatever the batch at hand
        (a batch that dips below the load's bucket while arrivals wait is priced as the load it belongs to, so it
        takes the load's choice): busy seconds over the requests its steps carried, over epochs of `choice` at
        `load` (EpochClock.request_seconds; speculative/epoch_clock.py says why per request-step). Before `choice`
        has an epoch at `load`, the figure at the nearest load bucket that has one (None: no realized figure
        anywhere), scaled from there to `load` as the other choice's realized figures scale between the two loads
        where it has both; as it stands where the other has none at `load` either (both are then compared as at
        their nearest measured loads); by the parts' seconds per request where the other has one at `load` only.
        The parts alone miss what lies between steps (prefills, the serving process); the realized figure at a
        neighbouring load carries that over. On the H100 (2026-11-23) a level's first pass at concurrency 64 priced
        rounds by their parts, ran plain steps for 83% of its steps and trailed the fixed server by 31%; the second
        pass, with realized figures, ran rounds. Not by the parts where the other choice measured the step between
        the loads: the parts' shapes differ from what the loads cost. On the H200 (390caaa, 2026-11-24, 1k shared
        prefix) plain steps read 10.6k and rounds 7.7k request-steps a second at load 8; scaled by the parts to load
        32, plain steps rose 1.66x and rounds 2.86x, rounds (1.14 tokens each) looked 43% better than plain steps, and
        the level's first pass switched eleven times in two seconds; the epochs at 32 then read plain steps at 23.4k
        and rounds at 14.7-21.1k.

        What the epochs measured, not a ratio times today's parts: the parts drift (their host term is sampled at
        deciding steps, which come with arrivals and ends). On the H100 (1k shared prefix, concurrency 8, e430067)
        the parts of one plain step over 8 requests moved between 0.54 and 1.17 ms while the epochs measured 0.6-0.7
        ms a step; ratio times parts put plain steps at 0.54-1.5 ms, and the level switched between plain steps and
        rounds (1.17 tokens a round at 1.0-1.3 ms) every 20-150 ms, paying a catch-up at each switch into rounds:
        1833 rounds, 35% behind the plain server. Not scaled to a dip's bucket either: at concurrency 64 (7b99986)
        the parts' ratio between a dip's bucket and the load's scaled plain steps and rounds differently, and dips
        of 3-6 requests switched to rounds (1.17 tokens) 17 times in one pass, each switch paying a catch-up of the
        batch."""
        at = self._ratio_load(choice, load)
        if at is None:
            return None
        per_request = self.epochs.request_seconds(choice, at)
        if at == load:
            return per_request
        other = _other(choice)
        other_there, other_here = self.epochs.request_seconds(other, at), self.epochs.request_seconds(other, load)
        if other_here is None:
            return per_request
        if other_there is not None:
            return per_request * other_here / other_there
        base = self._parts_seconds(choice, at) / at
        return per_request if base <= 0 else per_request * (self._parts_seconds(choice, load) / load) / base

    def _ratio_load(self, choice: str, load: int) -> int | None:
        """The load bucket whose realized ratio prices `choice` at `load`: `load` once it has one, else the nearest
        that has one (None: none has)."""
        if self.epochs.ratio(choice, load) is not None:
            return load
        measured = self.epochs.buckets(choice)
        return min(measured, key=lambda b: abs(math.log(b / load))) if measured else None

    def _explore(self, st: _BucketState, d: Decision, load: int, request_tokens: float, drain: bool,
                 rounds_blocked: bool, parts: Callable[[], dict[str, float]]) -> str:
        """The choice this step runs: the model's, or the other's while a probe epoch runs. A probe epoch starts
        when an epoch of the model's choice completes and enough of them have since the last probe: `probe_after`
        (doubled by each probe that leaves the model's choice as it was, reset when the choice changes), and, once
        the other choice has a realized figure, enough for probes to cost at most PROBE_BUDGET of the time: a
        probe's expected excess (`_probe_cost`: its tokens at the other choice's price, about (ratio - 1) epochs of
        the model's choice, and the catch-up it brings: the lag plain steps under rounds leave, or the one rounds
        under plain steps find) over PROBE_BUDGET of an epoch of the model's choice. The catch-up was left out of the
        spacing until 2026-11-24: on the H200 (4fd74eb, 128-token prompts, concurrency 8, plain steps ~0.9x rounds'
        tokens/s) two passes ran 4-5 plain probes each (478-487 plain steps), each probe leaving a catch-up of the batch
        (8 x 128 positions) that the spacing did not count; replaying the 128-token trace at concurrency 1,
        counting it cut the plain steps from 543 to 421.

        A probe ends when its epoch completes, or after PROBE_STEPS_FACTOR times an epoch's steps at its load
        (its decisions and the steps that stood after them, `repeat`) without one completing: a load that moves
        more often than an epoch lasts (a batch whose load bucket changes every 50 steps, against 128-step epochs of
        plain steps) had kept the probe on for good, and every visit to that load ran the probed choice.

        A probe that starts is logged (INFO, logger spruce.adaptive, one JSON line: the choice probed, the load,
        the spacing and the expected cost against what the budget has spent): a serving run's plain steps under
        rounds are probes or switches, and only the switches were logged until 2026-11-23.

        And only over a steady batch (`_steady`: at least half its load): a probe due at the end of an epoch over
        a level's first requests (the others still in their prefills) or its last ones waits for an epoch that ends
        over a steady batch, or, unless the load drains (`drain`: fewer than half of it held), for STEADY_WAIT epochs
        past its spacing (a load whose batch never reaches half of it, its requests held in the queue by a full KV
        pool, is still probed). A drain's epochs are short, so STEADY_WAIT of them had passed by the end of most
        levels whose probe the budget held back at the full batch, and the drain's small batch priced the probe low
        enough to pass it: on the H200 x4 (834dffed, 2026-11-26, 128-token prompts) plain probes began over batches
        of 1-5 at loads 32 and 64, and each ran its 128 plain steps at the start of the load's next level (below).
        A probe ends when its load does (`_leave_probe`): its epoch completes only at its load, and one still under
        way when the load moved had run on at the load's next visit, the next level's first 128 steps (of its 650
        at concurrency 64) in plain steps while rounds led by 30-40%. On the H200 (b2d3f8e, 2026-11-25, 1k
        shared prefix) 5 of a run's 13 probes of rounds began so, at loads 8-64 over batches of 1-8; three of them
        ~0.5 s into a level at loads 32 and 64, priced at the small batch (15-21 ms expected), ran their rounds while
        the batch filled, every arrival's prefill lazy and then caught up: those levels ran 9, 14 and 24 catch-ups
        and 2%, 21% and 25% behind the plain server (the levels whose probes began over a steady batch: 5-9
        catch-ups, -15% to +6%). Such an epoch measures a ramp, not the load.

        And only while all probes so far, at every load, stay within PROBE_BUDGET of the busy time plus
        PROBE_ALLOWANCE (`_probe_affordable`): the spacing above is per load bucket and restarts whenever the
        model's choice there flips, and on the H100 (2026-11-23, 128-token prompts, concurrency 8) an adaptive
        server whose load moved between two buckets ran five plain probe epochs per 9 s pass, ~4% of its time,
        against rounds 3x as productive.

        Except the first probe after the model's choice changed away from one settled at the load (SETTLED_EPOCHS
        epochs of its own; not a collapsed request's switch, which the next request undoes): it comes PROBE_FIRST
        epochs after the switch, whatever the budget, which then counts it. The choice left behind is priced by its
        last epochs, which a switch leaves frozen, and probes priced by them may not come for the rest of the level:
        on the H100 (3c59215, 2026-11-26, 128-token prompts) rounds' figure at load 8 read 1.69x their parts in a
        pass where the host was slow for all, the level switched to plain steps, and the next pass's concurrency-8
        level ran 10155 plain steps and no probe of rounds, 35% behind the fixed server.

        And a probe of rounds not while rounds are blocked (`rounds_blocked`: a detached request in the batch,
        `detachable`): a due one starts at the first epoch's end over a batch without one; meanwhile arriving
        requests join with their drafts (`probe_waiting`, until it starts or the load's model choice changes), where
        rounds are within reach by their parts and plain steps' (`parts`: each choice priced by its parts alone).
        While it waits, whether it is due is not judged again: judged at each epoch's end, its spacing and cost
        priced at that end's batch, it came and went, arrivals joined with their drafts and detached by turns, the
        batch never lost its last detached request and the probe never started: on the H100 x4 (647a8e4,
        2026-11-27, 1k shared prefix) one concurrency-8 pass held 95 requests with their drafts (recomputing their
        cached prompts: 53.5 uncached prompt tokens a request against the plain server's 14.7) beside 417 detached
        ones, ran no round and ended 17.5% behind the plain server.

        The budget judges a probe at its price over the load's full batch (`load` requests: its excess, like the
        model's epoch it is spaced against, grows with the batch), and charges that: it may start over any batch up
        to the full one, and a probe of rounds held back is started by `probe_waiting` whatever the batch then.
        Judged at the batch of the epoch's end that found it due, probes of rounds at load 8 came once or twice in
        each run's concurrency-8 levels (H100 x4, eleven runs at d62dc39 and 66b8a92, 1k shared prefix, rounds at
        ~0.42x plain steps' tokens/s), 11 of 12 over batches of 6-8 at prices past what the budget held (0.27-0.71 s
        where it held 0.18-0.42); in d62dc39's eight runs the passes that held one ran 6.7 +- 4.5% behind the plain
        server, those that did not 2.5 +- 2.0%. Budgeted so, none came there in eleven runs (4037e6d, 10ffd04)."""
        model, other = st.model_choice, _other(st.model_choice)
        cur = self.epochs.current
        done = cur is not None and cur.bucket == load and cur.full
        if st.probing:
            st.probe_left -= 1
            if (done and cur.choice == other) or st.probe_left < 0:  # the probe epoch is measured, or cannot be
                measured = st.measure is not None and done and cur.choice == other and self.epochs.steady(cur)
                if measured:
                    self._measured_probe_epoch(st.measure, cur)
                self._leave_probe(st, keep_measure=measured)
            elif self._cut(st, d, model, other):
                self._leave_probe(st, keep_measure=self._measured_cut(st.measure, cur))
                self.probes_cut += 1
                if log.isEnabledFor(logging.INFO):
                    log.info("adaptive probe cut %s", json.dumps({
                        "load": load, "batch_size": d.batch_size, "request_rounds": self._accept_counted
                        - st.probe_counted, "tokens_per_step": d.tokens_per_step[other],
                        "tokens_per_step_bound": 1.0 + self._probe_bound(st),
                        "tokens_per_second": {c: d.tokens_per_second(c) for c in CHOICES}}))
        elif done and cur.choice == model:
            if st.measure is not None and st.measure.excess is not None:  # the first model epoch after the probe
                if self.epochs.steady(cur):
                    self._measured_probe(st.measure, cur, load)
                st.measure = None
            st.epochs_since_probe += 1
            spacing = st.probe_after
            other_seconds = self._probe_price(d, other, load)
            probe_d = self._at_measured_acceptance(d) if other == SPECULATIVE else d  # (what the probe would find)
            steps = self._epoch_steps(probe_d, other, request_tokens)
            priced = self._probe_cost(probe_d, model, other, steps, other_seconds)
            cost = priced * self._probe_factor(other, load)
            model_epoch = self._epoch_steps(d, model, request_tokens) * d.step_seconds[model]  # (seconds)
            if self.epochs.ratio(other, load) is not None and not st.check:
                fresh = self._accept_counted - st.rounds_counted >= ACCEPT_FRESH_MIN  # (rounds at other loads)
                budget = self.probe_budget * self._probe_share(probe_d, model, other, other_seconds, fresh)
                spacing = max(spacing, math.ceil(cost / max(budget * model_epoch, 1e-12) - 1e-9))
            st.spacing = spacing
            steady = _steady(d.batch_size, load) or (not drain and st.epochs_since_probe >= spacing + STEADY_WAIT)
            # a waiting probe stays due until it starts (no spacing, budget or reach judged again while it waits)
            full = cost * load / d.batch_size  # over the load's full batch: what it may start over
            due = st.probe_waiting or (st.epochs_since_probe >= spacing and (st.check or self._probe_affordable(full)))
            # (a due probe's end over an unsteady batch, a wave's last requests, leaves probe_waiting as it was)
            if not due:
                st.probe_waiting = False
            elif steady and rounds_blocked and other == SPECULATIVE:  # requests join with their drafts until the
                # detached ones have ended, where the probe may change the model's choice (`detachable`)
                st.probe_waiting = st.probe_waiting or _ahead(d.tokens_per_step[SPECULATIVE], parts(), -PROBED_MARGIN)
            elif steady:
                st.probe_waiting = False
                st.probing, st.epochs_since_probe, st.probe_left = True, 0, PROBE_STEPS_FACTOR * steps
                st.probe_counted, st.probe_drafts = self._accept_counted, self._accept_drafts
                st.probe_squares = self._accept_squares
                self._probe_load = load
                st.check = False
                st.measure = self._probe_measure(d, model, other, load, steps, priced)
                self.probes += 1
                self.probe_seconds += full
                if log.isEnabledFor(logging.INFO):
                    log.info("adaptive probe %s", json.dumps({
                        "choice": other, "load": load, "batch_size": d.batch_size, "steps": steps,
                        "spacing": spacing, "other_seconds": other_seconds, "cost": full,
                        "cost_factor": self._probe_factor(other, load),
                        "probe_seconds": self.probe_seconds, "busy": self.epochs.busy_total}))
        return other if st.probing else model

    def _at_measured_acceptance(self, d: Decision) -> Decision:
        """`d` with rounds committing 1 + the engine-wide acceptance as measured (`engine_accept`'s mean of the
        window) per request-step: what a probe of rounds is priced, spaced and budgeted at once any round was counted.
        The cold start's prior (`prior_accept`: the window shrunk towards S over the first PRIOR_DECAY request-rounds)
        is optimism for decisions, so that rounds run and measure the acceptance; a probe's expected excess is a
        forecast of what it will cost, which the prior put low: with the 1k shared prefix on the H200 x4 (twelve bar
        runs, session 56) every run switched load 1 to plain steps after ~72 cold-start request-rounds at 0.28-0.37
        drafts, whose prior still read 1.05-1.14: rounds were priced at ~0.8x plain steps' tokens/s instead of ~0.5x,
        and the one probe of rounds each run made at load 1 at ~0.011 s (61 rounds of 2.1 tokens; at 1.4 tokens, 93
        rounds and ~0.03 s), so it came after 55-148 epochs of plain steps, within the run's 256 requests at
        concurrency 1, and its pass read ~1.8 points (later passes) to ~4.5 (first passes) below those without one.
        `_measured_probe` already measured a probe at the acceptance its own rounds had. Once PRIOR_DECAY
        request-rounds have been counted the two agree: this moves a run's first probes or two."""
        if self.global_accept is None:
            return d
        return dataclasses.replace(d, tokens_per_step={**d.tokens_per_step, SPECULATIVE: 1.0 + self.global_accept})

    def _cut(self, st: _BucketState, d: Decision, model: str, other: str) -> bool:
        """Whether a probe of rounds under plain steps has settled what it was for, at this step's decision: plain
        steps commit PROBE_CUT_LEAD more per second than rounds priced at the acceptance its request-rounds give,
        once it counted PROBE_CUT_REQUEST_ROUNDS or more; or, once it counted PROBE_CUT_MIN_ROUNDS over EPOCH_MIN
        steps or more, than rounds priced at its own rounds' mean acceptance plus PROBE_CUT_Z standard errors
        (`_probe_bound`). Its epoch would have run on to about a request's lifetime in rounds (~110 at the 1k shared
        prefix's 1.2 tokens a round) at every load, the batch's own rounds giving the load's acceptance many times
        over from 8 requests up: in process on the H100 (2026-11-26, c0d4c6f) an adaptive engine whose probes ran 108
        rounds (and 6 catch-ups) at concurrency 64 over six repetitions was 4.4% behind the plain engine there, where
        one never probing was 1.4% ahead of it. The lead asked is the margin rounds would have to win by to take the
        load from a figure of probes' epochs (PROBED_MARGIN): with their acceptance settled, the rest of the epoch
        would only re-measure their cost, which the cut epoch measures too. Half (session 37's first H100 x4 runs,
        d26fce3) cut 9 of 35 probes, none of the ~110-round ones at 64 over a full batch and 3 at 32: there plain
        steps' priced lead was below half at each of their decisions.

        The bound (session 53) is for concurrency 1, where an epoch of rounds counts fewer request-rounds than
        PROBE_CUT_REQUEST_ROUNDS and probes ran whole: over the concurrency-1 passes of nineteen H100 x4 bar runs
        (4037e6d, 10ffd04, c29a592; 1k shared prefix) the adaptive server read 0.8% behind the plain one in passes
        without a round and 1.7% more per 100 probe rounds (61-105 a probe at ~0.27 drafts each, 0.70 ms against
        plain steps' 0.27). Rounds must accept ~1.06 drafts there for plain steps to lead them by less than
        PROBE_CUT_LEAD; after 32 rounds at 0.27 (standard deviation ~0.8) the bound is ~0.7, while rounds that do win
        (the 128-token prompts: ~3.4 drafts a round, spread ~1.8) sit several standard errors above it. A request's
        rounds are not independent (a probe at 1 sees one or two requests), so the bound is three standard errors,
        not two. In eight runs at ae7007a six of seven such probes were cut at 34-47 rounds (the passes that held
        one: 35-60 rounds).

        A cut probe's rounds are a short epoch (kept for rounds' realized figure if EPOCH_MIN steps or more), its
        cost is measured over the steps it ran against its price scaled to them (`_measured_cut`), it was charged its
        whole price against the budget when it began, and the load's next probe comes twice as far on, as after any
        probe that changes nothing. A probe under rounds (of plain steps) is never cut: plain steps measure no
        acceptance."""
        if other != SPECULATIVE:
            return False
        counted = self._accept_counted - st.probe_counted
        lead = (1.0 + PROBE_CUT_LEAD) * d.batch_size
        plain = d.tokens_per_second(model)
        if counted >= PROBE_CUT_REQUEST_ROUNDS and plain >= lead * _rate(d.tokens_per_step[other],
                                                                         d.step_seconds[other]):
            return True
        cur = self.epochs.current  # (the probe's epoch: its rounds re-measure their cost too)
        return (counted >= PROBE_CUT_MIN_ROUNDS and cur is not None and cur.choice == other and cur.steps >= EPOCH_MIN
                and plain >= lead * _rate(1.0 + self._probe_bound(st), d.step_seconds[other]))

    def _measured_cut(self, m: _ProbeMeasure | None, cur: Epoch | None) -> bool:
        """Whether the probe cut at this decision is measured (`_measured_probe`): its epoch so far (`cur`, its
        steps' busy time up to this launch) is the measure's first half, against its price scaled to the steps it ran
        (the catch-up in full); the first model epoch after it completes the measure as after any probe. Not where
        its epoch ran fewer than EPOCH_MIN steps or was not steady (`EpochClock.steady`).

        Until session 54 a cut probe went unmeasured, so the factor that spaces probes by what they cost
        (`_probe_factor`) learned nothing from probes that were mostly cut: in ten bar runs with the 1k shared prefix
        (H100 x4 and H200 x2, ae7007a-1347660) the nine probes of rounds at concurrency 1 were priced at 9.6-26.6 ms
        with the factor at 1, eight of them were cut, one was measured, and the passes that held one ran 1.9-3.2%
        behind the plain server against -0.3% for those that held none."""
        if m is None or cur is None or not cur.probe or cur.choice != m.choice or cur.steps < EPOCH_MIN \
                or not self.epochs.steady(cur):
            return False
        m.priced = m.catch_up + (m.priced - m.catch_up) * min(cur.steps / m.steps, 1.0)
        self._measured_probe_epoch(m, cur)
        return True

    def _probe_bound(self, st: _BucketState) -> float:
        """The probe under way at `st`'s load: its request-rounds' mean accepted drafts plus PROBE_CUT_Z standard
        errors (`_cut`)."""
        n = self._accept_counted - st.probe_counted
        mean = (self._accept_drafts - st.probe_drafts) / n
        variance = max((self._accept_squares - st.probe_squares) / n - mean * mean, 0.0) * n / (n - 1)
        return mean + PROBE_CUT_Z * math.sqrt(variance / n)

    def _leave_probe(self, st: _BucketState, keep_measure: bool = False) -> None:
        """The probe under way at `st`'s load ends: its epoch measured (`keep_measure`: the first epoch of the
        model's choice after it completes the measure, `_measured_probe`), or not (its steps ran out, or the load
        moved before its epoch completed). Either way the load's probes are spaced twice as far apart."""
        st.probing, st.probe_after = False, min(2 * st.probe_after, PROBE_MAX)
        st.rounds_counted = self._accept_counted
        if not keep_measure:
            st.measure = None
        self._probe_load = None

    @staticmethod
    def _epoch_steps(d: Decision, choice: str, request_tokens: float) -> int:
        """Steps of an epoch of `choice`: about one request's life, within EpochClock's bounds."""
        return epoch_steps(math.ceil(request_tokens / d.tokens_per_step[choice]))

    def _probe_price(self, d: Decision, other: str, load: int) -> float:
        """The seconds a step of `other` is taken to cost when spacing and budgeting its probes: its price in `d`,
        except while its realized figure at `load` rests on fewer than SETTLED_EPOCHS epochs and puts it more than
        STALL_RATIO times above its parts: then its parts. A lone epoch that caught a stall would otherwise price its
        choice out of the very probes that re-measure it (the low median of two epochs drops a high one): on the H100
        (2026-11-23) a compilation inside the first plain epoch at a load read 7.75x the parts, and the level ran
        rounds for good, its plain probes priced beyond the budget. Within STALL_RATIO the epoch is what the choice
        costs (prefills and the serving process's work included): priced at its parts instead, plain steps under
        rounds looked nearly as good as rounds priced at theirs, and probes came every few epochs until three had
        settled the figure (replaying the 128-token trace at concurrency 1: 1552 plain steps and -1.9% against
        fixed rounds, against 543 and -0.6% with the lone epoch's figure).

        And while `other` has no epoch at `load`, its figure there is carried from the nearest load that has one
        (`_realized`: scaled as the model choice's figures scale between the two), which the probe's price takes
        unscaled where that is dearer: a probe is priced for the budget at the dear end of what the load may cost.
        Per request-step, plain steps cost less at a higher load (a step's fixed work shared by more requests) and
        rounds, whose host work grows with the tokens they commit, did not: in the four of session 38's shared-prefix
        runs on the H100 x2 whose adaptive server ended with rounds' figures at both loads, rounds read 65, 67, 42 and
        56 us a request-step at 32 and 67, 68, 70 and 46 at 64, where plain steps went from 29-46 to 29-37. Carried
        from 32 as plain steps scale (0.54x at that moment, run -175949), rounds over 64 requests were priced at
        1.45 ms, a plain step's worth per token, so the probe's expected excess was its catch-up, 5.5 ms; its epoch
        read 69.8 us a request-step and cost 0.32 s. Unscaled, 41.7 us: ~0.13 s expected. Their parts do not carry
        them better: the start-up table's rounds (padding rows) take 1.02 ms at 32 and 1.09 at 64, and even measured
        (1.28-1.37 and 1.55-1.79 ms) they are device time, while rounds served at 64 are host-bound. The decision keeps
        the carried figure (it is the better guess; the price only spaces and budgets the probe that measures it)."""
        seconds = d.step_seconds[other]
        ratio = self.epochs.ratio(other, load)
        if ratio is not None and ratio > STALL_RATIO and self.epochs.count(other, load) < SETTLED_EPOCHS:
            return seconds / ratio
        if ratio is None:  # carried from another load: at the dearer of its scaled and unscaled figures
            at, carried = self._ratio_load(other, load), self._realized(other, load)
            if at is not None and carried is not None:
                return seconds + d.batch_size * max(self.epochs.request_seconds(other, at) - carried, 0.0)
        return seconds

    @staticmethod
    def _probe_share(d: Decision, model: str, other: str, other_seconds: float, fresh: bool = False) -> float:
        """The share of PROBE_BUDGET a load's probes of `other` may spend. Under rounds (plain probes), by how far
        rounds lead plain steps as priced (`other` at `other_seconds` a step): SWITCH_MARGIN over the lead, squared,
        at most 1 and at least PROBE_SHARE_MIN. Under plain steps the same where the acceptance is `fresh` (at least
        ACCEPT_FRESH_MIN request-rounds came from other loads since rounds last ran at this one), else the whole
        budget (below). A probe pays only if plain steps have come to win by the margin since
        they were last measured, and the further behind they are, the less likely that is; at the full budget probes
        cost what they were budgeted, a loss the fixed configuration does not pay: on the H100 (59f0601 and
        b32202e, 2026-11-26, 128-token prompts, 6 runs) the adaptive server trailed the fixed one by 0.9% at
        concurrency 1 (one plain probe of 128 steps every other 64-request level, where rounds lead by ~25%), and
        its 19 concurrency-8 passes with a plain probe averaged 4.1% behind against 1.4% for the 11 without (a
        pass's stdev is ~6%). Rounds measure the acceptance as they run, so a fall in it switches a load to plain
        steps without a probe (replayed at concurrency 1: acceptance 4 then 0, plain steps from the 16th request on,
        at either share). Under plain steps the whole budget: only a probe of rounds re-measures the acceptance,
        and each adds one epoch's rounds to a window of ACCEPT_WINDOW (replayed: acceptance 0 for 256 requests then
        4, rounds take the load back 256-512 requests after the change at the whole budget, not within 1024 at a
        quarter).

        Squared (and down to a twentieth) since session 34: the margin over the lead was a quarter to a half of the
        budget where rounds lead by 20-40% (128-token prompts at 8-64), and on the H100 (762c84e and 3d6e0ae,
        2026-11-26, 12 runs) a third of the later concurrency-8 passes still held a plain probe (128 plain steps:
        ~1-2% of a pass; the median of 15 measured plain probes cost 2.5x its price). Plain steps' figure is the
        host's and the load's, which rounds do not move; what moves the choice is the acceptance, which rounds
        measure as they run. Replayed at concurrency 1: the 128-token trace -0.39% against fixed rounds, 272 plain
        steps (was -0.52%, 400); the changes of workload and the stationary traces unchanged (plain probes under
        rounds are none of their cost).

        Under plain steps with a fresh acceptance as under rounds, since session 46: the acceptance is engine-wide,
        and a probe at one load re-measures it for all; what a probe at this load adds is rounds' cost here, which
        moves the choice only where rounds come near plain steps. Where the acceptance is re-measured elsewhere
        (probes at a load where they are cheap: with the 1k shared prefix on the H100 x4, 4b3d27c, a probe of rounds
        at concurrency 1 cost 0.01-0.02 s for ~60 request-rounds, one at 8 was priced at 0.32 s for 290, and each
        pass at 8 holding one ran 6.4% behind the plain server, its later passes without one 1.9%), a rise in it
        reaches every load's decisions without this load's probe: each prices rounds at the engine-wide acceptance.
        Where no other load measures it (one load alone, as in test_a_change_of_workload_is_found_by_a_probe), the
        whole budget stays."""
        if model != SPECULATIVE and not fresh:
            return 1.0
        lead = d.tokens_per_second(model) / max(d.tokens_per_second_at(other, other_seconds), 1e-12) - 1.0
        return max(PROBE_SHARE_MIN, min(1.0, (SWITCH_MARGIN / max(lead, 1e-12)) ** 2))

    def _probe_cost(self, d: Decision, model: str, other: str, steps: int, other_seconds: float) -> float:
        """A probe epoch's expected excess seconds: its `steps` of `other` at `other_seconds` each, less what the
        model's choice would have taken for the same tokens (0 if `other` is expected to be no worse), and the
        catch-up it brings: for plain steps under rounds the one of the lag they leave (the batch's drafts, `steps`
        positions each), for rounds under plain steps the one of the lag the batch owes (`d.catch_up_positions`),
        which the probe's first round pays. The latter was left out until 2026-11-25 (session 27): with the 1k
        shared prefix on the H100 (0ae3c95), where every prompt's extend is left to a catch-up, a concurrency-32
        level ran three probes of rounds in 2.7 s, priced at 70, 1 and 0 ms, with 25 catch-ups over 8,395
        positions, and was 20% behind the plain server."""
        ratio = d.tokens_per_second_at(other, other_seconds) / max(d.tokens_per_second(model), 1e-12)
        excess = steps * other_seconds * max(1.0 - ratio, 0.0)
        return excess + self._probe_catch_up(d, other, steps)

    def _probe_catch_up(self, d: Decision, other: str, steps: int) -> float:
        """The catch-up a probe of `steps` steps of `other` brings (`_probe_cost`): plain steps under rounds leave
        the batch's drafts `steps` positions behind; rounds under plain steps first catch up the lag the batch
        owes."""
        owed = d.batch_size * steps if other == PLAIN else d.catch_up_positions
        return self.catch_up_seconds(owed) if owed else 0.0

    def _probe_factor(self, choice: str, load: int | None = None) -> float:
        """What probes of `choice` (at `load`) are taken to cost over their price (`_probe_cost`): the EMA of their
        measured over priced cost at that load once one was measured there (`_measured_probe`), within 1 and
        PROBE_COST_FACTOR_LOAD_MAX; else the EMA over every load, within 1 and PROBE_COST_FACTOR_MAX.

        Per load because the price errs by load: on the H100 x2 (2026-11-26, 1k shared prefix, bar runs at 779240c
        and 891e24c) a probe of rounds at load 64 was priced at 5.5 ms and measured at 0.32 s (rounds' figure there
        carried from load 32 as plain steps' scale, which rounds' did not follow: `_probe_price`), while at loads 8-32
        probes cost 3-13 times their price; the one factor, its samples held within 16, read 2.7 and then 6.0 there,
        and 5 of 16 later passes at 64 ran a probe (~9 points behind the passes that did not)."""
        if load is not None and (choice, load) in self.probe_cost_factor_at:
            return min(max(self.probe_cost_factor_at[(choice, load)], 1.0), PROBE_COST_FACTOR_LOAD_MAX)
        return min(max(self.probe_cost_factor[choice], 1.0), PROBE_COST_FACTOR_MAX)

    def _probe_measure(self, d: Decision, model: str, other: str, load: int, steps: int,
                       priced: float) -> _ProbeMeasure | None:
        """The record against which a probe of `other` that starts now (priced at `priced`) is measured: None while
        the model choice has no realized figure at `load` to measure it against."""
        model_seconds = self.epochs.request_seconds(model, load)
        if model_seconds is None or priced <= 0.0:
            return None
        return _ProbeMeasure(other, priced, steps, self._probe_catch_up(d, other, steps), model_seconds,
                             d.tokens_per_step[model], self._accept_drafts, self._accept_counted)

    def _measured_probe_epoch(self, m: _ProbeMeasure, probe_epoch: Epoch) -> None:
        """The first half of a probe's measured cost (`_measured_probe`), once its own epoch completes: that epoch's
        busy seconds over what its tokens cost at the model choice's figure, a probe of rounds counted at the
        acceptance of the request-rounds it added."""
        rounds = self._accept_counted - m.rounds
        tokens = 1.0 + (self._accept_drafts - m.drafts) / rounds if m.choice == SPECULATIVE and rounds else 1.0
        m.excess = probe_epoch.busy - probe_epoch.request_steps * m.model_seconds * tokens / m.model_tokens

    def _measured_probe(self, m: _ProbeMeasure, after: Epoch, load: int) -> None:
        """A probe's cost as measured, once the first epoch of the model choice after it (`after`) is complete: the
        probe epoch's busy seconds over what its tokens (a probe of rounds: at the acceptance its own rounds had)
        cost at the model choice's realized figure before it, plus `after`'s over that figure (a probe leaves state
        behind: its catch-up, arrivals' drafts, requests out of step), plus its catch-up as priced (epochs leave
        catch-ups out). Neither epoch may be a drain, a ramp or a stall (`EpochClock.steady`): a level's drain
        after a probe would read as its cost. Its ratio to the probe's price moves the EMA behind `_probe_factor`,
        which spaces later probes of that choice by what they cost. On the H100 bars of 2026-11-26
        (bench/serving_passes.py, 32 runs) a pass whose level ran a probe trailed those that ran none
        by 3-13 points at concurrency 8-32, 0.1-0.6 s of a level, where `_probe_cost` had priced them at 5-46 ms: the
        probe budget, spent at those prices, was spent several times over. Each sample is noisy (an epoch reads
        +-30% of its neighbours), so no one probe moves the factor far, and a sample is held within
        +-PROBE_COST_FACTOR_MAX, negative ones kept (a probe that cost less than nothing is noise, and cut at 0 the
        noise would only push the factor up); the load's own EMA (from the choice-wide one) within
        +-PROBE_COST_FACTOR_LOAD_MAX. The yardstick is the model choice's figure, the low median of its
        epochs, not their mean, which one epoch that held a stall or a burst of prefills moves far; and a probe of
        rounds is measured at the acceptance its own rounds had, not the one it was priced at (a prior that
        expected more drafts than they accepted credits it with tokens it never committed). With the mean and the
        price's acceptance, on the CPU (pycode-6m, concurrency 8), two probes of rounds read as gains of 13.9 and
        17.6 s (measured over priced -970 and -310)."""
        measured = m.excess + after.busy - after.request_steps * m.model_seconds + m.catch_up
        ratio = measured / m.priced
        sample = min(max(ratio, -PROBE_COST_FACTOR_MAX), PROBE_COST_FACTOR_MAX)
        factor = self.probe_cost_factor[m.choice]
        self.probe_cost_factor[m.choice] = factor + PROBE_COST_ALPHA * (sample - factor)
        key = (m.choice, load)  # the load's own EMA starts from the choice-wide one
        at = self.probe_cost_factor_at.get(key, factor)
        sample = min(max(ratio, -PROBE_COST_FACTOR_LOAD_MAX), PROBE_COST_FACTOR_LOAD_MAX)
        self.probe_cost_factor_at[key] = at + PROBE_COST_ALPHA * (sample - at)
        if log.isEnabledFor(logging.INFO):
            log.info("adaptive probe measured %s", json.dumps({
                "choice": m.choice, "load": load, "priced": m.priced, "measured": measured,
                "factor": self.probe_cost_factor[m.choice], "factor_at_load": self.probe_cost_factor_at[key]}))

    def _probe_affordable(self, cost: float) -> bool:
        """All probes' expected excess so far plus `cost` stay within PROBE_BUDGET of the busy time plus
        PROBE_ALLOWANCE."""
        return self.probe_seconds + cost <= self.probe_budget * self.epochs.busy_total + PROBE_ALLOWANCE

    def _arrival_seconds(self, round_tokens: float, request_tokens: float, new_positions: float) -> float:
        """Per round, the draft's share of work on new requests' prompts: while rounds go on, every request that
        replaces a finished one needs its draft extended over its prompt (eagerly after its prefill, or by a
        catch-up), work a plain engine never does. A round commits `round_tokens`, so requests finish (and others
        arrive) at round_tokens / request_tokens per round. On the H100 (pycode-19m, 128-token outputs) a draft
        extend cost ~2.7 ms of eager launches against 1.1 ms rounds at batch 8: rounds looked 1.8x faster than
        plain steps while a server running only rounds was 7-30% slower than a plain one."""
        if request_tokens <= 0:
            return 0.0
        return round_tokens / request_tokens * self.prompt_draft_seconds(new_positions)

    def _retry_in(self, owns: list[_RequestAcceptance | None], lags: list[int], none_due: int) -> int:
        """Further plain steps (after this one) before the first collapsed one of the batch's requests (their
        acceptance states `owns`) is due for a retry (`none_due` if none is)."""
        engine = self.engine_accept()
        due = [own.retry_after - lag - 1 for own, lag in zip(owns, lags)
               if own is not None and own.collapsed(engine) and lag < own.retry_after]
        return max(min(due, default=none_due), 0)

    def _mark_retries(self, owns: list[_RequestAcceptance | None], lags: list[int]) -> None:
        """A round is launched: the requests in it priced on the prior (a retry) are judged by its acceptance."""
        engine = self.engine_accept()
        for own, lag in zip(owns, lags):
            if own is not None and own.collapsed(engine) and lag >= own.retry_after:
                own.retrying = True
                self.retries += 1

    def repeat(self, choice: str, batch_size: int) -> bool:
        """A step of `choice` (the last decision's) over a batch of `batch_size` is about to launch: True when that
        decision (a model choice or a probe's) stands for it (counted as a step of that choice, not timed); False
        when the step must be decided (`decide`): the batch moved to a cost bucket whose latest model choice
        differs (with prefill batching the batch size swings between buckets) or, after an idle gap, to a smaller
        one (`idle`), the epoch is complete (a probe may be due), a collapsed request is due for a retry, or
        (rounds) REUSE_STEPS steps have passed.
        At the end of an epoch of plain steps the next one may open without a decision (`_epoch_stands`).
        The caller checks what the choice needs of the batch's drafts (plain steps: no lag fills the ring; rounds:
        no lag)."""
        bucket = self.bucket_for(batch_size)
        opens = self._reuse_left <= 0
        if opens and not self._epoch_stands(choice, bucket):
            return False
        if bucket != self._reuse_bucket and (self._model_choice.get(bucket) != choice or (
                self._reuse_idle and bucket < self._reuse_bucket)):  # a lower load after a gap: its own epoch
            return False
        now = self.clock()
        if opens:  # the epoch under way is full: this step opens the next one of the same choice and load
            load = self.epochs.current.bucket
            self._reuse_left = self.epochs.current.target  # (an epoch's target is within EpochClock's bounds)
            self._epochs_stood += 1
            self._state[load].epochs_since_probe += 1
            self.epochs.event(now)
            self.epochs.step(choice, load, self._reuse_left, bucket, batch_size)
        else:
            self.epochs.standing_step(now, bucket, batch_size)
        self._saw_load(batch_size)
        self._reuse_left -= 1
        self.chosen[choice] += 1
        if self._last_launch is not None:  # the interval the deciding step opened ends here
            self._close_interval(now)
            self._last_launch = None
            self._previous_choice = choice
        return True

    def _epoch_stands(self, choice: str, bucket: int) -> bool:
        """Whether a step of `choice` over a batch of cost bucket `bucket`, due to decide only because the epoch
        under way is full, opens the next epoch without a decision: plain steps, the model's choice (not a probe's)
        at the epoch's load and its last decided cost bucket, no probe due at this epoch's end (fewer than
        `probe_after` epochs of it since the last probe, or than the spacing `_explore` last computed with the
        probe budget, so `_explore` would not start one), and fewer than STANDING_EPOCHS epochs opened so since the
        last decision (which prices the choice again: realized figures move at each epoch's end). While plain steps
        run, nothing else that prices rounds moves (the module docstring). An epoch is about a request's life, so
        at concurrency 1 every request paid a decided step (the H100, 2026-11-25, served with the 1k shared prefix:
        ITL p99 659-711 us against a plain server's 433-468, one decided step a request).

        Not where that decision would begin a park (`_parks_at_end`): over a batch of detached requests only, the
        first epoch measured after a park ended is decided, so that the next park begins at its end. Stood, the
        STANDING_EPOCHS epochs after it ran told, a step at a time: on the H200 x4 (56ecd76, session 57, 1k shared
        prefix) every concurrency-1 level ran cycles of 8-9 requests parked and 5 told (the measured epochs in its
        debug log: ~36% of its requests), each told step ~6-8 us of host bookkeeping more than a parked one
        (`park`)."""
        cur = self.epochs.current
        if (choice != PLAIN or self._reuse_choice != PLAIN or self._probe_stood is not None or cur is None
                or cur.choice != PLAIN or not cur.full or bucket != self._reuse_bucket
                or self._epochs_stood >= STANDING_EPOCHS):
            return False
        st = self._state[cur.bucket]
        return (st.model_choice == PLAIN and not st.probing
                and st.epochs_since_probe + 1 < max(st.probe_after, st.spacing) and not self._parks_at_end(cur))

    def _parks_at_end(self, cur: Epoch) -> bool:
        """Whether the decision that ends `cur` (a full epoch of plain steps, the model's choice, its load's last
        decided batch of detached requests only: `decide`'s all_detached) would begin a park (`park`): none under
        way and nothing at its load holding one back (`_park_held`); `cur` itself, which the decision counts, is the
        epoch measured since the last park ended that a park waits for."""
        return self._all_detached and self._parked is None and not self._park_held(cur.bucket)

    def _park_held(self, load: int) -> bool:
        """A probe's cost still to be measured at `load`, or a joining request that would not detach there
        (`detach_blocker`): no park (`park`)."""
        return self._state[load].measure is not None or self.detach_blocker(load) is not None

    def stand_ahead(self, batch_size: int) -> tuple[int, int, int]:
        """Right after `repeat` let a step over `batch_size` requests stand: (n, lo, hi), where the next n steps
        over lo..hi requests (that step's cost bucket) would stand too, for as long as nothing else reaches the
        policy (each would find the same bucket and the same decision, its budget one step smaller); the strategy
        takes them without asking and replays them (`stood`)."""
        bucket = self.bucket_for(batch_size)
        lower = self.buckets.index(bucket)
        return self._reuse_left, (self.buckets[lower - 1] + 1 if lower else 1), bucket

    def stood(self, choice: str, times: list[float], batches: list[int],
              prefills: list[tuple[float, int]] = ()) -> None:
        """Standing steps of `choice` taken ahead (`stand_ahead`), launched at `times` over `batches` requests, and
        the prefills launched among them, (time, prompts completed) each: counted as `repeat` and `break_chain` would
        have counted them one by one (a prefill that extends drafts joining standing plain steps ends them:
        `drafts_joined`, after this replay). What `waited` would have been told meanwhile is not needed: no decided
        step's interval is open under standing steps (`_last_launch` is None), and the next decided step starts its
        count afresh."""
        if self._last_launch is not None:
            raise InvariantError("standing steps taken ahead while a decided step's interval is open")
        if len(times) > self._reuse_left:
            raise InvariantError(f"{len(times)} standing steps taken ahead, {self._reuse_left} granted")
        if times:
            bucket = self.bucket_for(batches[0])
            if self.bucket_for(max(batches)) != bucket or self.bucket_for(min(batches)) != bucket:
                raise InvariantError(f"standing steps taken ahead over batches {sorted(set(batches))} span cost "
                                     f"buckets; a ticket holds one")
        else:
            bucket = 0
        self.epochs.standing_steps(times, bucket, batches, prefills)
        if times:
            self._saw_load(max(batches))
        self._reuse_left -= len(times)
        self.chosen[choice] += len(times)
        if prefills:  # (break_chain's)
            self._previous_choice = None

    def park(self, d: Decision) -> tuple[int, int] | None:
        """Right after decision `d` (the step's launch marked): the load bucket and the number of plain steps the
        strategy may run parked, over batches of at most that load while the engine holds no more, the policy told
        nothing until they end (`unparked`); None: no park. Only where every request of the batch is detached
        (the caller's condition) and `d` is plain steps as the model's choice at a load where a request joining
        would be detached too (`detach_blocker`: settled or rounds out of reach, no probe under way, owed or
        waiting), no probe's cost still to be measured, and an epoch measured since the last park ended (so plain
        steps' realized figure is refreshed between parks). While parked no round can run (rounds are blocked over
        detached requests) and a request that joins with its draft ends the park, so what the policy would learn
        from those steps is plain steps' figure at a load where they are settled; taken step by step (tickets,
        epochs, a decided step at each idle gap and each epoch's end), that bookkeeping was ~6-8 us of host work a
        decode step on the H100 against a plain engine's (bench/adaptive_hooks.py, session 51), 1-2.5% of a
        host-bound step. At most PARK_EPOCHS epochs' steps of the load: `unparked` credits the epochs to the probe
        spacing, so a probe of rounds comes due at most that many epochs late."""
        cur = self.epochs.current
        if (d.choice != PLAIN or d.reason != "model" or cur is None or cur.choice != PLAIN
                or self.epochs.epochs <= self._epochs_at_unpark or self._parked is not None):
            return None
        if self._park_held(cur.bucket):
            return None
        self._parked = (cur.bucket, cur.target)
        self.parks += 1
        return cur.bucket, PARK_EPOCHS * cur.target

    def unparked(self, steps: int, busy: float) -> None:
        """The park granted by `park` ended after `steps` plain steps over `busy` seconds (its idle gaps left out):
        counted as chosen plain steps and as busy time (what the probe budget is a fraction of), their epochs
        credited to the load's probe spacing; the epoch under way ends unmeasured (most of its steps were not told)
        and the next step is decided."""
        if self._parked is None:
            raise InvariantError("a park ended that AdaptivePolicy.park never granted")
        load, target = self._parked
        self._parked = None
        self.chosen[PLAIN] += steps
        self.parked_steps += steps
        self._state[load].epochs_since_probe += steps // target
        self.epochs.skip(busy)
        self._epochs_at_unpark = self.epochs.epochs
        self._reuse_left = 0
        self._last_launch = None
        self._previous_choice = None
        self._not_host = 0.0

    # --- what the strategy reports back ----------------------------------------------------------------------------
    def _launched(self, choice: str, bucket: int, now: float) -> None:
        """A decode step is being launched at `now`: closes the interval the previous decode launch opened (if no
        prefill came between) and opens this one's."""
        if self._last_launch is not None:
            self._close_interval(now)
        self._last_launch = (now, choice, bucket, self._previous_choice == choice)
        self._previous_choice = choice
        self._not_host = 0.0

    def _close_interval(self, now: float) -> None:
        """The interval from the last decode launch to `now`: less what was not X (waits, launches, resolves), one
        sample of its bucket's X; whole, when its step was steady (the step before it had the same choice, so the
        interval holds one step of that choice and nothing of a switch), one sample of W for its choice."""
        t0, choice, bucket, steady = self._last_launch
        host = max(now - t0 - self._not_host, 0.0)
        self._add_host_sample(bucket, host)
        if steady:  # the interval holds this choice's own work, not the previous step's of the other choice
            _median(self.own_host_seconds, self._windows["own_host"], (choice, bucket), host, None)
        if steady and now - t0 <= OUTLIER_FACTOR * self._parts_seconds(choice, bucket):  # else a stall
            _ema(self.wall_seconds, self._counts["wall"], (choice, bucket), now - t0, OUTLIER_FACTOR)
            self.wall_decision[(choice, bucket)] = self._decisions[bucket]

    def _add_host_sample(self, bucket: int, seconds: float) -> None:
        _ema(self.other_host_seconds, self._counts["other_host"], bucket, seconds, OUTLIER_FACTOR)
        self._tables = None

    def break_chain(self, arrivals: int = 0) -> None:
        """A prefill that completes `arrivals` prompts is being launched: the next decode launch starts a new
        interval (its time is the epoch's, and so are its arrivals: EpochClock.prefill)."""
        self.epochs.prefill(self.clock(), arrivals)
        self._last_launch = None
        self._previous_choice = None
        self._not_host = 0.0

    def catch_up_launched(self, seconds: float) -> None:
        """A catch-up took `seconds` to launch (on the CPU: to run): not the epoch's time. It is the cost of a switch
        (plain steps or lazy prefills before a round), priced when a switch is decided (`catch_up_seconds`), not
        part of what steps of either choice cost in a steady run."""
        self.epochs.exclude(seconds)

    def prompt_extend_launched(self, seconds: float) -> None:
        """A prefill's eager draft extend took `seconds` to launch (on the CPU: to run). Rounds pay it (the work on
        arriving prompts); during an epoch of plain steps it is there only because rounds are expected for the
        requests joining (`steady_choice`), so it is not the plain steps' time: counted, it put the adaptive
        server's plain steps at 3x a plain server's on the H100 (1.35 against 0.46 ms at concurrency 8)."""
        cur = self.epochs.current
        if cur is not None and cur.choice == PLAIN:
            self.epochs.exclude(seconds)

    def drafts_joined(self) -> None:
        """A prefill extended the drafts of requests joining the batch (they need no catch-up): a standing choice of
        plain steps ends, and the next step decides whether rounds pay now. Standing to its epoch's end over such
        arrivals, plain steps left each a lag that priced its own rounds out at the next decision: in the offline
        replay at concurrency 1 (bench/replay_adaptive.py, every round accepting 4 drafts) one plain probe's epoch
        ran on into the next request, and every request after it decoded plainly (1430 plain steps, 1371 rounds).
        A standing choice of rounds goes on: the arrivals are what it needs."""
        if self._reuse_choice == PLAIN:
            self._reuse_left = 0
            self._epochs_stood = STANDING_EPOCHS  # (and the next epoch is decided: `_epoch_stands`)

    def idle(self, since: float | None = None) -> None:
        """The engine has nothing to launch (since `since` on the clock; None: now): the gap until its next launch is
        neither an interval nor busy time, and the load is gone: the next batch starts a new load window and decides
        afresh. The window counts decisions, which a standing one spaces up to REUSE_STEPS steps apart (plain steps:
        an epoch), so it spans ~1000 steps or more; kept across an idle gap, it priced a new level's batches as the
        previous level's drain: on the H200 (2026-11-23, 1k shared prefix) the first requests at concurrency 1 after
        a concurrency-64 level ran 99-136 rounds a pass at twice a plain step's cost per token, with no switch at
        load 1.

        A standing choice survives the gap for a batch of its own cost bucket or a larger one whose model choice is
        the same (`repeat`; the epoch goes on, and one that grows into a larger bucket is dropped as outgrown, as a
        level's ramp is), not for a smaller one (a lower load: its own epoch, or the previous level's figure would
        take its steps): at concurrency 1 every request follows such a gap, and deciding afresh after each one was a
        decided step per request at the start of its decoding, where nothing overlaps its host work (~0.3 ms of the
        2.5 ms a request an adaptive server spent more than a plain one at concurrency 1, shared prefix, H200,
        2026-11-25). Rounds too since session 35 (until then only plain steps): a new request's draft is current
        after its prefill under rounds, and a decision over it prices it at the prior, as the standing one was; on the
        H200 x4 (6128c32, 2026-11-26, 128-token prompts) the adaptive server decided 128 steps a 64-request level at
        concurrency 1 (2040 rounds), one at each request's start, and trailed the fixed server by 1.7% there."""
        self.epochs.idle()
        peak = max(self._peak_load, self._peak_before)
        if peak:  # the gap's first call (the engine may call again before anything launches)
            self._gap, self._peak_load, self._peak_before = (peak, self.clock() if since is None else since), 0, 0
        self._last_launch = None
        self._previous_choice = None
        self._not_host = 0.0
        self._recent_loads.clear()
        self._reuse_idle = True

    def waited(self, seconds: float) -> None:
        """Seconds since the last decode launch that were not X: the host blocked on the device, ran device work
        itself (CPU), launched a catch-up (counted in the catch-up's own cost) or read a step's results (counted
        in that step's resolve seconds)."""
        self._not_host += seconds

    def launched_host(self, choice: str, bucket: int, seconds: float) -> None:
        """The host spent `seconds` launching a step of `choice` at `bucket` (E; its catch-up not included)."""
        _median(self.launch_seconds, self._windows["launch"], (choice, bucket), seconds,
                self.launch_prior.get((choice, bucket)))
        self._not_host += seconds
        self._tables = None

    def resolved_host(self, choice: str, bucket: int, seconds: float) -> None:
        """The host spent `seconds` reading and applying the results of a step of `choice` at `bucket` (R)."""
        _median(self.resolve_seconds, self._windows["resolve"], (choice, bucket), seconds,
                self.resolve_seconds.get((_other(choice), bucket)))
        self._tables = None

    def measured(self, choice: str, bucket: int, device_seconds: float) -> None:
        """A launched step of `choice` at `bucket` took `device_seconds` on the device (without its catch-up)."""
        _median(self.measured_device_seconds, self._windows["device"], (choice, bucket), device_seconds,
                self.device_seconds[(choice, bucket)])
        self._tables = None

    def caught_up(self, positions: int, device_seconds: float, host_seconds: float) -> None:
        """A catch-up over `positions` missing positions took `device_seconds` on the device and `host_seconds` to
        launch (0 where the device work is the host's: it is then all in `device_seconds`). Like its launch
        (`catch_up_launched`), its device time past the launch is a switch's cost, not the epoch's: the steps after
        it waited that long. Left in, the epochs of rounds that followed plain steps carried the catch-up of the
        whole batch (at concurrency 64 on the H100, 2026-11-23, rounds' realized figure was 9.5-13 ms a round
        against ~8 ms for a fixed server's, prefills included)."""
        self.catch_ups += 1
        self.catch_up_positions += positions
        if host_seconds > 0:  # the device's work beyond its launch (already excluded) is not the epoch's either
            self.epochs.deduct(max(device_seconds - host_seconds, 0.0))
        self.catch_up_device.add(positions, device_seconds)
        self.catch_up_host.add(positions, host_seconds)
        self._tables = None

    def drafted_prompts(self, requests: int, device_seconds: float, host_seconds: float) -> None:
        """A prefill's eager draft extend took `device_seconds` on the device and `host_seconds` to launch, and
        completed the prompts of `requests` requests (0 for a chunk of a longer prompt)."""
        seconds = self.join(device_seconds, host_seconds)
        for name, value in (("draft_prompt_seconds", seconds), ("draft_prompt_requests", float(requests))):
            old = getattr(self, name)
            setattr(self, name, value if old is None else old + COST_ALPHA * (value - old))
        self._tables = None

    def accepted(self, request, drafts: int) -> None:
        """A speculative round of `request` accepted `drafts` draft tokens (`accepted_round` for one request)."""
        self.accepted_round((request,), (drafts,))

    def accepted_round(self, requests, drafts) -> None:
        """A speculative round's requests and the draft tokens each accepted (two sequences of one length): one of
        `accepted_rounds`."""
        self.accepted_rounds(((requests, drafts),))

    def accepted_rounds(self, rounds) -> None:
        """Speculative rounds, oldest first, each its requests and the draft tokens each accepted (two sequences of
        one length), in one pass: a round at concurrency 64 feeds 64 of them, on the host's critical path (the
        rounds as they came, not flattened: on the CPU, at concurrency 32 and eight rounds a read, joining them
        into two lists first took ~20 us a read, most of it touching each request once more). A retry's round (see the
        module docstring) that accepted at least half the prior restarts the request's EMA from it; one that did not
        doubles the lag before the next retry.

        The engine-wide acceptance (the prior) is the plain mean of the last ACCEPT_WINDOW counted request-rounds:
        about 16 requests' lives at concurrency 1. An EMA over ~20 rounds (the last) tracked the last request at
        concurrency 1, and the policy switches exactly when that is low: a bad request turned the batch plain, plain
        steps measure nothing, and the low figure stood. Offline on the H100 (2026-11-23, concurrency 1) it ended
        at 2.7 drafts per round while a fixed engine's rounds over the same prompts accepted 3.0, and most steps
        were plain although rounds committed 26% more per second, prefills included.

        The prior counts every round but a retry's: it is what a request without rounds of its own should expect,
        so the mean over the population of requests. A retry's round samples a request already known to be bad, at
        a time chosen because it is one; counted, retries biased the prior low exactly where plain steps dominate, as
        rounds there are mostly retries: offline at concurrency 1 on the H100 (2026-11-23) the prior was 2.3 drafts
        per round while a fixed engine's rounds over the same prompts accepted 2.9, and the policy kept the batch
        plain. From then until 2026-11-23 (session 13) every round of a collapsed request was left out too, and that
        fed back: with requests whose acceptance differs widely, leaving out the collapsed ones raises the prior,
        which collapses more of them (the line is a fraction of the prior), which raises it again. On the H100 with
        the 1k shared prefix (rounds commit 1.18 tokens) the adaptive server then ran rounds for 35-82% of its steps
        at concurrency 8 and was 32% behind plain (serving-...-171841.json); fed rounds from requests of which a
        fifth accept half their drafts and the rest almost none, that prior averaged 3.0-3.3x the mean of the
        rounds fed (three seeds; test_a_prior_over_mixed_requests_is_their_mean). Every new request was priced at
        it until its own rounds collapsed it, so batches of new requests looked worth rounds.

        A request-round counted more than ACCEPT_STALE_STEPS plain steps ago leaves the window when newer ones come:
        under plain steps only probes of rounds measure the acceptance, each adding one epoch's rounds to a window of
        ACCEPT_WINDOW, and the old ones outvoted them. Replayed at concurrency 1 (bench/replay_adaptive.py,
        2026-11-26): acceptance 1 for 256 requests, then 4: rounds took the load back more than 512 requests after
        the change, now within 128-256 (within 64 until session 39, while the thinned window re-inflated the cold
        start's prior, `prior_accept`; after 1024 requests at 1, within 64 either way); acceptance 0 then 4 (probes
        of rounds rarer, each costing more): 256-512, now 64-128. Over a stationary workload nothing moved that
        matters (shared-prefix-like acceptance, 0.19 drafts a round: -0.70% against plain decoding, was -0.69%;
        requests whose rounds accept 0, 1 or 4 drafts at random: -0.58%, was -0.53%; the 128-token trace:
        unchanged)."""
        half = self.engine_accept() / 2
        counted = []  # the drafts of the rounds the prior counts
        count, alpha = counted.append, REQUEST_ALPHA
        for requests, drafts in rounds:
            for request, accepted in zip(requests, drafts):
                own = request.accept_state
                if own is None:
                    request.accept_state = _RequestAcceptance(float(accepted))
                    count(accepted)
                elif own.retrying:  # a retry's round prices the request alone
                    if accepted >= half:
                        own.ema, own.retry_after = float(accepted), RETRY_FIRST
                    else:
                        own.ema += alpha * (accepted - own.ema)
                        own.rounds += 1
                        own.retry_after = min(2 * own.retry_after, RETRY_MAX)
                    own.retrying = False
                else:
                    count(accepted)
                    own.ema += alpha * (accepted - own.ema)
                    own.rounds += 1
        window, stamps, total = self._accept_window, self._accept_stamps, sum(counted)
        if counted:  # request-rounds from before a long stretch of plain steps price rounds no longer
            plain_steps = self.chosen[PLAIN]
            keep = ACCEPT_FRESH_MIN - len(counted)  # stale request-rounds that stay beside the fresh ones
            while stamps and stamps[0] < plain_steps - ACCEPT_STALE_STEPS and len(stamps) > keep:
                stamps.popleft()
                self._accept_sum -= window.popleft()
            stamps.extend(itertools.repeat(plain_steps, min(len(counted), ACCEPT_WINDOW)))
            self._accept_counted += len(counted)
            self._accept_drafts += total
            self._accept_squares += sum(map(operator.mul, counted, counted))
        if len(counted) >= window.maxlen:
            window.clear()
            window.extend(counted[-window.maxlen:])
            self._accept_sum = float(sum(window))
        else:
            overflow = len(window) + len(counted) - window.maxlen
            if overflow > 0:
                self._accept_sum -= sum(itertools.islice(window, overflow))
            window.extend(counted)
            self._accept_sum += total
        if not window:
            return
        self.global_accept = self._accept_sum / len(window)
        g = self.prior_accept()  # what the standing decision was priced at (`_reuse_accept`) is one too
        if abs(g - self._reuse_accept) > REUSE_ACCEPT_DRIFT * self._reuse_accept:
            self._reuse_left = 0  # the standing decision was priced at an acceptance that no longer holds
            self._epochs_stood = STANDING_EPOCHS

    # --- reporting ----------------------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """What /metrics shows: per bucket the last decision and its reason, the cost tables, the counts. The
        server takes one after every step, so the tables are rebuilt only after they changed (a decision, a
        sample); the counts are read each time."""
        if self._tables is None:
            self._tables = self._build_tables()
        return {**self._tables, "chosen": dict(self.chosen), "decided": sum(self._decisions.values()),
                "probes": self.probes, "probes_cut": self.probes_cut,
                "probe_cost_factor": {c: self._probe_factor(c) for c in CHOICES},
                "probe_cost_factor_at_load": {c: {load: self._probe_factor(c, load) for (choice, load)
                                                  in sorted(self.probe_cost_factor_at) if choice == c}
                                              for c in CHOICES},
                "global_accept": self.global_accept, "catch_ups": self.catch_ups,
                "catch_up_positions": self.catch_up_positions, "retries": self.retries,
                "parks": self.parks, "parked_steps": self.parked_steps,
                "epochs": self.epochs.epochs, "epochs_dropped": self.epochs.dropped,
                "epochs_drained": self.epochs.drained, "epochs_outgrown": self.epochs.outgrown}

    def _build_tables(self) -> dict:
        def per_choice(value) -> dict:
            return {c: {b: v for b in self.buckets if (v := value(c, b)) is not None} for c in CHOICES}

        fixed, per = self.catch_up_device.coefficients()
        host_fixed, host_per = self.catch_up_host.coefficients()
        return {
            "buckets": {b: st.last.as_dict() for b, st in self._state.items() if st.last is not None},
            "device_seconds": per_choice(self.device),
            "launch_seconds": per_choice(self.launch),
            "resolve_seconds": per_choice(lambda c, b: self.resolve_seconds.get((c, b))),
            "other_host_seconds": {b: v for b in self.buckets if (v := self.other_host_seconds.get(b)) is not None},
            "own_host_seconds": per_choice(lambda c, b: self.own_host_seconds.get((c, b))),
            "realized_ratio": self.epochs.table("ratio"),
            "realized_request_seconds": self.epochs.table("request_seconds"),
            "prompt_draft_seconds": (self.draft_prompt_seconds / self.draft_prompt_requests
                                     if self.draft_prompt_seconds is not None and self.draft_prompt_requests
                                     else None),
            "wall_seconds": per_choice(lambda c, b: self.wall_seconds.get((c, b))),
            "catch_up_seconds": {"device_fixed": fixed, "device_per_position": per, "host_fixed": host_fixed,
                                 "host_per_position": host_per},
        }


def _steady(batch_size: int, load: int) -> bool:
    """A batch of `batch_size` holds at least half its load bucket `load`: no level's ramp (arrivals in their
    prefills) or drain, where a probe may start (`AdaptivePolicy._explore`)."""
    return 2 * batch_size >= load


def _rate(tokens: float, seconds: float) -> float:
    """Tokens per second of a step that commits `tokens` in `seconds` (a step priced at 0 s: infinitely fast)."""
    return tokens / seconds if seconds > 0 else math.inf


def _ahead(spec_tokens: float, seconds: dict[str, float], margin: float) -> bool:
    """Whether rounds committing `spec_tokens` per request are expected to commit more than 1 + `margin` times
    plain steps' tokens per second, each step priced at `seconds[choice]`."""
    return _rate(spec_tokens, seconds[SPECULATIVE]) > (1.0 + margin) * _rate(1.0, seconds[PLAIN])


def _own_or_other(table: dict[tuple[str, int], float], choice: str, bucket: int) -> float:
    """The choice's entry at the bucket, else the other choice's (not run here yet), else 0."""
    return table.get((choice, bucket), table.get((_other(choice), bucket), 0.0))


def _ema(table: dict, counts: dict, key, sample: float, outlier: float | None = None) -> None:
    """Fold `sample` into table[key]: a running mean whose weights fall to COST_ALPHA (an EMA from then on); the
    first sample (or a value set directly) starts it. With `outlier`, a sample that many times the current value is
    dropped: an idle gap or a stall, not a step. `counts` (keyed like `table`) holds the samples behind each."""
    n = counts.get(key)
    if n is None:
        if key not in table:
            table[key], counts[key] = sample, 1
            return
        n = counts[key] = 1
    old = table[key]
    if outlier is not None and sample > outlier * max(old, 1e-6):
        return
    table[key] = old + max(1.0 / (n + 1), COST_ALPHA) * (sample - old)
    counts[key] = n + 1


def _median(table: dict, windows: dict, key, sample: float, prior: float | None) -> None:
    """table[key] = the (low) median of the key's last MEDIAN_WINDOW samples, `prior` counted as the first of them.
    One stalled step moves nothing, a real change shows after two samples: on the H100 one stalled plain step at
    batch 4 (device, launch and resolve 1.5-1.8 ms each, against 0.06-0.35 ms) had set all three EMAs (its first
    samples) and priced plain steps out of that bucket for a whole level."""
    window = windows.get(key)
    if window is None:
        window = windows[key] = collections.deque([] if prior is None else [prior], maxlen=MEDIAN_WINDOW)
    window.append(sample)
    table[key] = statistics.median_low(window)
