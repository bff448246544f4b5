"""Prefill batching (runtime/prefill_batching.py, `scheduler_delay_factor`): the admission rule on numbers, its
refusals, and an engine whose arrivals are held back while others decode: they join in one prefill launch
(instead of one each) and every request's tokens are those of an engine that admits at once.

Target: the bundled pycode-6m, plain and with its bundled EAGLE-3 head."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from spruce import LLM, SamplingParams
from spruce.config import builtin_draft_path, builtin_model_path
from spruce.errors import ConfigError
from spruce.runtime.prefill_batching import PREFILL_ALPHA, PrefillBatching
from spruce.runtime.request import Status
from spruce.server.metrics import Metrics
from conftest import assert_no_leaks

TARGET = builtin_model_path()


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def hold(batching: PrefillBatching, queued_at: list[float], free_slots: int = 6, waiting_tokens: int = 100,
         chunk_tokens: int = 2048, decoding: int = 3) -> bool:
    """`batching.hold` over stand-in requests: waiting ones queued at `queued_at` (`waiting_tokens` prompt tokens in
    all), `decoding` running ones decoding and one still prefilling."""
    waiting = [SimpleNamespace(queued_at=t, num_tokens=waiting_tokens if i == 0 else 0)
               for i, t in enumerate(queued_at)]
    running = [SimpleNamespace(status=Status.DECODE) for _ in range(decoding)]
    running.append(SimpleNamespace(status=Status.PREFILL))
    return batching.hold(waiting, running, free_slots, chunk_tokens)


def test_the_rule():
    """Held while requests decode, fewer wait than slots are free and their prompts fit a chunk, until the waits add
    up to the stall a prefill would cost the decoding requests (B x P) or the oldest waited f x P; nothing is held
    before a prefill was measured or with f = 0."""
    clock = Clock()
    batching = PrefillBatching(4.0, clock)
    assert not hold(batching, [clock.now])  # no prefill measured yet: no delay to wait for
    batching.launched(5e-3, 1)  # a prefill would stall 3 decoding requests 5 ms each: 15 ms
    start = clock.now
    assert hold(batching, [start])
    clock.now += 14e-3
    assert hold(batching, [start])  # one request waited 14 ms < 15
    assert not hold(batching, [start, start + 7e-3])  # 14 + 7 ms of waits > 15
    clock.now = start + 19e-3
    assert hold(batching, [start], decoding=8)  # 19 ms < 40 ms of stall, and < 4 x 5 ms
    clock.now = start + 21e-3
    assert not hold(batching, [start], decoding=8)  # the oldest waited over f x P = 20 ms
    fresh = [clock.now]
    assert not hold(batching, fresh, decoding=0)  # an idle engine admits at once
    assert not hold(batching, fresh * 6)  # they fill every free slot
    assert not hold(batching, fresh, waiting_tokens=2048)  # they fill a prefill chunk
    assert batching.held == 3
    off = PrefillBatching(0.0, clock)
    off.launched(5e-3, 1)
    assert not hold(off, fresh)


def test_the_price_is_the_part_of_a_launch_that_batching_saves():
    """Launches of 2-8 chunks at 0.4 ms + 0.3 ms a chunk (the shape served with the shared prefix at concurrency
    32-64): P is the fixed 0.4 ms, not their mean launch (~1.9 ms), so 3 decoding requests hold an arrival 1.2 ms,
    not 5.7 (a chunk's own 0.3 ms is paid whether it waits for company or not). With one chunk count seen, P is
    the mean launch."""
    clock = Clock()
    batching = PrefillBatching(4.0, clock)
    for chunks in (2, 4, 8, 3, 6, 5) * 4:
        batching.launched(0.4e-3 + 0.3e-3 * chunks, chunks)
    assert batching.prefill_seconds == pytest.approx(0.4e-3)
    start = clock.now
    clock.now += 1.1e-3
    assert hold(batching, [start])  # 1.1 ms of waits < 3 x 0.4 ms
    clock.now = start + 1.3e-3
    assert not hold(batching, [start])
    one_size = PrefillBatching(4.0, clock)
    for seconds in (1e-3, 2e-3):
        one_size.launched(seconds, 4)
    assert one_size.prefill_seconds == pytest.approx(1e-3 + PREFILL_ALPHA * 1e-3)


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, True, "2"])
def test_bad_factors_are_refused(bad):
    with pytest.raises(ConfigError, match=r"scheduler_delay_factor must be a finite number >= 0, got"):
        LLM(TARGET, scheduler_delay_factor=bad)


def test_a_factor_with_tensor_parallel_ranks_is_refused():
    with pytest.raises(ConfigError, match=r"scheduler_delay_factor=1.0 cannot run with tp_size=2"):
        LLM(TARGET, scheduler_delay_factor=1.0, tp_size=2)


@pytest.mark.parametrize("draft", [False, True])
def test_held_arrivals_join_one_prefill_and_generate_the_same_tokens(draft):
    """One request decodes; three more arrive a step apart. With the delay they wait (the clock stands still)
    and then join in one prefill launch; admitting at once takes two or three. Tokens equal either way."""
    prompts = ["def fib(n):\n    ", "import os\n", "for i in range(10):", "x = ["]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    # prefill launches of their own: a plain engine would otherwise run the prompts inside decode steps (mixed steps)
    kw = dict(max_running_requests=8, draft_model=str(builtin_draft_path()) if draft else None, mixed_steps=False)
    runs = {}
    for factor in (0.0, 4.0):
        llm = LLM(TARGET, scheduler_delay_factor=factor, **kw)
        engine = llm.engine
        clock = Clock()
        engine.scheduler.batching.clock = clock
        prefills = []
        launch = engine._launch_prefill
        engine._launch_prefill = lambda reqs: prefills.append(len(reqs)) or launch(reqs)
        engine.add_request(prompts[0], params, request_id="r0")
        for _ in range(3):
            engine.step()
        for i, p in enumerate(prompts[1:], 1):
            engine.add_request(p, params, request_id=f"r{i}")
            engine.step()
        held = engine.scheduler.batching.held
        clock.now += factor * engine.scheduler.batching.prefill_seconds  # the oldest has waited its delay
        outs = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o.token_ids
        runs[factor] = (outs, prefills, held)
        assert engine.stats()["prefill_holds"] == engine.scheduler.batching.held  # /metrics shows it
        metrics = Metrics(0)
        metrics.on_engine_stats(engine.stats())
        assert f"spruce_prefill_holds_total {engine.scheduler.batching.held}" in metrics.render()
        assert_no_leaks(llm)
    (base, base_prefills, base_held), (delayed, delayed_prefills, held) = runs[0.0], runs[4.0]
    assert delayed == base and len(base) == 4
    assert len(base_prefills) >= 3 and sum(base_prefills) == 4 and base_held == 0
    assert delayed_prefills == [1, 3] and held >= 3


def test_linear_cost_fit():
    """The launch cost's online fit (runtime/linear_cost.py): nothing before a sample, one size's mean, then a line."""
    from spruce.runtime.linear_cost import LinearCost

    fit = LinearCost(0.2)
    assert fit.predict(100) == 0.0
    fit.add(8, 1e-3)
    assert fit.predict(100) == pytest.approx(1e-3)  # one size seen: its mean
    for n in (8, 64, 8, 256, 32):
        fit.add(n, 0.5e-3 + 2e-6 * n)
    assert fit.coefficients()[1] > 0 and fit.predict(128) == pytest.approx(0.5e-3 + 2e-6 * 128, rel=0.2)
