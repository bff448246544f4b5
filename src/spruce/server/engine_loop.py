"""The engine thread: steps the engine while there is work, sleeps on a condition when idle, and hands each
output to the mailbox of the API call that owns it, waking its coroutine with `loop.call_soon_threadsafe`.

The event loop never touches the engine lock: requests are added from a worker thread (tokenising a prompt
and waiting for the lock while a step runs), and aborts are queued for the engine thread, which applies them
before its next step (freeing the request's pages) and flushes them with that step.

Outputs are cumulative (whole text so far), so each API call has a `Mailbox` holding only the latest output
per engine request: a slow client gets bigger deltas, never an unbounded backlog.

Back-pressure: `submit` refuses (503, Retry-After) a call whose engine requests would queue more than
`max_queued` beyond the running set, and everything once `stop_accepting` began a shutdown. A `Generation`
past its timeout fails with 504 (its requests are aborted by whoever reads it).

Engine failure is fail-stop (DESIGN §20): an exception from a step (or from anything else the engine thread
does) marks the engine failed. Every request in flight, running or waiting, fails at once with a 500 naming the
error; the thread stops stepping; `submit` refuses new requests with 503; `failure` says why (for /health and
for the server, which exits so that a supervisor restarts it). A step is not a transaction (the step in flight,
half-launched device work, the scheduler's and strategy's state, a sticky CUDA error), so no request is ever
served by an engine that raised.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable

from spruce.runtime.output import RequestOutput
from spruce.sampling_params import SamplingParams
from spruce.server.metrics import Metrics, RequestClock, StatsCadence
from spruce.server.protocol import OpenAIError

if TYPE_CHECKING:  # the HTTP process of an engine-process server imports no torch
    from spruce.runtime.engine import Engine

log = logging.getLogger("spruce.server")
RETRY_AFTER_S = 1  # what an overloaded server tells clients to wait before retrying
ENGINE_FAILED = "engine_failed"  # the error code of requests failed by, or refused after, an engine failure


class EngineFailure(Exception):
    """A request the engine cannot serve: it failed while running (HTTP 500), the server is overloaded or
    shutting down (503), or the request ran out of time (504). `code` and `retry_after` (seconds) are passed on
    to the client."""

    def __init__(self, message: str, status: int = 500, code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.retry_after = retry_after


def failure_error(e: EngineFailure, request_id: str | None = None) -> OpenAIError:
    """The HTTP error answering an EngineFailure (with Retry-After when the server is overloaded)."""
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after is not None else None
    message = f"{request_id}: {e}" if request_id else str(e)
    return OpenAIError(e.status, message, code=e.code, headers=headers)


async def client_gone(receive: Callable[[], Awaitable[dict]]) -> None:
    """Returns when the client disconnects (`receive`: the ASGI request's; the body has been read, so only
    http.disconnect can come)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class Mailbox:
    """The latest output (or failure) of each engine request of one API call. The engine thread posts, the
    event loop takes; posting wakes the taker through `call_soon_threadsafe`."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self._lock = threading.Lock()
        self._latest: dict[int, RequestOutput | EngineFailure] = {}
        self._event = asyncio.Event()

    def post(self, index: int, item: RequestOutput | EngineFailure) -> None:
        """Store `item` as slot `index`'s latest and wake the taker."""
        if self.put(index, item):
            wake([self])

    def put(self, index: int, item: RequestOutput | EngineFailure) -> bool:
        """Store `item` as slot `index`'s latest without waking the taker (the caller wakes it, see `wake`);
        False if the slot already failed (a failure is final)."""
        with self._lock:
            if isinstance(self._latest.get(index), EngineFailure):
                return False
            self._latest[index] = item
            return True

    async def take(self) -> dict[int, RequestOutput | EngineFailure]:
        """Wait for, and take, everything posted since the previous take."""
        while True:
            self._event.clear()
            with self._lock:
                items, self._latest = self._latest, {}
            if items:
                return items
            await self._event.wait()


def wake(mailboxes) -> None:
    """Wake the takers of `mailboxes` (an iterable): one cross-thread call per event loop, however many boxes (a
    step's outputs for 64 streams cost one wake-up of the loop, not 64)."""
    by_loop: dict = {}
    for box in mailboxes:
        by_loop.setdefault(box.loop, []).append(box._event)
    for loop, events in by_loop.items():
        try:
            loop.call_soon_threadsafe(_set_all, events)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def _set_all(events: list[asyncio.Event]) -> None:
    for event in events:
        event.set()


@dataclass
class _Stream:
    """Where one engine request's outputs go: slot `index` of its API call's mailbox."""

    mailbox: Mailbox
    index: int
    clock: RequestClock = field(default_factory=lambda: RequestClock(time.perf_counter()))


class EngineLoop:
    """Owns the engine thread. `submit` and `abort` may be called from the event loop at any time."""

    def __init__(self, engine: Engine, metrics: Metrics | None = None):
        self.engine = engine
        self.metrics = metrics or Metrics(engine.limits.num_steps, engine.info())
        self._cond = threading.Condition()
        self._streams: dict[str, _Stream] = {}
        self._aborts: list[str] = []
        self._pending = False
        self._stopping = False
        self._accepting = True
        self._failure: str | None = None  # set once the engine failed: "ExceptionType: message"
        self._thread = threading.Thread(target=self._run, name="spruce-engine", daemon=True)
        self._cadence = StatsCadence()
        self.metrics.on_engine_stats(engine.stats())

    # --- lifecycle ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread after its current step; requests still in flight fail with 503."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._halt(timeout)
        with self._cond:
            streams, self._streams = self._streams, {}
        for st in streams.values():
            st.mailbox.post(st.index, EngineFailure("the server is shutting down", status=503,
                                                    code="server_shutting_down"))

    def _halt(self, timeout: float) -> None:
        """Wait (up to `timeout` seconds) for the engine thread to end after `_stopping` was set."""
        if self._thread.is_alive():
            self._thread.join(timeout)

    def stop_accepting(self) -> None:
        """Begin a shutdown: from now on `submit` refuses new requests (503); running ones carry on."""
        with self._cond:
            self._accepting = False

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping and self._failure is None

    @property
    def failure(self) -> str | None:
        """Why the engine failed ("ExceptionType: message"), or None while it has not."""
        return self._failure

    @property
    def accepting(self) -> bool:
        return self.alive and self._accepting

    @property
    def in_flight(self) -> int:
        """Engine requests submitted and not yet finished, failed or aborted."""
        with self._cond:
            return len(self._streams)

    # --- called from the event loop ------------------------------------------------------------------------------
    async def submit(self, items: list[tuple[str | list[int], SamplingParams, str]], mailbox: Mailbox,
                     max_queued: int | None = None) -> None:
        """Queue engine requests (prompt, params, request_id); item i's outputs go to slot i of `mailbox`.

        Raises EngineFailure (503) when shutting down, or when the items would queue more than `max_queued`
        engine requests beyond the running set (None: no limit). All or nothing: if the engine refuses one
        (InvalidRequestError), the ones already added are aborted and the error propagates. Blocking work
        (tokenising, the engine lock) runs in a worker thread.
        """
        if not self.alive:
            self._check_failure()
            raise EngineFailure("the engine is not running", status=503)
        with self._cond:
            self._check_admission(len(items), max_queued)
            for i, (_, _, rid) in enumerate(items):
                self._streams[rid] = _Stream(mailbox, i)
        try:
            await asyncio.to_thread(self._add_all, items)
        except BaseException:
            for _, _, rid in items:
                self.abort(rid)
            raise

    def _check_admission(self, count: int, max_queued: int | None) -> None:
        """Refuse `count` more engine requests (caller holds the lock) while shutting down, or when they would
        queue more than `max_queued` beyond the running set. A call is always let in when nothing else is in
        flight, so one larger than the queue is served on an idle server instead of never."""
        self._check_failure()
        if not self._accepting:
            raise EngineFailure("the server is shutting down and accepts no new requests", status=503,
                                code="server_shutting_down")
        in_flight = len(self._streams)
        running = self.engine.limits.max_running_requests
        queued = in_flight + count - running
        if max_queued is not None and in_flight and queued > max_queued:
            raise EngineFailure(
                f"the server is overloaded: this request's {count} choice(s) would make {queued} requests wait "
                f"beyond the {running} that run at once (at most {max_queued} may wait); retry after "
                f"{RETRY_AFTER_S} s", status=503, code="server_overloaded", retry_after=RETRY_AFTER_S)

    def _check_failure(self) -> None:
        """Refuse (503) every request once the engine has failed."""
        if self._failure is not None:
            raise EngineFailure(f"the engine failed ({self._failure}) and this server accepts no more requests "
                                f"until it is restarted", status=503, code=ENGINE_FAILED)

    def abort(self, request_id: str) -> None:
        """Stop a request (no-op once it finished); its pages are freed before the engine's next step."""
        with self._cond:
            if self._streams.pop(request_id, None) is None:
                return
            self._aborts.append(request_id)
            self._cond.notify()

    # --- worker thread -------------------------------------------------------------------------------------------
    def _add_all(self, items) -> None:
        added: list[str] = []
        try:
            for prompt, params, rid in items:
                self.engine.add_request(prompt, params, request_id=rid)
                added.append(rid)
        except BaseException:
            with self._cond:
                for rid in added:
                    self._streams.pop(rid, None)
                self._aborts.extend(added)
                self._cond.notify()
            raise
        with self._cond:
            # An abort that raced with this add (client gone while we tokenised) found nothing to stop: redo it.
            self._aborts.extend(rid for rid in added if rid not in self._streams)
            self._pending = True
            self._cond.notify()

    # --- engine thread -------------------------------------------------------------------------------------------
    def _run(self) -> None:
        log.info("engine loop started")
        while True:
            with self._cond:
                while not (self._stopping or self._pending or self._aborts):
                    self._cond.wait()
                if self._stopping:
                    break
                aborts, self._aborts = self._aborts, []
                self._pending = False
            try:
                self._iteration(aborts)
            except Exception as e:  # fail-stop: no request is served by an engine that raised
                log.exception("engine step failed: the engine is stopped and every request in flight fails")
                self.metrics.expect_stats(False)
                self._fail_all(f"{type(e).__name__}: {e}")
                break
        log.info("engine loop stopped")

    def _iteration(self, aborts: list[str]) -> None:
        """One step and its outputs dispatched. The stats of a step that leaves the engine idle are taken after its
        outputs are posted, announced first (Metrics.expect_stats), as the engine process sends them
        (server/engine_process.py `_send_stats`): taken before, they held up every request's last token, and at
        concurrency 1 the next request."""
        for rid in aborts:
            self.engine.abort(rid)
        outputs, stats = self.engine.step_and_stats(self._cadence.with_step)
        idle = stats is None and not self.engine.has_unfinished()
        if idle:
            self.metrics.expect_stats()
        self._dispatch(outputs)
        if stats is not None:
            self.metrics.on_engine_stats(stats)
        if idle:
            self._cadence.due(False)  # always due when idle; called so that the busy interval counts from these
            self.metrics.on_engine_stats(self.engine.stats())
        if self.engine.has_unfinished():
            with self._cond:
                self._pending = True

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Post a step's outputs to their streams' mailboxes, then wake their takers at once (see `wake`)."""
        now = time.perf_counter()
        with self._cond:
            streams = [self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
                       for out in outputs]
        posted: dict[int, Mailbox] = {}
        for out, st in zip(outputs, streams):
            if st is None:  # aborted by its client (or failed): only count its end
                if out.finished:
                    self.metrics.on_finished(out.finish_reason or "abort")
                continue
            self.metrics.on_output(st.clock, len(out.new_token_ids), out.spec_stats,
                                   out.finish_reason if out.finished else None, now, len(out.prompt_token_ids))
            if st.mailbox.put(st.index, out):
                posted[id(st.mailbox)] = st.mailbox
        wake(posted.values())

    def _fail_all(self, error: str) -> None:
        """Mark the engine failed with `error` and fail every request in flight (500). Under the lock, so a
        `submit` either registered its streams before (and they fail here) or sees the failure (503)."""
        with self._cond:
            self._failure = error
            streams, self._streams = self._streams, {}
            self._aborts = []
        log.error("the engine failed (%s): failing %d request(s) in flight; new requests get 503", error,
                  len(streams))
        failure = EngineFailure(f"the engine failed while this request was in flight ({error}); the server "
                                f"accepts no more requests until it is restarted", code=ENGINE_FAILED)
        for st in streams.values():
            st.mailbox.post(st.index, failure)


class Generation:
    """One API call's engine requests (prompts x n choices), read back as one stream of (index, output).
    With a `timeout` (seconds from the start), reading past it raises EngineFailure (504)."""

    def __init__(self, engine_loop: EngineLoop, request_ids: list[str], timeout: float | None = None):
        self.engine_loop = engine_loop
        self.request_ids = request_ids
        self.mailbox = Mailbox()
        self.done: set[int] = set()
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout

    @classmethod
    async def start(cls, engine_loop: EngineLoop, base_id: str, jobs: list[tuple[str | list[int], SamplingParams]],
                    max_queued: int | None = None, timeout: float | None = None) -> "Generation":
        """Submit every job (raises InvalidRequestError, with nothing left queued, if one is refused, and
        EngineFailure when the server is overloaded or shutting down)."""
        gen = cls(engine_loop, [f"{base_id}-{i}" for i in range(len(jobs))], timeout)
        items = [(p, sp, rid) for (p, sp), rid in zip(jobs, gen.request_ids)]
        await engine_loop.submit(items, gen.mailbox, max_queued)
        return gen

    async def _take(self) -> dict[int, RequestOutput | EngineFailure]:
        """The mailbox's next outputs; EngineFailure (504) once the deadline has passed."""
        if self.deadline is None:
            return await self.mailbox.take()
        try:
            return await asyncio.wait_for(self.mailbox.take(), max(self.deadline - time.monotonic(), 0.0))
        except TimeoutError:
            raise EngineFailure(f"the request timed out after {self.timeout:g} s", status=504,
                                code="timeout") from None

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Each request's latest output as it comes, until every request finished; raises EngineFailure if one
        failed or time ran out."""
        while len(self.done) < len(self.request_ids):
            for index, item in sorted((await self._take()).items()):
                if isinstance(item, EngineFailure):
                    self.done.add(index)
                    raise item
                if item.finished:
                    self.done.add(index)
                yield index, item

    async def collect(self) -> list[RequestOutput]:
        """The final output of every request, in index order."""
        final: dict[int, RequestOutput] = {}
        async for index, out in self.events():
            if out.finished:
                final[index] = out
        return [final[i] for i in range(len(self.request_ids))]

    async def collect_while_connected(self, receive: Callable[[], Awaitable[dict]]) -> list[RequestOutput] | None:
        """`collect()`, or None as soon as the client disconnects (`receive`: the ASGI request's); either way
        every request still running is aborted. Raises EngineFailure as `collect()` does."""
        collect = asyncio.ensure_future(self.collect())
        gone = asyncio.ensure_future(client_gone(receive))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
            return collect.result() if collect.done() else None
        finally:
            collect.cancel()
            gone.cancel()
            self.abort()

    def abort(self) -> None:
        """Abort every request that has not finished (client gone, or one sibling failed)."""
        for i, rid in enumerate(self.request_ids):
            if i not in self.done:
                self.engine_loop.abort(rid)
