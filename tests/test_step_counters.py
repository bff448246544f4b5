"""The engine's step counters (runtime/step_counters.py) and when a serving loop takes the engine's stats
(server/metrics.py StatsCadence; the engine process sends an idle step's stats after its outputs, and the server's
readers wait for them).

Target: the bundled pycode-6m, plain and with its bundled EAGLE-3 head."""

from __future__ import annotations

import gc
import multiprocessing
import threading
import time

import pytest

from spruce import SamplingParams
from spruce.config import builtin_draft_path, builtin_model_path
from spruce.server.engine_loop import EngineLoop
from spruce.server.engine_process import _EngineServer
from spruce.server.metrics import Metrics, StatsCadence

TARGET = builtin_model_path()


@pytest.mark.parametrize("draft", [None, "eagle3"])
def test_counts_every_launch_and_its_rows(make_llm, draft):
    """Three requests admitted together: one prefill launch, then decode launches whose rows sum to the decode
    steps each request took (it took max_tokens - 1 of them, its first token coming from the prefill: plain) and
    whose rounds are every decode launch with a draft; Engine.step's parts add up to no more than its wall time."""
    kwargs = {} if draft is None else dict(draft_model=builtin_draft_path(), speculative_algorithm="EAGLE3")
    llm = make_llm(model=TARGET, device="cpu", page_size=4, **kwargs)
    outs = llm.generate(["def fib(n):", "class A:", "import os"], SamplingParams(max_tokens=12, temperature=0))
    steps = llm.engine.stats()["steps"]
    assert steps["prefills"] == 1
    assert steps["rounds"] == (steps["decodes"] if draft else 0)
    if draft is None:
        assert steps["decode_rows"] == sum(len(o.token_ids) - 1 for o in outs)
    else:  # a round commits 1 to S + 1 tokens per row
        assert sum(len(o.token_ids) - 1 for o in outs) / (llm.engine.limits.num_steps + 1) <= steps["decode_rows"]
        assert steps["decode_rows"] <= sum(len(o.token_ids) - 1 for o in outs)
    assert set(steps["seconds"]) == {"launch", "wait", "resolve", "outputs"}
    assert all(v >= 0 for v in steps["seconds"].values()) and steps["seconds"]["launch"] > 0
    assert 0 < steps["prefill_launch"] <= steps["seconds"]["launch"]  # the one prefill's launch, within "launch"


def test_metrics_expose_the_counters(make_llm):
    llm = make_llm(model=TARGET, device="cpu")
    llm.generate(["def fib(n):"], SamplingParams(max_tokens=6, temperature=0))
    metrics = Metrics(0, {})
    metrics.on_engine_stats(llm.engine.stats() | {"process_seconds": {"step": 0.5, "send": 0.25},
                                                  "process_cpu_seconds": 0.625})
    text = metrics.render()
    assert 'spruce_engine_steps_total{kind="prefill"} 1' in text
    assert 'spruce_engine_steps_total{kind="decode"} 5' in text
    assert "spruce_engine_decode_rows_total 5" in text
    assert f"spruce_engine_prefill_launch_seconds_total {llm.engine.stats()['steps']['prefill_launch']!r}" in text
    assert 'spruce_engine_step_seconds_total{part="launch"}' in text
    assert 'spruce_engine_process_seconds_total{part="send"} 0.25' in text
    assert "spruce_engine_process_cpu_seconds_total 0.625" in text
    served = float(next(line.split()[1] for line in text.splitlines()
                        if line.startswith("spruce_server_process_cpu_seconds_total ")))
    assert 0 < served <= time.process_time()  # this process's own CPU seconds when rendered


def test_stats_cadence():
    """Always once the engine is idle; while it is busy, at most once per interval."""
    now = [10.0]
    cadence = StatsCadence(0.05, clock=lambda: now[0])
    assert cadence.due(busy=True)  # the first step's
    now[0] += 0.01
    assert not cadence.due(busy=True)
    assert cadence.due(busy=False)  # idle: the snapshot a scrape after the requests reads
    now[0] += 0.049
    assert not cadence.due(busy=True)
    now[0] += 0.002
    assert cadence.due(busy=True)
    assert not cadence.due(busy=True)
    now[0] += 0.051
    assert not cadence.with_step(busy=False)  # an idle step's stats follow its outputs, not with it
    assert cadence.with_step(busy=True) and not cadence.with_step(busy=True)


def test_step_and_stats_takes_stats_only_when_due(make_llm):
    llm = make_llm(model=TARGET, device="cpu")
    eng = llm.engine
    eng.add_request("def fib(n):", SamplingParams(max_tokens=4, temperature=0))
    seen = []
    while eng.has_unfinished():
        outputs, stats = eng.step_and_stats(lambda busy: (seen.append(busy), not busy)[1])
        assert (stats is None) == seen[-1]
    assert seen[-1] is False and stats["steps"]["decodes"] == 3
    assert eng.step_and_stats()[1] is not None  # no cadence: every step


def test_readers_wait_for_the_stats_announced():
    """The engine process sends the stats of a step that leaves the engine idle after its outputs: once announced
    (`expect_stats`), a scrape waits for them and sees them; a failure releases the wait."""
    metrics = Metrics()
    metrics.on_engine_stats({"tokens_generated": 1, "running": 1})
    metrics.expect_stats()
    threading.Timer(0.2, metrics.on_engine_stats, args=({"tokens_generated": 9, "running": 0},)).start()
    t0 = time.monotonic()
    assert "spruce_requests_running 0" in metrics.render()
    assert time.monotonic() - t0 >= 0.15
    assert metrics.snapshot()["tokens_generated"] == 9
    metrics.expect_stats()
    metrics.expect_stats(False)  # the engine failed: none will come
    t0 = time.monotonic()
    metrics.render()
    assert time.monotonic() - t0 < 0.1


def test_engine_process_sends_idle_stats_after_the_outputs():
    """The engine process's loop over a pipe: the step that leaves the engine idle goes out without stats, flagged
    (stats_follow), and its stats right after it; a busy step's stats go with it when the cadence says so."""
    class Engine:  # runs two steps for a request, then is idle
        steps = 0

        def add_request(self, ids, params, request_id=None):
            self.steps = 2

        def has_unfinished(self):
            return self.steps > 0

        def step_and_stats(self, due, shared=False):
            self.steps -= 1
            return [], ({"taken": "with its step"} if due(self.has_unfinished()) else None)

        def stats(self):
            return {"taken": "after its step"}

    here, there = multiprocessing.Pipe()
    server = _EngineServer(Engine(), there)
    loop = threading.Thread(target=server.run)
    loop.start()
    here.send(("add", 1, [([1, 2], SamplingParams(max_tokens=2), "r")]))
    got = [here.recv() for _ in range(4) if here.poll(10)]
    here.send(("stop",))
    loop.join(10)
    gc.callbacks.remove(server._on_gc)
    assert len(got) == 4, got
    assert got[0] == ("reply", 1, None)
    (_, _, busy_stats, busy_follow), (_, _, idle_stats, idle_follow), (kind, stats) = got[1], got[2], got[3]
    assert busy_stats["taken"] == "with its step" and busy_follow is False  # the cadence's first: due
    assert idle_stats is None and idle_follow is True
    assert kind == "stats" and stats["taken"] == "after its step" and "process_seconds" in stats


def test_engine_thread_takes_idle_stats_after_the_outputs():
    """The engine thread's loop (--disable-engine-process, tensor parallel) as the engine process: the step that
    leaves the engine idle has its outputs dispatched first, its stats announced before them and taken after; a busy
    step's stats go with it when the cadence says so. A failure releases readers waiting for stats."""
    events = []

    class Engine:  # runs two steps for a request, then is idle
        steps = 2

        def has_unfinished(self):
            return self.steps > 0

        def step_and_stats(self, due, shared=False):
            self.steps -= 1
            return ["out"], ({"taken": "with its step"} if due(self.has_unfinished()) else None)

        def stats(self):
            events.append("stats taken")
            return {"taken": "after its step"}

    class Recorder(Metrics):
        def expect_stats(self, expected=True):
            events.append(f"expect {expected}")
            super().expect_stats(expected)

        def on_engine_stats(self, stats):
            events.append(f"stats {stats['taken']}")
            super().on_engine_stats(stats)

    loop = EngineLoop(Engine(), Recorder())
    loop._dispatch = lambda outputs: events.append(f"dispatch {outputs}")
    events.clear()
    loop._iteration([])
    loop._iteration([])
    assert events == ["dispatch ['out']", "stats with its step",  # busy: the cadence's first, with its step
                      "expect True", "dispatch ['out']", "stats taken", "stats after its step"]
    assert loop.metrics.snapshot()["taken"] == "after its step"

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    loop.engine.step_and_stats = broken
    loop._pending = True
    events.clear()
    loop._run()
    assert "expect False" in events and loop.failure is not None
