"""The engine in its own process: what `spruce serve` runs by default (`--disable-engine-process` keeps the engine a
thread of the server process, server/engine_loop.py).

Why: in one process the engine thread and the HTTP event loop share one GIL. Under load the engine's host work
(scheduling, launching, detokenising) waits for the event loop's (parsing, streaming), and the other way round:
on the H100 at concurrency 64 a plain step took ~7 ms of wall time against ~1.3 ms of device time. SGLang and
vLLM run their engines in their own processes for this reason.

Two sides of one duplex pipe (multiprocessing; the engine process starts as runtime/child_process.py says, with
no CUDA state: CUDA is only ever initialised in the engine process):
- the engine process (`engine_process_main`) builds the engine (`LLM(**engine_kwargs)`), sends "ready" with what
  the server needs to know of it (`EngineDescription`), then loops: read every message waiting (blocking only
  while the engine is idle), apply adds and aborts, step, send the step's outputs (as deltas, `OutputEncoder`) and
  its stats (at most every STATS_INTERVAL_S while requests run: server/metrics.py StatsCadence). It ignores SIGINT
  and SIGTERM (a Ctrl-C or a supervisor's signal reaches the whole process group): the server drains, then sends
  "stop"; and it exits when the pipe closes (the server died).
- the server process (`EngineProcess`, the engine handle the API reads, and `ProcessEngineLoop`) tokenises
  prompts itself (runtime/request.py `prompt_token_ids`), sends adds (all or nothing, answered) and aborts, and a
  receiver thread rebuilds each step's RequestOutputs (`OutputAssembler`) and posts them to the API calls'
  mailboxes exactly as the engine thread does.

Messages (tuples; the first element is the kind):
  server -> engine: ("add", call, [(ids, params, request_id), ...]), ("abort", [request_id, ...]),
                    ("flush", call), ("stop",)
  engine -> server: ("ready", EngineDescription) or ("load_failed", exception), then ("step", deltas, stats or
                    None, stats_follow), ("stats", stats) right after a step with stats_follow, ("reply", call,
                    result) and, last, ("failed", error)

Fail-stop as in engine_loop (DESIGN §20): a step that raises sends ("failed", "Type: message") and ends the
process; a process that ends without saying so (killed, out of memory) fails every request in flight the same
way, naming its exit code.

Outputs cross as deltas (server/output_deltas.py).
"""

from __future__ import annotations

import gc
import itertools
import logging
import pickle
import signal
import threading
import time
from dataclasses import dataclass

from spruce.errors import InvalidRequestError, SpruceError
from spruce.runtime import child_process
from spruce.runtime.output import RequestOutput
from spruce.runtime.request import prompt_token_ids
from spruce.server.engine_loop import ENGINE_FAILED, EngineFailure, EngineLoop
from spruce.server.metrics import StatsCadence
from spruce.server.output_deltas import OutputAssembler, OutputEncoder

log = logging.getLogger("spruce.server")
STOP_TIMEOUT_S = 30.0  # how long a stopped engine process gets to exit before it is killed
PROCESS_PARTS = ("idle", "messages", "step", "encode", "send", "gc")  # the engine process loop's wall time:
# blocked with nothing to do; applying the server's messages; Engine.step (and stats); encoding its outputs; sending
# them; and, within those, garbage collections


class EngineStartError(SpruceError):
    """The engine process could not build the engine (its log, above, has the traceback of an unexpected error)."""


@dataclass(frozen=True)
class EngineDescription:
    """What the server process knows of the engine it does not hold: the Engine attributes the API, the tooling
    endpoints and /metrics read (tokenizer, vocab_size, max_request_tokens, limits, config, info(), a first
    stats())."""

    tokenizer: object | None
    vocab_size: int
    max_request_tokens: int
    limits: object
    config: object
    info: dict
    stats: dict

    @classmethod
    def of(cls, engine) -> "EngineDescription":
        return cls(engine.tokenizer, engine.vocab_size, engine.max_request_tokens, engine.limits, engine.config,
                   engine.info(), engine.stats())


# --- the engine process ---------------------------------------------------------------------------------------------
def engine_process_main(engine_kwargs: dict, conn, log_level: str, log_format: str = "text") -> None:
    """The engine process's entry point (see the module docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from spruce.server.logs import configure_logging

    configure_logging(log_level, log_format)
    from spruce.llm import LLM
    from spruce.ops import compile_watch
    from spruce.server.heap import freeze_startup_objects

    try:
        engine = LLM(**engine_kwargs).engine
        if engine_kwargs.get("tp_size", 1) > 1:  # a dead worker ends this process; the server then fails
            from spruce.runtime.launch import exit_on_worker_failure

            exit_on_worker_failure(engine)
    except BaseException as e:
        if not isinstance(e, SpruceError):
            log.exception("the engine process could not build the engine")
        conn.send(("load_failed", _portable(e)))
        return
    conn.send(("ready", EngineDescription.of(engine)))
    freeze_startup_objects()
    compile_watch.serving()
    try:
        _EngineServer(engine, conn).run()
    finally:
        gc.unfreeze()
        engine.shutdown()


def _portable(error: BaseException) -> BaseException:
    """`error` if it crosses the pipe intact (spruce's errors do), else an EngineStartError naming it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return EngineStartError(f"the engine process failed to start: {type(error).__name__}: {error}")


class _EngineServer:
    """The engine process's loop: messages in, steps, deltas out."""

    def __init__(self, engine, conn):
        self.engine = engine
        self.conn = conn
        self.encoder = OutputEncoder()
        self.must_step = False  # an add or an abort came: step even if the engine has nothing unfinished
        self.seconds = dict.fromkeys(PROCESS_PARTS, 0.0)  # cumulative wall seconds of the loop's parts, sent with
        # the stats (as of the step before: the send of a step is timed after it)
        self.cadence = StatsCadence()  # stats go with a step at most every STATS_INTERVAL_S while requests run
        self._gc_started = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        """Garbage collections' wall seconds (within the loop's other parts)."""
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.seconds["gc"] += time.perf_counter() - self._gc_started

    def run(self) -> None:
        log.info("engine process serving")
        seconds = self.seconds
        clock = time.perf_counter
        while True:
            block = not (self.must_step or self.engine.has_unfinished())
            t0 = clock()
            while block or self.conn.poll():
                try:
                    message = self.conn.recv()
                except EOFError:
                    log.info("the server closed the pipe: engine process exits")
                    return
                if block:  # the engine had nothing to do until this message came
                    t1 = clock()
                    seconds["idle"] += t1 - t0
                    t0 = t1
                if not self._handle(message):
                    log.info("engine process stopped")
                    return
                block = False
            t1 = clock()
            seconds["messages"] += t1 - t0
            self.must_step = False
            try:
                outputs, stats = self.engine.step_and_stats(self.cadence.with_step, shared=True)  # encoded at once
                idle = stats is None and not self.engine.has_unfinished()
            except Exception as e:  # fail-stop: no request is served by an engine that raised
                self._fail(e)
                return
            t2 = clock()
            deltas = self.encoder.encode(outputs)
            t3 = clock()
            if stats is not None:
                self._add_process_seconds(stats)
            self.conn.send(("step", deltas, stats, idle))
            seconds["step"] += t2 - t1
            seconds["encode"] += t3 - t2
            seconds["send"] += clock() - t3
            if idle and not self._send_stats():
                return

    def _send_stats(self) -> bool:
        """Send the stats of the step just sent, which left the engine idle (the server's readers wait for them:
        Metrics.expect_stats); False if the engine raised. Taken before that step's outputs were sent, they held up
        every request's last token, and at concurrency 1 the next request, which comes after it (building the stats
        is tens of microseconds of cold-cache host work at every request's end)."""
        t0 = time.perf_counter()
        try:
            self.cadence.due(False)  # always due when idle; called so that the busy interval counts from these stats
            stats = self.engine.stats()
        except Exception as e:  # fail-stop, as for a step
            self._fail(e)
            return False
        self.seconds["step"] += time.perf_counter() - t0
        self._add_process_seconds(stats)
        self.conn.send(("stats", stats))
        return True

    def _add_process_seconds(self, stats: dict) -> None:
        stats["process_seconds"] = dict(self.seconds)
        stats["process_cpu_seconds"] = time.process_time()

    def _fail(self, error: Exception) -> None:
        log.exception("engine step failed: the engine process stops and every request in flight fails")
        self.conn.send(("failed", f"{type(error).__name__}: {error}"))

    def _handle(self, message: tuple) -> bool:
        """Apply one message from the server; False for "stop"."""
        kind = message[0]
        if kind == "add":
            _, call, jobs = message
            self.conn.send(("reply", call, self._add(jobs)))
        elif kind == "abort":
            for rid in message[1]:
                self.engine.abort(rid)
            self.must_step = True
        elif kind == "flush":
            self.conn.send(("reply", message[1], self.engine.flush_cache()))
        elif kind == "stop":
            return False
        else:
            raise ValueError(f"unknown message kind {kind!r} from the server (known: add, abort, flush, stop)")
        return True

    def _add(self, jobs: list[tuple]) -> tuple | None:
        """Queue every job or none: the error of the first refused (as (message, field, status)), else None."""
        added = []
        try:
            for ids, params, rid in jobs:
                self.engine.add_request(ids, params, request_id=rid)
                added.append(rid)
        except InvalidRequestError as e:
            for rid in added:
                self.engine.abort(rid)
            return str(e), e.field, e.status
        finally:
            self.must_step = True
        return None


# --- the server process ---------------------------------------------------------------------------------------------
class _Call:
    """A request to the engine process awaiting its reply."""

    def __init__(self):
        self.done = threading.Event()
        self.result = None
        self.error: BaseException | None = None  # set instead when the engine process ended first


class EngineProcess:
    """The server's handle on the engine process: the Engine attributes the API reads (from its
    EngineDescription), `add` / `abort` / `flush_cache` / `shutdown`, and `pump`, the receiving loop that
    ProcessEngineLoop's thread runs. Construction starts the process and waits until its engine is ready
    (raising its load error if it could not build it)."""

    def __init__(self, engine_kwargs: dict, log_level: str = "info", log_format: str = "text"):
        ctx = child_process.context()
        self._conn, child_conn = ctx.Pipe()
        self._process = child_process.process(ctx, engine_process_main,
                                              args=(engine_kwargs, child_conn, log_level, log_format),
                                              name="spruce-engine")
        self._process.start()
        child_conn.close()
        self._send_lock = threading.Lock()
        self._calls: dict[int, _Call] = {}
        self._calls_lock = threading.Lock()
        self._call_ids = itertools.count()
        self._join_lock = threading.Lock()  # one joiner at a time (two racing waitpid calls: one sees no child)
        self._stopping = False
        self._closed_error: str | None = None  # once the process is gone or failed: why
        self.description = self._wait_ready()
        self._stats = self.description.stats
        self.tokenizer = self.description.tokenizer
        self.vocab_size = self.description.vocab_size
        self.max_request_tokens = self.description.max_request_tokens
        self.limits = self.description.limits
        self.config = self.description.config

    def _wait_ready(self) -> EngineDescription:
        while not self._conn.poll(0.5):
            if not self._process.is_alive():
                break
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            self._process.join()
            raise EngineStartError(f"the engine process exited with code {self._process.exitcode} while building "
                                   f"the engine (its log is above)") from None
        if kind == "load_failed":
            self._process.join()
            raise payload
        return payload

    # --- Engine's read-only surface -----------------------------------------------------------------------------
    def info(self) -> dict:
        return self.description.info

    def stats(self) -> dict:
        """The latest stats the engine process sent (with a step)."""
        return self._stats

    @property
    def pid(self) -> int:
        """The engine process's id (for a supervisor, or a test that kills it)."""
        return self._process.pid

    @property
    def exitcode(self) -> int | None:
        """The engine process's exit code once it ended (negative: killed by that signal), else None."""
        return self._process.exitcode

    @property
    def running(self) -> bool:
        return self._process.is_alive() and self._closed_error is None

    # --- requests to the engine process ---------------------------------------------------------------------------
    def add(self, jobs: list[tuple[list[int], object, str]]) -> None:
        """Queue (ids, params, request_id) jobs, all or none: raises the engine's InvalidRequestError for the first
        it refused, or EngineFailure (503) once the engine process has failed or ended."""
        error = self._call("add", jobs)
        if error is not None:
            message, field, status = error
            raise InvalidRequestError(message, field=field, status=status)

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests (unknown or finished ones are ignored by the engine)."""
        self._send(("abort", request_ids))

    def flush_cache(self) -> int:
        """Engine.flush_cache, run in the engine process."""
        return self._call("flush")

    def _call(self, kind: str, *payload):
        """Send (kind, call id, *payload) and wait for the engine process's result (EngineFailure if it ends
        first)."""
        call, call_id = _Call(), next(self._call_ids)
        with self._calls_lock:
            self._check_open()
            self._calls[call_id] = call
        self._send((kind, call_id, *payload))
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.result

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._check_open()
            try:
                self._conn.send(message)
            except (BrokenPipeError, OSError) as e:
                raise self._gone_error(f"{type(e).__name__}: {e}") from None

    def _check_open(self) -> None:
        if self._closed_error is not None:
            raise self._gone_error(self._closed_error)

    @staticmethod
    def _gone_error(reason: str) -> EngineFailure:
        return EngineFailure(f"the engine is not running ({reason})", status=503, code=ENGINE_FAILED)

    # --- receiving ------------------------------------------------------------------------------------------------
    def pump(self, on_step, on_stats, on_failure) -> None:
        """Receive until the engine process ends: each step's outputs and stats go to on_step(outputs, stats,
        stats_follow), stats sent after their step's outputs to on_stats(stats), replies to their callers; a
        failure, or an end not asked for by `shutdown`, to on_failure(error)."""
        assembler = OutputAssembler()
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self._join(STOP_TIMEOUT_S)
                self._close(f"the engine process exited with code {self._process.exitcode}")
                if not self._stopping:
                    on_failure(self._closed_error)
                return
            kind = message[0]
            if kind == "step":  # its stats: None when the engine process took none with it (StatsCadence)
                _, deltas, stats, stats_follow = message
                if stats is not None:
                    self._stats = stats
                on_step(assembler.assemble(deltas), stats, stats_follow)
            elif kind == "stats":
                self._stats = message[1]
                on_stats(message[1])
            elif kind == "reply":
                _, call_id, result = message
                with self._calls_lock:
                    call = self._calls.pop(call_id)
                call.result = result
                call.done.set()
            elif kind == "failed":
                self._close(message[1])
                on_failure(message[1])
                return

    def _close(self, reason: str) -> None:
        """No more replies will come: fail every call still waiting."""
        with self._calls_lock:
            if self._closed_error is None:
                self._closed_error = reason
            calls, self._calls = self._calls, {}
        for call in calls.values():
            call.error = self._gone_error(reason)
            call.done.set()

    def shutdown(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the engine process after its current step (idempotent); killed if it does not exit in time."""
        self._stopping = True
        if self._process.is_alive():
            try:
                with self._send_lock:
                    self._conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
            self._join(timeout)
        if self._process.is_alive():
            log.error("the engine process did not stop within %g s: killing it", timeout)
            self._process.kill()
            self._join(None)

    def _join(self, timeout: float | None) -> None:
        """Wait for the engine process to end. The receiver (at the pipe's end) and `shutdown` may both wait:
        concurrent joins race in waitpid, and the loser returned at once with the process still alive (an H100
        run killed two engine processes that were exiting on their own)."""
        with self._join_lock:
            self._process.join(timeout)


class ProcessEngineLoop(EngineLoop):
    """EngineLoop (streams, admission, dispatch, fail-stop) over an EngineProcess: its thread receives the
    engine process's steps instead of stepping an engine; adds and aborts go down the pipe."""

    def __init__(self, engine: EngineProcess, metrics=None):
        super().__init__(engine, metrics)
        self._thread.name = "spruce-engine-receiver"

    @property
    def alive(self) -> bool:
        return super().alive and self.engine.running

    def _add_all(self, items) -> None:
        """Tokenise here (a worker thread of the server process), then queue all of them in the engine process."""
        tok, vocab = self.engine.tokenizer, self.engine.vocab_size
        jobs = [(prompt_token_ids(prompt, tok, vocab), params, rid) for prompt, params, rid in items]
        self.engine.add(jobs)
        with self._cond:  # an abort that raced with this add (client gone meanwhile) found nothing to stop: redo it
            late = [rid for _, _, rid in jobs if rid not in self._streams]
        if late:
            self.engine.abort(late)

    def abort(self, request_id: str) -> None:
        with self._cond:
            if self._streams.pop(request_id, None) is None:
                return
        try:
            self.engine.abort([request_id])
        except EngineFailure:  # the engine is gone: nothing runs any more
            pass

    def _run(self) -> None:
        log.info("engine process receiver started")
        self.engine.pump(self._on_step, self.metrics.on_engine_stats, self._on_failure)
        log.info("engine process receiver stopped")

    def _on_step(self, outputs: list[RequestOutput], stats: dict | None, stats_follow: bool) -> None:
        if stats_follow:  # before any output is posted: a reader that saw one waits for these stats
            self.metrics.expect_stats()
        self._dispatch(outputs)
        if stats is not None:
            self.metrics.on_engine_stats(stats)

    def _on_failure(self, error: str) -> None:
        self.metrics.expect_stats(False)
        self._fail_all(error)

    def _halt(self, timeout: float) -> None:
        self.engine.shutdown(timeout)
        super()._halt(timeout)
