"""A step that raises never leaves a request waiting (fail-stop, DESIGN §20).

A fault is injected into the engine once 10 requests are in (4 running with tokens out, 6 waiting; half of
them streaming): at the start of `Engine.step`, inside the launch of a decode step (under overlap, while the
step before it is launched but unread) or inside the resolve of a launched step. Every request must get its
answer at once (500 / an error event naming the fault), new requests 503, /health 503; `spruce serve` exits
with code 70. The serving benchmark client stops instead of waiting when its server fails or hangs.
Loopback only; seconds."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time

import httpx
import pytest

from server_util import MODEL_NAME, LogRecorder, ServerThread, engine_kwargs, one_torch_thread  # noqa: F401
from spruce import LLM
from spruce.runtime.engine import Engine
from spruce.server.graceful import ENGINE_FAILED_EXIT_CODE

pytestmark = pytest.mark.slow  # scheduled first (conftest)

REQUESTS = 10
RUNNING = 4
FAULT = "injected fault"
BODY = {"model": MODEL_NAME, "max_tokens": 200, "ignore_eos": True}
ANSWER_WITHIN_S = 10.0  # every request's answer after the fault (the engine's steps here take milliseconds)


def _full_house(engine: Engine) -> bool:
    """Every request is in, RUNNING of them decode with tokens out, the rest wait."""
    sched = engine.scheduler
    return (len(engine.requests) == REQUESTS and len(sched.running) == RUNNING
            and len(sched.waiting) == REQUESTS - RUNNING and all(q.output_ids for q in sched.running))


def inject_fault(engine: Engine, where: str) -> dict:
    """Raise RuntimeError(FAULT) once, at `where`, the first time `_full_house` holds there. Returns a record:
    "fired" is set to what was in flight when it raised."""
    record: dict = {}
    strategy = engine.strategy

    def armed(in_flight: bool) -> None:
        if not record and _full_house(engine):
            record["fired"] = {"launched_unread": in_flight}
            raise RuntimeError(FAULT)

    if where == "step":  # before the step starts: under overlap, the previous step is launched and unread
        real_step = engine.step
        engine.step = lambda *a, **k: (armed(engine._inflight is not None), real_step(*a, **k))[1]
    elif where == "launch":  # inside a decode launch, after plan (the step before it taken out of the engine)
        real_decode = strategy.decode
        strategy.decode = lambda *a, **k: (armed(any(q.inflight for q in engine.scheduler.running)),
                                           real_decode(*a, **k))[1]
    elif where == "resolve":  # a launched step, while it is read back
        real_resolve = engine._resolve
        engine._resolve = lambda *a, **k: (armed(True), real_resolve(*a, **k))[1]
    else:
        raise ValueError(f"unknown fault point {where!r}")
    return record


def make_llm(tmp_path, overlap: bool = True) -> LLM:
    return LLM(**engine_kwargs(tmp_path, context_length=256, max_running_requests=RUNNING,
                               disable_overlap_schedule=not overlap))


async def _one(client: httpx.AsyncClient, i: int) -> dict:
    """One request (even i: streamed); what its client saw and when."""
    body = {**BODY, "prompt": f"def f{i}(x):\n", "stream": i % 2 == 0}
    if not body["stream"]:
        r = await client.post("/v1/completions", json=body)
        return {"status": r.status_code, "error": r.json().get("error"), "t": time.monotonic()}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    error = json.loads(events[-2]).get("error") if len(events) >= 2 else None
    return {"status": r.status_code, "error": error, "events": events, "t": time.monotonic()}


async def _fire(base_url: str) -> list[dict]:
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        return await asyncio.gather(*(_one(client, i) for i in range(REQUESTS)))


def assert_failed_at_once(seen: list[dict], fired_at: float) -> None:
    """Every request ended with the engine's error, naming the fault, within ANSWER_WITHIN_S of it."""
    for i, s in enumerate(seen):
        err = s["error"]
        assert err is not None and err["code"] == "engine_failed" and FAULT in err["message"], (i, s)
        assert err["type"] == "server_error"
        if i % 2 == 0:
            assert s["status"] == 200 and s["events"][-1] == "[DONE]", s  # streams: an error event, then [DONE]
        else:
            assert s["status"] == 500, s
        assert s["t"] - fired_at < ANSWER_WITHIN_S, f"request {i} answered {s['t'] - fired_at:.1f} s after the fault"


@pytest.mark.parametrize("where, overlap", [("step", True), ("launch", True), ("resolve", True), ("launch", False)])
def test_failed_step_fails_every_request_and_refuses_new_ones(tmp_path, where, overlap):
    llm = make_llm(tmp_path, overlap)
    record = inject_fault(llm.engine, where)
    with LogRecorder() as logs, ServerThread(llm.engine) as srv:
        seen = asyncio.run(_fire(srv.base_url))
        assert "fired" in record, "the fault never fired"
        if overlap:  # the fault hit while a launched step was unread
            assert record["fired"]["launched_unread"]
        fired_at = min(s["t"] for s in seen)
        assert_failed_at_once(seen, fired_at)
        health = httpx.get(f"{srv.base_url}/health")
        assert health.status_code == 503 and health.json()["status"] == "engine failed"
        assert FAULT in health.json()["error"]
        r = httpx.post(f"{srv.base_url}/v1/completions", json={**BODY, "prompt": "x = 1\n", "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "engine_failed" and FAULT in r.json()["error"]["message"]
        loop = srv.engine_loop
        loop._thread.join(ANSWER_WITHIN_S)
        assert loop.in_flight == 0 and not loop._thread.is_alive()  # no request held, no thread stepping
        logs.wait_for("engine step failed")
        logs.wait_for(f"failing {REQUESTS} request(s) in flight")


def test_server_shuts_down_with_exit_code_70(tmp_path):
    llm = make_llm(tmp_path)
    record = inject_fault(llm.engine, "launch")
    srv = ServerThread(llm.engine, exit_on_engine_failure=True).start()
    try:
        seen = asyncio.run(_fire(srv.base_url))
        assert "fired" in record
        assert_failed_at_once(seen, min(s["t"] for s in seen))
        srv.thread.join(ANSWER_WITHIN_S)
        assert not srv.thread.is_alive(), "the server did not shut down after the engine failed"
        assert srv.server.exit_code == ENGINE_FAILED_EXIT_CODE
    finally:
        srv.stop()


SERVE_WITH_FAULT = """
import sys
from spruce.cli import main
from spruce.runtime.engine import Engine
real = Engine.step
def step(self, *a, **k):
    if self.requests and any(q.output_ids for q in self.scheduler.running):
        raise RuntimeError("injected fault")
    return real(self, *a, **k)
Engine.step = step
if __name__ == "__main__":
    sys.exit(main(["serve", "--port", "0", "--disable-speculative", "--context-length", "128", *sys.argv[1:]]))
"""


@pytest.mark.parametrize("keep_alive", [False, True], ids=["exit-70", "keep-alive"])
@pytest.mark.parametrize("engine_process", [True, False], ids=["engine-process", "engine-thread"])
def test_spruce_serve_exits_70_for_a_supervisor(tmp_path, keep_alive, engine_process):
    """The process itself: a request gets its 500 and `spruce serve` exits with code 70; with
    --keep-alive-on-engine-failure it stays up and /health answers 503 naming the failure. Both with the engine
    in its own process (the default: the script is a file, so the engine process imports it, patch
    included) and with --disable-engine-process."""
    log = tmp_path / "serve.log"
    script = tmp_path / "serve_with_fault.py"
    script.write_text(SERVE_WITH_FAULT)
    flags = (["--keep-alive-on-engine-failure"] if keep_alive else []) + ([] if engine_process
                                                                         else ["--disable-engine-process"])
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(script), *flags], stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 60
        while not (found := re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        r = httpx.post(f"{found.group(1)}/v1/completions", json={**BODY, "prompt": "def f(x):\n", "max_tokens": 50},
                       timeout=30)
        assert r.status_code == 500 and FAULT in r.json()["error"]["message"], r.text
        if keep_alive:
            with pytest.raises(subprocess.TimeoutExpired):
                proc.wait(2)  # the server ticks every 0.1 s: an exit on failure would have happened by now
            health = httpx.get(f"{found.group(1)}/health", timeout=30)
            assert health.status_code == 503 and FAULT in health.text, health.text
        else:
            assert proc.wait(30) == ENGINE_FAILED_EXIT_CODE, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert ("exit code 70" in log.read_text()) != keep_alive
    assert ("engine process serving" in log.read_text()) == engine_process  # the flag is honoured


# --- the serving benchmark client -----------------------------------------------------------------------------


def bench_args(*extra: str) -> argparse.Namespace:
    from spruce.bench.serving import add_serving_parser

    sub = argparse.ArgumentParser().add_subparsers()
    add_serving_parser(sub)
    return sub.choices["serving"].parse_args(["--max-tokens", "200", *extra])


def test_bench_stops_when_the_engine_fails(tmp_path):
    """Concurrency 4 (the engine runs 4, so the others wait) over 20 requests: the fault fails the 4 in flight,
    the level sends nothing more, the run ends with exit code 1 and the result says why."""
    from spruce.bench.serving import run_serving_bench

    llm = make_llm(tmp_path)
    engine = llm.engine
    real_step = engine.step
    steps = [0]

    def step(*a, **k):
        steps[0] += 1
        if steps[0] == 30:
            raise RuntimeError(FAULT)
        return real_step(*a, **k)

    engine.step = step
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": f"def f{i}(x):\n"}) + "\n" for i in range(8)))
    with ServerThread(engine) as srv:
        args = bench_args("--base-url", srv.base_url, "--concurrency", "4", "--num-requests", "20", "--warmup", "0",
                          "--prompts", str(prompts), "--prompt-tokens", "8", "--out-dir", str(tmp_path / "out"),
                          "--timeout", "30")
        t0 = time.monotonic()
        assert run_serving_bench(args) == 1
        assert time.monotonic() - t0 < 30
    result = json.loads(next((tmp_path / "out").glob("serving-*.json")).read_text())["figures"]
    (level,) = result["levels"]
    assert level["completed"] == 0 and level["failed"] == 20
    assert FAULT in level["stopped"] and result["stopped"] == level["stopped"]
    assert any(e.startswith("not sent: the run stopped") for e in level["errors"])


def test_bench_request_times_out_on_a_hung_server():
    """A server that accepts and never answers: each request fails after --timeout, and the level stops."""
    from spruce.bench.serving import run_level

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    args = bench_args("--timeout", "0.5")

    async def level():
        return await run_level(f"http://127.0.0.1:{listener.getsockname()[1]}", {}, MODEL_NAME, ["def f(x):\n"], 2,
                               6, args)

    try:
        t0 = time.monotonic()
        lv = asyncio.run(level())
        assert time.monotonic() - t0 < 5
    finally:
        listener.close()
    assert lv["completed"] == 0 and lv["failed"] == 6 and lv["stopped"] == "timed out after 0.5 s"
    assert sorted(lv["errors"]) == ["not sent: the run stopped (timed out after 0.5 s)", "timed out after 0.5 s"]


def test_bench_refuses_a_timeout_that_is_not_positive(capsys):
    from spruce.bench.serving import run_serving_bench

    assert run_serving_bench(bench_args("--timeout", "0")) == 2
    assert "--timeout must be > 0 seconds, got 0.0" in capsys.readouterr().err


def test_bench_refuses_request_counts_that_do_not_match_the_levels(capsys):
    from spruce.bench.serving import run_serving_bench

    assert run_serving_bench(bench_args("--concurrency", "1", "4", "--num-requests", "6", "8", "9")) == 2
    assert "one per --concurrency level (2), got [6, 8, 9]" in capsys.readouterr().err
    assert run_serving_bench(bench_args("--num-requests", "0")) == 2
    assert run_serving_bench(bench_args("--client-processes", "-1")) == 2
    assert "--client-processes must be >= 0 (0: automatic), got -1" in capsys.readouterr().err
