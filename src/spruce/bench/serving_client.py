"""The serving benchmark's load generator: one level's streaming requests, sent from this process or from several
client processes.

One Python process parsing every streamed chunk is itself a limit: on the H100 the client of `spruce bench serving`
used 0.9 of a CPU at concurrency 32-64 while plain decoding streamed ~7,000 chunks a second, so those levels
measured the client as much as the server. With `processes` > 1 the level's concurrency is split over that many
processes (`ClientPool`), each with its own event loop and connections, and they take the level's requests from
one shared counter (request i gets prompt i mod len): a process that runs slower than the others takes fewer
requests instead of leaving its share to be sent after the others finished.

Before a level's clock starts, every process opens its connections (one `GET /health` per stream in flight) and
reports ready; the pool starts them all together once every one has. Each level opens fresh connections: a
connection kept alive from an earlier level may have been closed by the server meanwhile (uvicorn closes idle ones
after 5 s), and the first request on it would fail with a ReadError. Requests are not dealt to the processes in
advance: a process that starts or connects late would then send its share after the others' and the level would
hold fewer streams than its concurrency. Whatever delays a process (a late start or a slow connect) falls before
the clock starts, and a process that still lags takes fewer requests.

And before a level's clock starts, every process collects and freezes its heap (gc.freeze): the client imports torch
(~190k objects the collector tracks), and a full collection, which the results of earlier levels set off now and
then, walks them all (~90 ms) with no chunk read: a stall the level would read as a gap between two tokens of
the server's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import math
import multiprocessing
import os
import random
import re
import time
from dataclasses import dataclass, field

import httpx

from spruce.server.heap import freeze_startup_objects

ENGINE_FAILED = "engine_failed"  # the error code of a server whose engine failed (spruce.server.engine_loop)
READY_TIMEOUT_S = 60.0  # the longest a level waits for its client processes to open their connections


@dataclass
class RequestResult:
    ok: bool
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)  # gaps between streamed chunks after the first
    tail: float = 0.0  # from the last chunk with text to the stream's end (the finish and usage chunks, [DONE])
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served by the prefix cache (usage.prompt_tokens_details)
    fatal: bool = False  # the run cannot go on: the request timed out, the server is gone or its engine failed


@dataclass
class Sent:
    """What one client process (or this one) sent in a level: its results, why it stopped sending early (None: it
    did not), its start and end (time.monotonic, which all processes of a machine share), its CPU seconds, and
    for a merged level the spread of its processes' starts and ends (seconds from the first to the last)."""

    results: list[RequestResult]
    stopped: str | None
    started: float
    ended: float
    cpu_seconds: float
    start_spread: float = 0.0
    end_spread: float = 0.0


def client_processes(requested: int, concurrency: int) -> int:
    """Client processes for a level: `requested`, or when 0 (auto) one per 4 streams in flight (one process ran at
    0.85 CPU at concurrency 8 on the H100), at most 8 and at most half this machine's CPUs (the servers need the
    rest)."""
    if requested > 0:
        return min(requested, concurrency)
    return max(1, min(math.ceil(concurrency / 4), 8, (os.cpu_count() or 2) // 2))


class _Shared:
    """A level's state shared by the client processes (multiprocessing values, inherited by each process when the
    pool starts it): the next request index, the stop flag (a process met a fatal failure), how many processes are
    ready, and the instant they all start (0 until the pool gives it)."""

    def __init__(self, ctx):
        self.next_request = ctx.Value("q", 0)
        self.stop = ctx.Value("b", 0)
        self.ready = ctx.Value("i", 0)
        self.go = ctx.Value("d", 0.0)

    def reset(self) -> None:
        for value in (self.next_request, self.stop, self.ready, self.go):
            value.value = 0

    def take(self, num_requests: int) -> int | None:
        """The next request index of the level (None: all are taken)."""
        with self.next_request.get_lock():
            i = self.next_request.value
            if i >= num_requests:
                return None
            self.next_request.value = i + 1
        return i


_shared: _Shared | None = None  # in a client process: the pool's shared level state (set by `_init_process`)


def _init_process(shared: _Shared) -> None:
    global _shared
    _shared = shared


class ClientPool:
    """`processes` client processes (spawned: no state of this one is shared but `_Shared`), all started and
    answering on return, so that no level pays their start-up."""

    def __init__(self, processes: int):
        ctx = multiprocessing.get_context("spawn")
        self.shared = _Shared(ctx)
        self.executor = concurrent.futures.ProcessPoolExecutor(processes, mp_context=ctx, initializer=_init_process,
                                                               initargs=(self.shared,))
        pids: set[int] = set()
        for _ in range(50):
            pids |= set(self.executor.map(_pid, range(4 * processes)))
            if len(pids) == processes:
                return
        self.executor.shutdown()
        raise RuntimeError(f"only {len(pids)} of {processes} client processes started")

    def shutdown(self) -> None:
        self.executor.shutdown()


def _pid(_task: int) -> int:
    time.sleep(0.01)  # long enough that one process cannot take every task of a round
    return os.getpid()


async def send_level(base_url: str, headers: dict, model: str, prompts: list, concurrency: int,
                     num_requests: int, args, pool: ClientPool | None = None, processes: int = 1) -> Sent:
    """Send `num_requests` streaming requests (request i gets prompts[i mod len]) with `concurrency` in flight,
    from this process (processes == 1) or from `processes` of `pool`'s, which take the requests from a shared
    counter and start together once all have opened their connections (module docstring). The merged result: all
    requests, the first reason a process stopped, the span from the first start to the last end, and the CPU
    seconds of the busiest process."""
    if processes <= 1 or pool is None:
        taken = iter(range(num_requests))
        return await _send(base_url, headers, model, prompts, lambda: next(taken, None), concurrency, args)
    shared = pool.shared
    shared.reset()
    loop = asyncio.get_running_loop()
    jobs = [loop.run_in_executor(pool.executor, _send_in_process, base_url, headers, model, prompts, num_requests,
                                 len(range(k, concurrency, processes)), args)
            for k in range(processes)]
    deadline = time.monotonic() + READY_TIMEOUT_S
    while shared.ready.value < processes and not any(job.done() for job in jobs):  # a job done early has failed
        if time.monotonic() > deadline:
            shared.stop.value = 1
            shared.go.value = time.monotonic()
            await asyncio.gather(*jobs, return_exceptions=True)
            raise RuntimeError(f"only {shared.ready.value} of {processes} client processes were ready within "
                               f"{READY_TIMEOUT_S:g} s")
        await asyncio.sleep(0.002)
    shared.go.value = time.monotonic()
    parts: list[Sent] = await asyncio.gather(*jobs)
    starts, ends = [part.started for part in parts], [part.ended for part in parts]
    return Sent([r for part in parts for r in part.results],
                next((part.stopped for part in parts if part.stopped), None), min(starts), max(ends),
                max(part.cpu_seconds for part in parts), max(starts) - min(starts), max(ends) - min(ends))


def _send_in_process(base_url: str, headers: dict, model: str, prompts: list, num_requests: int, concurrency: int,
                     args) -> Sent:
    """A client process's part of a level (see `send_level`): its `concurrency` streams take requests from the
    pool's shared counter until `num_requests` are taken."""
    shared = _shared

    async def ready() -> None:
        with shared.ready.get_lock():
            shared.ready.value += 1
        while shared.go.value == 0.0:
            await asyncio.sleep(0.001)

    return asyncio.run(_send(base_url, headers, model, prompts, lambda: shared.take(num_requests), concurrency,
                             args, ready, shared.stop))


async def _send(base_url: str, headers: dict, model: str, prompts: list, take, concurrency: int, args,
                ready=None, stop=None) -> Sent:
    """Send the requests whose indices `take()` hands out (None: no more) with `concurrency` in flight over fresh
    connections, opened first (then `ready()`, if given, returns when the level starts). A fatal failure (see
    RequestResult.fatal) stops the sending, in every process (`stop`, shared): the requests not sent yet fail with
    its reason."""
    results: list[RequestResult] = []
    stopped: list[str] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=args.timeout, limits=limits) as client:

        async def worker():
            while (i := take()) is not None:
                if stopped or (stop is not None and stop.value):
                    results.append(RequestResult(ok=False, error=f"not sent: the run stopped "
                                                                 f"({stopped[0] if stopped else 'in another client'})"))
                    continue
                res = await stream_one(client, model, prompts[i % len(prompts)], args, request_max_tokens(args, i))
                results.append(res)
                if res.fatal and not stopped:
                    stopped.append(res.error)
                    if stop is not None:
                        stop.value = 1

        await asyncio.gather(*(_connect(client) for _ in range(concurrency)))
        freeze_startup_objects()  # everything alive now (torch, earlier levels' results) out of the collector's reach
        # before the clock starts: a full collection inside the level walked it all, ~0.1 s in one request's stream
        if ready is not None:
            await ready()
        started, cpu = time.monotonic(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        ended = time.monotonic()
    return Sent(results, stopped[0] if stopped else None, started, ended, time.process_time() - cpu)


async def _connect(client: httpx.AsyncClient) -> None:
    """Open one keep-alive connection before the level's clock starts (a `GET /health`; its answer is not read:
    a server without that route opens the connection all the same, and a server that is gone fails the level's
    first request instead)."""
    with contextlib.suppress(httpx.HTTPError):
        await client.get("/health")


def request_max_tokens(args, i: int) -> int:
    """Request i's max_tokens: `args.max_tokens`, or with `args.max_tokens_min` a uniform draw from [that,
    max_tokens] keyed by i alone, so that request i asks the same of every server and in every pass."""
    low = args.max_tokens_min
    if low is None or low >= args.max_tokens:
        return args.max_tokens
    return random.Random(i).randint(low, args.max_tokens)


async def stream_one(client: httpx.AsyncClient, model: str, prompt, args,
                     max_tokens: int | None = None) -> RequestResult:
    """One streaming request of `max_tokens` (default `args.max_tokens`), failed (not raised) on any error; at most
    `args.timeout` seconds in all."""
    res = RequestResult(ok=False)
    try:
        await asyncio.wait_for(_stream_into(res, client, model, prompt, args, max_tokens or args.max_tokens),
                               args.timeout)
    except TimeoutError:
        res.ok, res.fatal = False, True
        res.error = f"timed out after {args.timeout:g} s"
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
        res.fatal = isinstance(e, (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError))
    return res


async def _stream_into(res: RequestResult, client: httpx.AsyncClient, model: str, prompt, args,
                       max_tokens: int) -> None:
    """Send one streaming request and fill `res` as its chunks come."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": args.temperature,
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
    end = time.perf_counter()
    res.e2e = end - t0
    res.tail = end - last if last is not None else 0.0
    res.ok = True
