"""The serving benchmark's load generator: one level's streaming requests, sent from this process or split over
several client processes.

One Python process parsing every streamed chunk is itself a limit: on the H100 the client of `spruce bench serving`
used 0.9 of a CPU at concurrency 32-64 while plain decoding streamed ~7,000 chunks a second, so those levels
measured the client as much as the server. With `processes` > 1 the level's requests and its concurrency are
dealt over that many processes (request i to process i mod n), each with its own event loop and connections; they
start together at an agreed instant and the level lasts from the first start to the last end.

Each level opens fresh connections: a connection kept alive from an earlier level may have been closed by the
server meanwhile (uvicorn closes idle ones after 5 s), and the first request on it failed with a ReadError.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import multiprocessing
import os
import re
import time
from dataclasses import dataclass, field

import httpx

ENGINE_FAILED = "engine_failed"  # the error code of a server whose engine failed (spruce.server.engine_loop)
START_DELAY_S = 0.5  # client processes start sending this long after the level hands them their requests


@dataclass
class RequestResult:
    ok: bool
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)  # gaps between streamed chunks after the first
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served by the prefix cache (usage.prompt_tokens_details)
    fatal: bool = False  # the run cannot go on: the request timed out, the server is gone or its engine failed


@dataclass
class Sent:
    """What one client process (or this one) sent in a level: its results, why it stopped sending early (None: it
    did not), and its start, end (time.monotonic, which all processes of a machine share) and CPU seconds."""

    results: list[RequestResult]
    stopped: str | None
    started: float
    ended: float
    cpu_seconds: float


def client_processes(requested: int, concurrency: int) -> int:
    """Client processes for a level: `requested`, or when 0 (auto) one per 4 streams in flight (one process ran at
    0.85 CPU at concurrency 8 on the H100), at most 8 and at most half this machine's CPUs (the servers need the
    rest)."""
    if requested > 0:
        return min(requested, concurrency)
    return max(1, min(math.ceil(concurrency / 4), 8, (os.cpu_count() or 2) // 2))


def process_pool(processes: int) -> concurrent.futures.ProcessPoolExecutor:
    """A pool of `processes` client processes (spawned: no state of this one is shared), all started and answering
    now, so that no level pays their start-up (a process starting late would stretch its level)."""
    pool = concurrent.futures.ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"))
    pids: set[int] = set()
    for _ in range(50):
        pids |= set(pool.map(_pid, range(4 * processes)))
        if len(pids) == processes:
            return pool
    pool.shutdown()
    raise RuntimeError(f"only {len(pids)} of {processes} client processes started")


def _pid(_task: int) -> int:
    time.sleep(0.01)  # long enough that one process cannot take every task of a round
    return os.getpid()


async def send_level(base_url: str, headers: dict, model: str, prompts: list, concurrency: int,
                     num_requests: int, args, pool: concurrent.futures.ProcessPoolExecutor | None = None,
                     processes: int = 1) -> Sent:
    """Send `num_requests` streaming requests (request i gets prompts[i mod len]) with `concurrency` in flight,
    from this process (processes == 1) or dealt over `processes` of `pool`'s. The merged result: all requests,
    the first reason a process stopped, the span from the first start to the last end, and the CPU seconds of the
    busiest process."""
    if processes <= 1 or pool is None:
        return await _send(base_url, headers, model, prompts, list(range(num_requests)), concurrency, args)
    start_at = time.monotonic() + START_DELAY_S
    loop = asyncio.get_running_loop()
    jobs = [loop.run_in_executor(pool, _send_in_process, base_url, headers, model, prompts,
                                 list(range(k, num_requests, processes)), len(range(k, concurrency, processes)),
                                 args, start_at)
            for k in range(processes)]
    parts: list[Sent] = await asyncio.gather(*jobs)
    return Sent([r for part in parts for r in part.results],
                next((part.stopped for part in parts if part.stopped), None),
                min(part.started for part in parts), max(part.ended for part in parts),
                max(part.cpu_seconds for part in parts))


def _send_in_process(base_url: str, headers: dict, model: str, prompts: list, indices: list[int], concurrency: int,
                     args, start_at: float) -> Sent:
    """A client process's share of a level (see `send_level`), started at `start_at`."""
    return asyncio.run(_send(base_url, headers, model, prompts, indices, concurrency, args, start_at))


async def _send(base_url: str, headers: dict, model: str, prompts: list, indices: list[int], concurrency: int,
                args, start_at: float | None = None) -> Sent:
    """Send the requests `indices` with `concurrency` in flight over fresh connections. A fatal failure (see
    RequestResult.fatal) stops the sending: the requests not sent yet fail with its reason."""
    todo = iter(indices)
    results: list[RequestResult] = []
    stopped: list[str] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=args.timeout, limits=limits) as client:

        async def worker():
            for i in todo:
                if stopped:
                    results.append(RequestResult(ok=False, error=f"not sent: the run stopped ({stopped[0]})"))
                    continue
                res = await stream_one(client, model, prompts[i % len(prompts)], args)
                results.append(res)
                if res.fatal and not stopped:
                    stopped.append(res.error)

        if start_at is not None:
            await asyncio.sleep(max(start_at - time.monotonic(), 0.0))
        started, cpu = time.monotonic(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        ended = time.monotonic()
    return Sent(results, stopped[0] if stopped else None, started, ended, time.process_time() - cpu)


async def stream_one(client: httpx.AsyncClient, model: str, prompt, args) -> RequestResult:
    """One streaming request, failed (not raised) on any error; at most `args.timeout` seconds in all."""
    res = RequestResult(ok=False)
    try:
        await asyncio.wait_for(_stream_into(res, client, model, prompt, args), args.timeout)
    except TimeoutError:
        res.ok, res.fatal = False, True
        res.error = f"timed out after {args.timeout:g} s"
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
        res.fatal = isinstance(e, (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError))
    return res


async def _stream_into(res: RequestResult, client: httpx.AsyncClient, model: str, prompt, args) -> None:
    """Send one streaming request and fill `res` as its chunks come."""
    body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": not args.no_ignore_eos}
    t0 = time.perf_counter()
    last = None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            text = await r.aread()
            res.error = f"HTTP {r.status_code}: {text[:200]!r}"
            res.fatal = ENGINE_FAILED.encode() in text
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # the request id the server prefixes is left out: errors are counted by kind
                res.error = re.sub(r"^(chatcmpl|cmpl)-\w+: ", "", chunk["error"].get("message", "error"))
                res.fatal = chunk["error"].get("code") == ENGINE_FAILED
                return
            if chunk.get("usage"):
                res.output_tokens = chunk["usage"]["completion_tokens"]
                res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                details = chunk["usage"].get("prompt_tokens_details") or {}
                res.cached_tokens = details.get("cached_tokens", 0)
            if any(c.get("text") for c in chunk.get("choices", [])):
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - t0
                else:
                    res.itls.append(now - last)
                last = now
    res.e2e = time.perf_counter() - t0
    res.ok = True
