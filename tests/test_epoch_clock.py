"""EpochClock (speculative/epoch_clock.py): busy seconds per request-step and over modelled seconds over epochs,
prefill time included, idle gaps excluded, short runs dropped, two disturbed epochs of five outvoted, an epoch that
holds a stall or a drain dropped, each step modelled at its own batch's cost."""

from __future__ import annotations

import pytest

from spruce.speculative.epoch_clock import EPOCH_MAX, EPOCH_MIN, EpochClock


def per_step(choice: str, bucket: int) -> float:
    """Every step modelled at one second: the ratio reads as busy seconds per step."""
    return 1.0


def run(clock: EpochClock, t: float, choice: str, steps: int, step_s: float, bucket: int = 8,
        target: int = EPOCH_MIN, prefill_every: int = 0, prefill_s: float = 0.0) -> float:
    """`steps` decode steps of `step_s` seconds each, a prefill of `prefill_s` after every `prefill_every`-th."""
    for i in range(steps):
        clock.event(t)
        clock.step(choice, bucket, target, bucket, bucket)
        t += step_s
        if prefill_every and (i + 1) % prefill_every == 0:
            clock.event(t)  # the prefill's launch
            t += prefill_s
    return t


def test_prefill_time_counts_and_idle_time_does_not():
    """Rounds of 1 ms with a 7 ms prefill after every 4th (an arrival): 2.75 ms per step, which is what a server
    running only rounds pays. An idle gap (the engine out of work) is not counted."""
    clock = EpochClock(per_step)
    t = run(clock, 0.0, "speculative", 2 * EPOCH_MIN, 1e-3, prefill_every=4, prefill_s=7e-3)
    clock.idle()
    t = run(clock, t + 5.0, "speculative", EPOCH_MIN + 1, 1e-3, prefill_every=4, prefill_s=7e-3)
    assert clock.epochs == 3
    assert clock.ratio("speculative", 8) == pytest.approx(2.75e-3)
    assert clock.ratio("plain", 8) is None and clock.ratio("speculative", 16) is None


def test_a_short_run_measures_nothing_and_a_long_one_is_cut():
    clock = EpochClock(per_step)
    t = run(clock, 0.0, "plain", EPOCH_MIN - 1, 1e-3)
    t = run(clock, t, "speculative", 1, 1e-3)  # another choice ends the plain run: too short to keep
    assert clock.ratio("plain", 8) is None and clock.epochs == 0
    run(clock, t, "plain", EPOCH_MAX + 1, 1e-3, target=10 ** 6)  # the target is capped at EPOCH_MAX steps
    assert clock.epochs == 1 and clock.current.steps == 1


def plain_epochs(clock: EpochClock, t: float, probes: list[bool], step: float = 1e-3) -> float:
    """Plain epochs at load 8, a probe's where `probes` says so, each `step` seconds a step and ended by a round."""
    for probe in probes:
        for _ in range(EPOCH_MIN):
            clock.event(t)
            clock.step("plain", 8, EPOCH_MIN, 8, 8, probe=probe)
            t += step
        t = run(clock, t, "speculative", 1, 1e-3)  # another choice ends it
    return t


def test_a_probes_epoch_counts_apart():
    """An epoch that a probe opened is marked so: it counts among the epochs behind its figure, not among those its
    choice ran as the model's (AdaptivePolicy._margin); an epoch merged from a probe's and the next is not a
    probe's."""
    clock = EpochClock(per_step)
    plain_epochs(clock, 0.0, [False, False, True, True])
    assert clock.count("plain", 8) == 2 and clock.count("plain", 8, probes=False) == 0
    clock = EpochClock(per_step)
    plain_epochs(clock, 0.0, [True, False])
    assert clock.count("plain", 8) == 2 and clock.count("plain", 8, probes=False) == 1
    assert clock.current.probe is False and clock.current.merged(clock.current).probe is False


def test_a_probes_epoch_drops_what_its_choice_measured_before_the_switch():
    """The epochs a choice ran as the load's model choice price it until its first probe's epoch after a switch
    away: then they, and any probe's epoch before them, leave the window (b32202e's bar on the H100: rounds' window
    of five epochs at 289 us a request-step, where the level's rounds cost ~175, kept the concurrency-8 level in
    plain steps through two probes of rounds). Until then, and for the model choice's own epochs, the window is the
    last EPOCH_WINDOW epochs."""
    clock = EpochClock(per_step)
    t = plain_epochs(clock, 0.0, [True] + [False] * 5, step=2e-3)  # a probe, then five slow epochs as the model's
    assert clock.count("plain", 8) == 5 and clock.request_seconds("plain", 8) == pytest.approx(2e-3 / 8)
    t = plain_epochs(clock, t, [True], step=1e-3)  # the first probe after the switch: its epoch alone
    assert clock.count("plain", 8) == 1 and clock.request_seconds("plain", 8) == pytest.approx(1e-3 / 8)
    plain_epochs(clock, t, [True, False], step=1e-3)
    assert clock.count("plain", 8) == 3 and clock.count("plain", 8, probes=False) == 1


def test_one_disturbed_epoch_moves_nothing():
    clock = EpochClock(per_step)
    t = run(clock, 0.0, "plain", EPOCH_MIN, 1e-3)
    t = run(clock, t, "plain", EPOCH_MIN, 9e-3)  # a stall
    run(clock, t, "plain", EPOCH_MIN + 1, 1e-3)
    assert clock.ratio("plain", 8) == pytest.approx(1e-3)
    assert clock.table() == {"plain": {8: pytest.approx(1e-3)}}


def test_two_disturbed_epochs_of_five_move_nothing():
    """The H100 prefix run at concurrency 8 (e430067): about one plain epoch in ten at load 8 held a ~90 ms stall of
    the whole process (1.3-1.7x the others' busy time; not a compilation, not a garbage collection). Two such
    epochs among the last three set the low median of three, priced plain steps at 1.3x, and switched the level to
    rounds that commit 1.17 tokens at 1.6x a plain step. Of five, two move nothing."""
    clock = EpochClock(per_step)
    t = run(clock, 0.0, "plain", 3 * EPOCH_MIN, 1e-3)
    t = run(clock, t, "plain", 2 * EPOCH_MIN, 1.6e-3)
    run(clock, t, "plain", 1, 1e-3)  # ends the second disturbed epoch
    assert clock.count("plain", 8) == 5
    assert clock.ratio("plain", 8) == pytest.approx(1e-3)
    assert clock.request_seconds("plain", 8) == pytest.approx(1e-3 / 8)


def test_the_figure_is_busy_seconds_per_request_step():
    """An epoch at load 32 whose requests end together: 54 steps over 32 requests, then 73 over the one left while
    the successors arrive, then one over all 32 again (the H200's debug log, 2026-11-23, `{32: 54, 1: 73}`). Its
    figure is its busy seconds over the 1,833 request-steps, whatever the parts say (they only set the ratio), and
    load / figure is the tokens per busy second plain steps committed."""
    parts = {"seconds": 2e-3}
    clock = EpochClock(lambda choice, bucket: parts["seconds"])
    t = 0.0
    for batch, n in ((32, 54), (1, 73), (32, 1)):
        if batch == 32 and n == 1:
            clock.prefill(t, arrivals=31)
            t += 4e-3
        for _ in range(n):
            clock.event(t)
            clock.step("plain", 32, 128, 32 if batch == 32 else 1, batch)
            t += 0.6e-3 if batch == 32 else 0.3e-3
    run(clock, t, "speculative", 1, 1e-3)  # ends the epoch
    busy = 55 * 0.6e-3 + 73 * 0.3e-3 + 4e-3
    assert clock.request_seconds("plain", 32) == pytest.approx(busy / (55 * 32 + 73))
    assert clock.ratio("plain", 32) == pytest.approx(busy / (128 * 2e-3))
    parts["seconds"] = 4e-3  # the parts move later: the figure stays what the epoch measured
    assert clock.request_seconds("plain", 32) == pytest.approx(busy / (55 * 32 + 73))
    assert clock.drained == 0


def feed(clock: EpochClock, t: float, choice: str, batches: list[int], bucket: int = 8) -> float:
    """One decode step of 1 ms per batch size in `batches` at load `bucket`, a prefill (its arrivals) before each
    step whose batch grew."""
    for i, batch in enumerate(batches):
        if i and batch > batches[i - 1]:
            clock.prefill(t, arrivals=batch - batches[i - 1])
        clock.event(t)
        clock.step(choice, bucket, EPOCH_MIN, bucket, batch)
        t += 1e-3
    return t


def test_a_drain_is_dropped_and_a_ramp_kept():
    """The H200 run `-033247` (2026-11-24, 1k shared prefix): the concurrency-32 and -64 levels' drains (requests
    end, none arrive) passed through load 8 and left plain epochs of a few requests a step there; plain steps' ratio
    at load 8 read 2.15 against ~1 in the concurrency-8 levels, and the next concurrency-8 level ran rounds for 97%
    of its steps. An epoch whose arrivals are fewer than half the requests that ended in it, and which the next
    epoch does not continue (same choice and load), is dropped; a ramp (arrivals, none ended) and a steady epoch
    (as many arrived as ended) are kept."""
    clock = EpochClock(per_step)
    t = feed(clock, 0.0, "plain", [8 - (7 * i) // (EPOCH_MIN - 1) for i in range(EPOCH_MIN)])  # 8 down to 1
    t = feed(clock, t, "plain", [1] * EPOCH_MIN, bucket=4)  # the drain goes on at a smaller load
    assert clock.drained == 0 and clock.epochs == 0  # the load-8 epoch waits for the one after it ...
    t = run(clock, t, "speculative", 1, 1e-3)  # ... which was not its own: dropped; load 4's (none ended) kept
    assert clock.drained == 1 and clock.epochs == 1 and clock.request_seconds("plain", 8) is None
    for batches in ([1, 1, 2, 4] + [8] * (EPOCH_MIN - 4),  # a ramp: 7 arrive after the first
                    [8] * (EPOCH_MIN // 2) + [5] + [8] * (EPOCH_MIN // 2 - 1)):  # steady: 3 end, 3 arrive
        t = feed(clock, t, "plain", batches)
        t = run(clock, t, "speculative", 1, 1e-3)
    assert clock.drained == 1 and clock.epochs == 3 and clock.count("plain", 8) == 2


def test_an_epoch_fed_more_arrivals_than_its_load_takes_is_dropped():
    """The H100 prefix run at e3014e6 (2026-11-25): a concurrency-8 level's cohorts ended together under plain steps,
    the load window started over at the first successor, and epochs at load 1 of 21-35 steps held the prefills of a
    second arrival (490-830 us a request-step against ~270 for concurrency 1's). An epoch at load n into which more
    than 2n per `target` steps, plus one, arrived is dropped as outgrown; a concurrency-1 epoch of a whole request
    life with a second arrival, and a steady load-8 epoch, are kept."""
    clock = EpochClock(per_step)

    def epoch(bucket: int, steps: int, arrivals_at: dict[int, int], t: float) -> float:  # arrivals before step i
        for i in range(steps):
            if i in arrivals_at:
                clock.prefill(t, arrivals=arrivals_at[i])
                t += 2e-3
            clock.event(t)
            clock.step("plain", bucket, 128, bucket, bucket)
            t += 0.3e-3
        return run(clock, t, "speculative", 1, 1e-3)  # ends it

    t = epoch(1, 128, {1: 1}, 0.0)  # concurrency 1: one request's life
    t = epoch(1, 128, {1: 1, 100: 1}, t)  # ... two requests' prompts in one epoch: kept
    assert clock.count("plain", 1) == 2 and clock.outgrown == 0
    steady = clock.request_seconds("plain", 1)
    t = epoch(1, 21, {1: 1, 10: 1}, t)  # a cohort's successors arriving: two prompts in 21 steps
    t = epoch(1, 70, {1: 1, 20: 4, 40: 6}, t)  # a larger level's ramp under one decoding request
    assert clock.outgrown == 2 and clock.count("plain", 1) == 2 and clock.request_seconds("plain", 1) == steady
    epoch(8, 128, {1: 8, 64: 8}, t)  # load 8: a cohort ends and its successors arrive, twice: kept
    assert clock.outgrown == 2 and clock.count("plain", 8) == 1


def test_requests_that_end_together_across_an_epoch_boundary_are_one_epoch():
    """Under plain steps, equal-length requests end together and their successors arrive a client's round trip
    later. An epoch that ends between the two looks drained (all ended, none arrived) and the next like a ramp; on
    the H200 (c2ece4a, 2026-11-24) 22 epochs of one concurrency-32 level were dropped as drains, each the full
    batches' half of a cohort, and plain steps read 19.5k tokens/s there against the plain server's 29k. Continued
    by an epoch of the same choice and load, the two are measured as one."""
    clock = EpochClock(per_step)
    t = feed(clock, 0.0, "plain", [8] * (EPOCH_MIN - 2) + [1, 1])  # the cohort ends in its last two steps
    t = feed(clock, t, "plain", [1] * 3 + [8] * (EPOCH_MIN - 3))  # ... its successors arrive in the next epoch
    run(clock, t, "speculative", 1, 1e-3)
    assert clock.drained == 0 and clock.epochs == 1
    busy, request_steps = 2 * EPOCH_MIN * 1e-3, 8 * (2 * EPOCH_MIN - 5) + 5
    assert clock.request_seconds("plain", 8) == pytest.approx(busy / request_steps)


def test_an_epoch_that_holds_a_stall_is_dropped():
    """A Triton compilation (the stall count grows) inside the first epoch at a load: that epoch measures the stall
    and is dropped; the next one, clean, sets the figure. Without the count it would have stood alone in its window
    (on the H100, plain steps' ratio read 7.75 and priced them out of a level)."""
    stalls = [0]
    clock = EpochClock(per_step, lambda: stalls[0])
    clock.event(0.0)
    clock.step("plain", 8, EPOCH_MIN, 8, 8)
    stalls[0] += 1  # the first step's launch compiled a kernel: 0.5 s
    t = run(clock, 0.5, "plain", EPOCH_MIN - 1, 1e-3)
    t = run(clock, t, "plain", EPOCH_MIN + 1, 1e-3)
    assert clock.epochs == 1 and clock.dropped == 1
    assert clock.ratio("plain", 8) == pytest.approx(1e-3)
    unwatched = EpochClock(per_step)  # the same run with no stall count: the stalled epoch is the figure
    unwatched.event(0.0)
    unwatched.step("plain", 8, EPOCH_MIN, 8, 8)
    run(unwatched, 0.5, "plain", EPOCH_MIN, 1e-3)
    assert unwatched.ratio("plain", 8) > 0.03


def rounds_after_a_catch_up(clock: EpochClock, launch_s: float, device_s: float, deduct_s: float) -> None:
    """An epoch of 1 ms rounds whose first runs a catch-up: its launch (`launch_s`, excluded at once) and the device
    work the next steps wait for (`device_s` in all); `deduct_s` is deducted once its events are read, a step later."""
    t = 0.0
    for i in range(EPOCH_MIN + 1):
        clock.event(t)
        clock.step("speculative", 8, EPOCH_MIN, 8, 8)
        if i == 0:
            clock.exclude(launch_s)
            t += device_s
        if i == 1 and deduct_s:
            clock.deduct(deduct_s)
        t += 1e-3


def test_a_catch_up_is_not_the_epochs_time():
    """A catch-up before a switch (2.7 ms here) is the switch's cost: excluded, the epoch holds only its steps."""
    clock = EpochClock(per_step)
    rounds_after_a_catch_up(clock, 2.7e-3, 2.7e-3, 0.0)
    assert clock.ratio("speculative", 8) == pytest.approx(1e-3)


def test_a_catch_ups_device_time_read_later_is_deducted():
    """The catch-up's launch took 1 ms (excluded at once); its device work ran 5 ms, so the steps after it waited
    4 ms more: read from its events a step later, those 4 ms leave the epoch too."""
    clock = EpochClock(per_step)
    rounds_after_a_catch_up(clock, 1e-3, 5e-3, 4e-3)
    assert clock.ratio("speculative", 8) == pytest.approx(1e-3)


def test_a_prompt_extend_is_not_a_plain_epochs_time():
    """A prefill's eager draft extend (rounds expected for the joining request) lands in an epoch of plain steps:
    it is rounds' work, so the plain epoch leaves it out; an epoch of rounds keeps it."""
    from spruce.speculative.adaptive_policy import PLAIN, SPECULATIVE, AdaptivePolicy

    now = [0.0]
    policy = AdaptivePolicy((8,), {(c, 8): 1e-3 for c in (PLAIN, SPECULATIVE)}, overlapped=True, max_accept=3,
                            clock=lambda: now[0])
    for choice in (PLAIN, SPECULATIVE):
        policy.epochs = EpochClock(per_step)
        for i in range(EPOCH_MIN + 1):
            policy.epochs.event(now[0])
            policy.epochs.step(choice, 8, EPOCH_MIN, 8, 8)
            if i == 3:
                policy.prompt_extend_launched(4e-3)
                now[0] += 4e-3
            now[0] += 1e-3
        want = 1e-3 if choice == PLAIN else 1e-3 + 4e-3 / EPOCH_MIN
        assert policy.epochs.ratio(choice, 8) == pytest.approx(want)


def test_each_step_is_modelled_at_its_own_batch():
    """An epoch at load 64 whose requests end together (steps over batches of buckets 64 down to 1 while their
    successors arrive, then 64 again) against one of full batches: each step is modelled at its own batch's cost,
    so both epochs read the same ratio when the steps cost what their parts say (busy seconds per step would put
    the dip's steps at under half a full one's)."""
    cost = {1: 0.25e-3, 8: 0.3e-3, 16: 0.4e-3, 32: 0.6e-3, 64: 1.0e-3}  # host-bound: mostly a fixed cost
    clock = EpochClock(lambda choice, bucket: cost[bucket])
    dip = [64, 32, 16, 8] + [1] * (EPOCH_MIN - 5) + [64]
    t = 0.0
    for choice, buckets in (("plain", dip), ("speculative", [64] * EPOCH_MIN), ("plain", [1])):
        for i, b in enumerate(buckets):
            if choice == "plain" and i == len(dip) - 1:
                clock.prefill(t, arrivals=63)  # the successors, parts-free here
            clock.event(t)
            clock.step(choice, 64, EPOCH_MIN, b, b)
            t += 1.5 * cost[b]  # what the parts miss: half as much again
    assert clock.ratio("plain", 64) == pytest.approx(1.5)
    assert clock.ratio("speculative", 64) == pytest.approx(1.5)
    assert 1.5 * sum(cost[b] for b in dip) / len(dip) < 1.5 * cost[64] / 2


def test_a_standing_step_counts_as_an_event_and_a_step():
    """`standing_step` (a standing decision's step, AdaptivePolicy.repeat) is `event` then the epoch's `add`: two
    clocks fed the same launches, exclusions, prefills and idle gaps, one each way, end with the same figures."""
    def feed(clock: EpochClock, standing: bool) -> EpochClock:
        t = 0.0
        for i in range(3 * EPOCH_MIN):
            if i % EPOCH_MIN == 0:  # a deciding step starts each epoch
                clock.event(t)
                clock.step("plain", 8, EPOCH_MIN, 8, 8)
            elif standing:
                clock.standing_step(t, 4 if i % 3 else 8, 3 if i % 3 else 7)
            else:
                clock.event(t)
                clock.current.add(4 if i % 3 else 8, 3 if i % 3 else 7)
            t += 1e-3 * (1 + i % 4)
            if i % 7 == 0:
                clock.exclude(2e-4)  # a catch-up's launch
            if i % 11 == 0:
                clock.prefill(t, arrivals=8)
                t += 3e-3
            if i == 20:
                clock.idle()
                t += 1.0
        clock.event(t)
        clock.step("speculative", 8, EPOCH_MIN, 8, 8)  # ends the last plain epoch
        return clock

    modelled = lambda choice, bucket: bucket * 1e-4  # noqa: E731
    a, b = feed(EpochClock(modelled), True), feed(EpochClock(modelled), False)
    assert a.epochs == b.epochs == 3
    assert a.busy_total == pytest.approx(b.busy_total)
    assert a.ratio("plain", 8) == pytest.approx(b.ratio("plain", 8))
    assert a.request_seconds("plain", 8) == pytest.approx(b.request_seconds("plain", 8))


@pytest.mark.parametrize("prefills", [[], [(5e-4, 2), (3.5e-3, 1), (3.6e-3, 0)], [(9.5e-3, 3)]])
@pytest.mark.parametrize("excluded", [0.0, 2e-4, 5e-3])
def test_standing_steps_in_one_pass_are_standing_steps_one_by_one(excluded, prefills):
    """`standing_steps` (a ticket's replay) leaves the epoch and the clock as `standing_step` per step and `prefill`
    per prefill launched among them (before the first step, between two, after the last) would: busy time, the
    total, steps, request-steps, first and last batch, steps per bucket, prefills, arrivals, the last launch; with
    time excluded before the first launch (a catch-up's), more than that gap too (nothing counted for it)."""
    def feed(one_pass: bool) -> EpochClock:
        clock = EpochClock(lambda choice, bucket: 1e-4)
        clock.event(0.0)
        clock.step("plain", 8, EPOCH_MIN, 8, 8)
        clock.exclude(excluded)
        times, batches = [1e-3 * (i + 1) + 1e-5 * i * i for i in range(9)], [7, 8, 8, 6, 5, 8, 7, 8, 8]
        if one_pass:
            clock.standing_steps(times, 8, batches, prefills)
        else:
            steps = [(t, "step", b) for t, b in zip(times, batches)]
            for t, kind, n in sorted(steps + [(t, "prefill", arrivals) for t, arrivals in prefills]):
                if kind == "step":
                    clock.standing_step(t, 8, n)
                else:
                    clock.prefill(t, n)
        return clock

    a, b = feed(True), feed(False)
    ca, cb = a.current, b.current
    assert (ca.steps, ca.request_steps, ca.first_batch, ca.last_batch, dict(ca.step_buckets), ca.prefills,
            ca.arrivals) == (cb.steps, cb.request_steps, cb.first_batch, cb.last_batch, dict(cb.step_buckets),
                             cb.prefills, cb.arrivals)
    assert ca.busy == pytest.approx(cb.busy, abs=1e-15) and a.busy_total == pytest.approx(b.busy_total, abs=1e-15)
    assert a._last == b._last and a._excluded == b._excluded == 0.0
    assert ca.steps == 10 and ca.busy > 0 and ca.prefills == len(prefills)


def test_the_epochs_tool_reads_what_the_clock_logs(caplog):
    """bench/adaptive_epochs.py parses the debug line EpochClock logs for each epoch it closes (the format is the
    contract between them): two steady epochs of plain steps at load 8 (1 ms a step over 8 requests: 125 us a
    request-step) and one of rounds over batches of 2 (not steady at load 8)."""
    import logging

    import bench_scripts

    tool = bench_scripts.load("adaptive_epochs")
    clock = EpochClock(per_step)
    with caplog.at_level(logging.DEBUG, logger="spruce.adaptive.epochs"):
        t = run(clock, 0.0, "plain", 2 * EPOCH_MIN, 1e-3)
        for _ in range(EPOCH_MIN):
            clock.event(t)
            clock.step("speculative", 8, EPOCH_MIN, 2, 2)
            t += 2e-3
        run(clock, t, "plain", 1, 1e-3)  # ends the epoch of rounds
    epochs = tool.parse(r.getMessage() for r in caplog.records)
    assert [(e["choice"], e["load"], e["steps"], e["request_steps"]) for e in epochs] == [
        ("plain", 8, EPOCH_MIN, 8 * EPOCH_MIN), ("plain", 8, EPOCH_MIN, 8 * EPOCH_MIN),
        ("speculative", 8, EPOCH_MIN, 2 * EPOCH_MIN)]
    summary = tool.summarize(epochs)
    assert summary["8/plain"]["steady"]["epochs"] == 2 and summary["8/plain"]["other"]["epochs"] == 0
    assert summary["8/plain"]["steady"]["median_us_per_request_step"] == pytest.approx(125.0, rel=1e-3)
    assert summary["8/speculative"]["other"]["epochs"] == 1
    assert summary["8/speculative"]["other"]["median_us_per_request_step"] == pytest.approx(1000.0, rel=1e-3)

