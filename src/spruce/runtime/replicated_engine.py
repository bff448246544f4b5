"""One plan per step for every tensor-parallel rank: the same deterministic engine on every rank, fed the same
inputs (SGLang's way), with an always-on check that the ranks agree.

Every rank holds a whole `Engine` (scheduler, page table, prefix cache, requests, detokenizers) around its
slice of the model. Rank 0, the driver, is the one the API talks to. Whatever changes an engine's state is a
command: the requests added and aborted since the last call (recorded as they happen, under the engine lock),
then the call itself (step, drain, flush_cache, a scoring forward, shutdown). At each call the driver sends its
commands and every worker applies them, in the same order, through the same `Engine` methods; each rank then
plans and launches the same step and runs the same phase functions (and CUDA graphs) with the collectives
inside them. Randomness is keyed by (seed, position) and the seeds travel with the requests, so sampled
tokens are equal too (the logits are all-gathered whole on every rank).

One exchange per call, over the gloo control group: every rank contributes four int64 values
    [digest of its state after the previous call, opcode, argument, payload length]
(rank 0's opcode and argument are the call; the workers' are 0). When rank 0 has commands beyond the call
itself, their pickle is broadcast next. A plain decode step (nothing added or aborted) is one all-gather of
4 x tp_size integers.

The invariant, always on: the digest covers what every rank must agree on (the running and retiring requests'
rows, committed lengths, output lengths and last tokens, the waiting count, free pages, preemptions, tokens
generated). Every rank compares all of them at each exchange, so ranks that planned a different step or
committed a different token stop at the next call with an InvariantError naming both digests.
"""

from __future__ import annotations

import itertools
import logging
import pickle
import time
import zlib
from array import array
from contextlib import contextmanager

from spruce.distributed.group import TPGroup, destroy_tp_group
from spruce.errors import InvalidRequestError, InvariantError, WorkerFailedError
from spruce.runtime.engine import Engine

logger = logging.getLogger("spruce")
OP_NONE, OP_STEP, OP_DRAIN, OP_FLUSH, OP_SCORE, OP_SHUTDOWN = range(6)
OP_NAMES = {OP_STEP: "step", OP_DRAIN: "drain", OP_FLUSH: "flush_cache", OP_SCORE: "next_token_logits",
            OP_SHUTDOWN: "shutdown"}


def state_digest(engine: Engine) -> int:
    """A CRC of the engine state every rank must agree on after each call."""
    sched = engine.scheduler
    values = [len(sched.waiting), sched.num_preemptions, engine.tokens_generated, engine.runner.allocator.num_free]
    for q in itertools.chain(sched.running, sched.retiring):
        values += [q.arrival, -1 if q.row is None else q.row, q.committed, len(q.output_ids),
                   q.output_ids[-1] if q.output_ids else -1]
    return zlib.crc32(array("q", values).tobytes())


def check_agreement(header: list[list[int]], call: int, op: int) -> None:
    """Raise InvariantError unless every rank reported the same state digest."""
    digests = [row[0] for row in header]
    if len(set(digests)) > 1:
        ranks = ", ".join(f"rank {r}: {d:#010x}" for r, d in enumerate(digests))
        raise InvariantError(
            f"tensor-parallel ranks diverged before call {call} ({OP_NAMES.get(op, op)}): their engine states "
            f"differ ({ranks}); every rank must plan the same steps and commit the same tokens (DESIGN §18)")


def apply_commands(engine: Engine, commands: list[tuple]) -> None:
    """A worker applies the driver's recorded requests and aborts, in order (its engine is a plain Engine)."""
    for command in commands:
        if command[0] == "add":
            _, rid, ids, params, seed = command
            with engine._lock:
                engine._enqueue(rid, ids, params, seed)
        elif command[0] == "abort":
            engine.abort(command[1])
        else:
            raise InvariantError(f"unknown tensor-parallel command {command[0]!r}")


def leave_group(engine: Engine | None) -> None:
    """Free the engine's CUDA graphs (their captured collectives hold the NCCL group), then leave the group."""
    if engine is not None:
        engine.runner.release_graphs()
    destroy_tp_group()


def serve_commands(engine: Engine, tp: TPGroup) -> None:
    """A worker's loop: wait for the driver's next call, apply its commands, run the call; until shutdown."""
    digest, call = state_digest(engine), 0
    while True:
        header = tp.gather_ints([digest, OP_NONE, 0, 0])
        _, op, arg, size = header[0]
        check_agreement(header, call, op)
        commands, args = pickle.loads(tp.broadcast_bytes(None, size)) if size else ([], None)
        apply_commands(engine, commands)
        if op == OP_SHUTDOWN:
            return
        try:
            if op == OP_STEP:
                engine.step(finished_only=bool(arg))
            elif op == OP_DRAIN:
                engine.drain()
            elif op == OP_FLUSH:
                engine.flush_cache()
            elif op == OP_SCORE:
                engine.next_token_logits(*args)
            else:
                raise InvariantError(f"unknown tensor-parallel call {op}")
        except InvalidRequestError:
            pass  # refused alike on every rank (e.g. no free row to score): the driver reports it
        digest, call = state_digest(engine), call + 1


class DriverEngine(Engine):
    """Rank 0 of a tensor-parallel engine: the Engine the API uses, forwarding every state change to the
    workers (see the module docstring). `workers` (runtime/launch.py) watches spawned workers; None when
    torchrun started the ranks. `make_strategy`: as for Engine."""

    def __init__(self, config, tp: TPGroup, workers=None, *, make_strategy):
        self._tp = tp
        self._workers = workers
        self._commands: list[tuple] = []  # requests added and aborted since the last call
        self._call = 0
        self._digest = 0
        self.failure: str | None = None  # set once the group cannot go on: every later call raises it
        self.busy_since: float | None = None  # monotonic time the current collective call began
        self._closed = False
        with self._busy():
            super().__init__(config, tp, make_strategy=make_strategy)
        self._digest = state_digest(self)

    # --- state changes, recorded for the workers ----------------------------------------------------------------
    def _enqueue(self, rid, ids, params, seed, grammar=None) -> None:
        self._check_alive()
        super()._enqueue(rid, ids, params, seed, grammar)  # workers compile the request's grammar themselves
        self._commands.append(("add", rid, ids, params, seed))

    def abort(self, request_id: str) -> None:
        with self._lock:
            req = self.requests.get(request_id)
            if req is None or req.finished:
                return
            if self.failure is None:
                self._commands.append(("abort", request_id))
            super().abort(request_id)

    # --- calls: one exchange each, then the same call on every rank -----------------------------------------------
    def step(self, finished_only: bool = False, shared: bool = False):
        with self._lock, self._busy():
            self._exchange(OP_STEP, int(finished_only))
            out = super().step(finished_only, shared)
            self._digest = state_digest(self)
            return out

    def drain(self):
        with self._lock:
            if self.failure is not None:  # nothing can run any more; callers clean up on the way out
                return []
            with self._busy():
                self._exchange(OP_DRAIN)
                out = super().drain()
                self._digest = state_digest(self)
                return out

    def flush_cache(self) -> int:
        with self._lock, self._busy():
            self._exchange(OP_FLUSH)
            freed = super().flush_cache()
            self._digest = state_digest(self)
            return freed

    def next_token_logits(self, token_ids: list[int], first: int = 0):
        with self._lock, self._busy():
            self._exchange(OP_SCORE, args=(list(token_ids), first))
            try:
                return super().next_token_logits(token_ids, first)
            finally:
                self._digest = state_digest(self)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the workers and leave the group (idempotent; also run at interpreter exit)."""
        with self._lock:
            if self._closed:
                return
            if self._workers is not None:
                self._workers.stopping = True
            if self.failure is None:
                try:
                    with self._busy():
                        self._exchange(OP_SHUTDOWN)
                except Exception as e:  # the workers are gone or going: leave anyway
                    logger.warning("tensor-parallel shutdown: %s: %s", type(e).__name__, e)
            self._closed = True
            leave_group(self)  # before joining: a worker leaving the group may wait for the driver to leave too
            if self._workers is not None:
                self._workers.join(timeout)

    def __del__(self):
        """An engine nothing refers to any more (`del llm`) shuts down like shutdown(): its workers stop and this
        process leaves the group, free to build another engine."""
        if getattr(self, "_closed", True) or not hasattr(self, "runner"):  # closed, or its __init__ failed
            return
        try:
            self.shutdown(timeout=10.0)
        except Exception as e:  # nothing to raise to from a collection
            logger.warning("tensor-parallel engine collected: shutdown failed: %s: %s", type(e).__name__, e)

    # --- the exchange and failure handling ----------------------------------------------------------------------
    def _exchange(self, op: int, arg: int = 0, args=None) -> None:
        self._check_alive()
        commands, self._commands = self._commands, []
        payload = pickle.dumps((commands, args)) if commands or args is not None else b""
        header = self._tp.gather_ints([self._digest, op, arg, len(payload)])
        call, self._call = self._call, self._call + 1
        if payload:
            self._tp.broadcast_bytes(payload, len(payload))
        try:
            check_agreement(header, call, op)
        except InvariantError as e:
            self.failure = str(e)
            raise

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise WorkerFailedError(f"the tensor-parallel engine stopped: {self.failure}")
        if self._closed:
            raise WorkerFailedError("the tensor-parallel engine was shut down")

    @contextmanager
    def _busy(self):
        """Marks a call that runs collectives (the watchdog ends the process if a dead worker leaves it stuck
        there), and turns a collective's error after a worker's death into a WorkerFailedError naming it."""
        outer = self.busy_since
        if outer is None:
            self.busy_since = time.monotonic()
        try:
            yield
        except (InvariantError, WorkerFailedError, InvalidRequestError):
            raise
        except Exception as e:  # a collective failed under us: a worker died (gloo notices at once)?
            failure = self._workers.wait_failure(5.0) if self._workers is not None else None
            if failure is None:
                raise
            self.failure = self.failure or failure
            raise WorkerFailedError(failure) from e
        finally:
            self.busy_since = outer
