"""Serving faults: overload (503 + Retry-After), request timeouts (504), clients that vanish (mid-upload,
mid-generation, 64 streams with a third hanging up) and SIGTERM on a `spruce serve` process with open streams.
Loopback only; small max_tokens keep it to seconds."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from conftest import assert_no_leaks
from server_util import (  # noqa: F401
    MODEL_NAME, LogRecorder, ServeProcess, ServerThread, engine_kwargs, five_xx, metric, one_torch_thread, wait_idle,
)
from spruce import LLM

LONG = {"model": MODEL_NAME, "prompt": "class A:\n", "max_tokens": 240, "ignore_eos": True}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    llm = LLM(**engine_kwargs(tmp_path_factory.mktemp("draft"), context_length=256, max_running_requests=8))
    yield llm
    assert_no_leaks(llm)


def sse_payloads(lines) -> list[str]:
    """The `data:` payloads of an SSE response's lines."""
    return [line[6:] for line in lines if line.startswith("data: ")]


def wait_metric(base_url: str, name: str, predicate, timeout: float = 10.0) -> float:
    """Poll /metrics until `predicate(value of name)` holds; returns the value."""
    deadline = time.monotonic() + timeout
    while True:
        value = metric(httpx.get(f"{base_url}/metrics").text, name)
        if predicate(value):
            return value
        assert time.monotonic() < deadline, f"{name} stayed at {value}"
        time.sleep(0.02)


def aborted(base_url: str) -> float:
    text, name = httpx.get(f"{base_url}/metrics").text, 'spruce_requests_finished_total{finish_reason="abort"}'
    return metric(text, name) if name in text else 0.0  # the series appears with the first abort


def raw_request(port: int, body: bytes, content_length: int | None = None) -> socket.socket:
    """A POST /v1/completions on a raw socket: headers (Content-Length defaults to the body's) and `body`."""
    sock = socket.create_connection(("127.0.0.1", port))
    length = len(body) if content_length is None else content_length
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % length + body)
    return sock


def test_overload_answers_503_with_retry_after(llm):
    with ServerThread(llm.engine, max_queued_requests=2) as srv:
        url = f"{srv.base_url}/v1/completions"
        with httpx.stream("POST", url, json={**LONG, "n": 10, "stream": True}) as held:  # 8 run, 2 wait
            assert held.status_code == 200
            r = httpx.post(url, json={**LONG, "max_tokens": 4})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            err = r.json()["error"]
            assert err["type"] == "server_error" and err["code"] == "server_overloaded" and "retry" in err["message"]
        assert metric(wait_idle(srv.base_url), "spruce_kv_pages_used") == 0
        r = httpx.post(url, json={**LONG, "max_tokens": 4})
        assert r.status_code == 200, r.text


def test_request_timeout_answers_504(llm):
    with ServerThread(llm.engine, request_timeout=0.3) as srv:
        url = f"{srv.base_url}/v1/completions"
        t0 = time.monotonic()
        r = httpx.post(url, json=LONG)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout", r.text
        assert time.monotonic() - t0 < 5
        with httpx.stream("POST", url, json={**LONG, "stream": True}) as r:
            events = sse_payloads(r.iter_lines())
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "timeout"
        assert metric(wait_idle(srv.base_url), "spruce_kv_pages_used") == 0
        assert httpx.post(url, json={**LONG, "max_tokens": 2}).status_code == 200


def test_disconnect_mid_upload_is_quiet(llm):
    """Headers promise 1000 bytes, the client hangs up after 12: an INFO line, not an ERROR traceback or a 500."""
    with LogRecorder() as logs, ServerThread(llm.engine) as srv:
        sock = raw_request(srv.port, b'{"prompt": "', content_length=1000)
        time.sleep(0.1)
        sock.close()
        logs.wait_for("client disconnected before sending the whole request body")
        assert five_xx(srv.base_url) == 0
        assert logs.problems() == []


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_aborts_the_request_between_steps(llm, stream):
    with ServerThread(llm.engine) as srv:
        before = aborted(srv.base_url)
        sock = raw_request(srv.port, json.dumps({**LONG, "stream": stream}).encode())
        wait_metric(srv.base_url, "spruce_kv_pages_used", lambda v: v > 0)
        generated = metric(httpx.get(f"{srv.base_url}/metrics").text, "spruce_generation_tokens_total")
        sock.close()
        wait_metric(srv.base_url, "spruce_kv_pages_used", lambda v: v == 0, timeout=3)
        text = httpx.get(f"{srv.base_url}/metrics").text
        assert aborted(srv.base_url) == before + 1
        assert metric(text, "spruce_generation_tokens_total") - generated < LONG["max_tokens"]
        llm.engine.check_no_leaks()


async def _stream(client: httpx.AsyncClient, i: int, hang_up: bool) -> str:
    body = {**LONG, "prompt": f"def f{i}(x):\n", "max_tokens": 6, "stream": True, "seed": i, "temperature": 0.8}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = []
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if hang_up:
                    return "hung up"
    assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1]), events[-2:]
    return "completed"


def test_64_streams_with_a_third_hanging_up(llm):
    async def drive(base_url):
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            return await asyncio.gather(*(_stream(client, i, i % 3 == 0) for i in range(64)))

    with ServerThread(llm.engine) as srv:
        results = asyncio.run(drive(srv.base_url))
        assert results.count("hung up") == 22 and results.count("completed") == 42
        text = wait_idle(srv.base_url)
        for name in ("spruce_kv_pages_used", "spruce_requests_running", "spruce_requests_waiting"):
            assert metric(text, name) == 0, name
        assert five_xx(srv.base_url) == 0
        llm.engine.check_no_leaks()


async def _sigterm_clients(server: ServeProcess) -> dict:
    """Two long streams and a long non-stream request run; a short stream is admitted, then SIGTERM; during the
    drain a new request and /health are tried. Returns what each client saw."""
    long = {"prompt": "import os\n", "max_tokens": 480, "ignore_eos": True}
    seen: dict = {}

    async def stream(name: str, body: dict, first: asyncio.Event) -> None:
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            first.set()  # the response has started: the request is admitted
            seen[name] = sse_payloads([line async for line in r.aiter_lines()])

    async def plain(name: str, body: dict) -> None:
        r = await client.post("/v1/completions", json=body)
        seen[name] = (r.status_code, r.json())

    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
        started = [asyncio.Event() for _ in range(3)]
        tasks = [asyncio.create_task(stream("long0", long, started[0])),
                 asyncio.create_task(stream("long1", long, started[1])),
                 asyncio.create_task(plain("plain", long))]
        await asyncio.wait_for(asyncio.gather(started[0].wait(), started[1].wait()), 20)
        tasks.append(asyncio.create_task(stream("short", {**long, "max_tokens": 24}, started[2])))
        await asyncio.wait_for(started[2].wait(), 20)
        server.terminate()
        await asyncio.sleep(0.5)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as fresh:
            seen["during_drain"] = (await fresh.post("/v1/completions", json={**long, "max_tokens": 2})).status_code
            seen["health"] = (await fresh.get("/health")).status_code
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
    return seen


def test_sigterm_drains_then_exits_cleanly(tmp_path):
    server = ServeProcess(tmp_path / "serve.log", "--context-length", "512", "--max-running-requests", "4",
                          "--shutdown-grace-period", "3", "--log-level", "info")
    try:
        server.start()
        sock = raw_request(int(server.base_url.rsplit(":", 1)[1]), b'{"prompt": ', content_length=500)
        sock.close()  # a mid-upload disconnect: must not leave a traceback in the log either
        seen = asyncio.run(_sigterm_clients(server))
        code = server.wait(30)
    finally:
        server.kill()
    log = server.log()
    assert code == 0, log[-3000:]
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
    assert "4 engine request(s) in flight" in log and "ending 3 engine request(s)" in log, log[-3000:]
    short = seen["short"]
    assert short[-1] == "[DONE]" and json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
    for name in ("long0", "long1"):
        events = seen[name]
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["code"] == "server_shutting_down" and "shutting down" in error["message"] and error["type"] == "server_error"
    status, body = seen["plain"]
    assert status == 503 and "shutting down" in body["error"]["message"]
    assert seen["during_drain"] == 503 and seen["health"] == 503
