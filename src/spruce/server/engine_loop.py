"""The engine thread: steps the engine while there is work, sleeps on a condition when idle, and hands each
output to the asyncio queue of the API call that owns it (`loop.call_soon_threadsafe`).

The event loop never touches the engine lock: requests are added from a worker thread (tokenising a prompt
and waiting for the lock while a step runs), and aborts are queued for the engine thread, which applies them
before its next step (freeing the request's pages) and flushes them with that step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from spruce.runtime.engine import Engine
from spruce.runtime.output import RequestOutput
from spruce.sampling_params import SamplingParams
from spruce.server.metrics import Metrics, RequestClock

log = logging.getLogger("spruce.server")


class EngineFailure(Exception):
    """The engine failed while running a request (answered as HTTP 500), or the server is shutting down."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


@dataclass
class _Stream:
    """Where one engine request's outputs go: (index, output | EngineFailure) items on an asyncio queue."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int
    clock: RequestClock = field(default_factory=lambda: RequestClock(time.perf_counter()))


class EngineLoop:
    """Owns the engine thread. `submit` and `abort` may be called from the event loop at any time."""

    def __init__(self, engine: Engine, metrics: Metrics | None = None):
        self.engine = engine
        spec_steps = engine.limits.num_steps if engine.worker is not None else 0
        self.metrics = metrics or Metrics(spec_steps)
        self._cond = threading.Condition()
        self._streams: dict[str, _Stream] = {}
        self._aborts: list[str] = []
        self._pending = False
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="spruce-engine", daemon=True)
        self.metrics.on_engine_stats(engine.stats())

    # --- lifecycle ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread after its current step; requests still in flight fail with 503."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        with self._cond:
            streams, self._streams = self._streams, {}
        for rid, st in streams.items():
            self._post(st, EngineFailure("the server is shutting down", status=503))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    # --- called from the event loop ------------------------------------------------------------------------------
    async def submit(self, items: list[tuple[str | list[int], SamplingParams, str]], queue: asyncio.Queue) -> None:
        """Queue engine requests (prompt, params, request_id); item i's outputs arrive on `queue` as (i, output).

        All or nothing: if the engine refuses one (InvalidRequestError), the ones already added are aborted
        and the error propagates. Blocking work (tokenising, the engine lock) runs in a worker thread.
        """
        if not self.alive:
            raise EngineFailure("the engine is not running", status=503)
        loop = asyncio.get_running_loop()
        with self._cond:
            for i, (_, _, rid) in enumerate(items):
                self._streams[rid] = _Stream(loop, queue, i)
        try:
            await asyncio.to_thread(self._add_all, items)
        except BaseException:
            for _, _, rid in items:
                self.abort(rid)
            raise

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
            except Exception:  # the thread must outlive any bug: fail what was running and carry on
                log.exception("engine loop iteration failed")
                self._fail_affected("internal error in the engine loop")
        log.info("engine loop stopped")

    def _iteration(self, aborts: list[str]) -> None:
        for rid in aborts:
            self.engine.abort(rid)
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("engine step failed")
            self._fail_affected(f"the engine failed while running this request: {type(e).__name__}: {e}")
            outputs = []
        self._dispatch(outputs)
        self.metrics.on_engine_stats(self.engine.stats())
        if self.engine.has_unfinished():
            with self._cond:
                self._pending = True

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for out in outputs:
            with self._cond:
                st = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if st is None:
                continue  # aborted by its client
            self.metrics.on_output(st.clock, len(out.new_token_ids), out.spec_stats,
                                   out.finish_reason if out.finished else None, now)
            self._post(st, out)

    def _fail_affected(self, message: str) -> None:
        """After a failed step: fail (500) and abort the requests the step was running (all, if none ran)."""
        sched = self.engine.scheduler
        ids = [r.request_id for r in list(sched.running)] or [r.request_id for r in list(sched.waiting)]
        with self._cond:
            ids = ids or list(self._streams)
            streams = {rid: self._streams.pop(rid, None) for rid in ids}
            self._pending = True
        for rid, st in streams.items():
            log.error("request %s failed: %s", rid, message)
            try:
                self.engine.abort(rid)
            except Exception:
                log.exception("abort of request %s failed", rid)
            if st is not None:
                self._post(st, EngineFailure(message))

    @staticmethod
    def _post(st: _Stream, item) -> None:
        try:
            st.loop.call_soon_threadsafe(st.queue.put_nowait, (st.index, item))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class Generation:
    """One API call's engine requests (prompts x n choices), read back as one stream of (index, output)."""

    def __init__(self, engine_loop: EngineLoop, request_ids: list[str]):
        self.engine_loop = engine_loop
        self.request_ids = request_ids
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done: set[int] = set()

    @classmethod
    async def start(cls, engine_loop: EngineLoop, base_id: str,
                    jobs: list[tuple[str | list[int], SamplingParams]]) -> "Generation":
        """Submit every job (raises InvalidRequestError, with nothing left queued, if one is refused)."""
        gen = cls(engine_loop, [f"{base_id}-{i}" for i in range(len(jobs))])
        await engine_loop.submit([(p, sp, rid) for (p, sp), rid in zip(jobs, gen.request_ids)], gen.queue)
        return gen

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs as they come, until every request finished; raises EngineFailure if one failed."""
        while len(self.done) < len(self.request_ids):
            index, item = await self.queue.get()
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

    def abort(self) -> None:
        """Abort every request that has not finished (client gone, or one sibling failed)."""
        for i, rid in enumerate(self.request_ids):
            if i not in self.done:
                self.engine_loop.abort(rid)
