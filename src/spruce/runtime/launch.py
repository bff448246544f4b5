"""Starting a tensor-parallel engine, and taking it down cleanly when a rank dies.

Two ways in, both through `create_engine(config, make_strategy=...)` (LLM(tp_size=N) and
`spruce generate|serve --tp-size N`; every rank builds its strategy with the factory the caller passes in):
  spawned   (the default) this process is rank 0, the driver; it starts ranks 1..N-1 as worker processes
            (runtime/child_process.py: forked from a server that has torch imported) that build their engine
            replica and serve the driver's calls until it shuts down. The ranks meet over TCP on 127.0.0.1 (one host).
  torchrun  when RANK / WORLD_SIZE are set (WORLD_SIZE must equal tp_size): rank 0 returns the driver; every
            other rank serves inside `create_engine` and then exits the process (SystemExit(0)) when the
            driver shuts down, so `torchrun --nproc-per-node N -m spruce.cli generate --tp-size N ...` works.

Failure handling (never a hang):
  - a worker reports its exception (traceback) to the driver before it exits; a watchdog thread in the driver
    polls the workers' liveness. A worker that dies makes the driver's current or next call raise
    WorkerFailedError naming the rank, its exit code and its last error (gloo fails a collective with a dead
    peer at once). If the driver stays stuck in a collective (NCCL waits for a dead peer) for
    `SPRUCE_TP_FAILURE_GRACE_S` (default 10 s), the watchdog prints the error and ends the process (exit 1);
    `exit_on_worker_failure(engine)` (the server) ends it at once instead;
  - a worker whose driver died exits (its collective fails, and a thread watches the parent process);
  - a worker that dies before joining the group fails `create_engine` at once (the driver waits for each
    worker's "ready" before it joins);
  - collectives on the device group time out after SPRUCE_TP_TIMEOUT_S (distributed/group.py).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import socket
import sys
import threading
import time
import traceback
import weakref

from spruce.errors import ConfigError, WorkerFailedError
from spruce.runtime import child_process

logger = logging.getLogger("spruce")

GRACE_ENV = "SPRUCE_TP_FAILURE_GRACE_S"
READY_TIMEOUT_S = 600.0  # a worker imports torch and spruce before it reports ready
POLL_S = 0.2


def create_engine(config, rank_setup=None, *, make_strategy):
    """The engine for `config`: a plain Engine for tp_size 1, else rank 0 of a tensor-parallel group.

    rank_setup: optional picklable callable(engine, rank) run on every rank's engine once it is built and
    before it serves (instrumentation and tests); it must not run collectives.
    make_strategy: the StrategyFactory every rank's engine builds its decode strategy with (runtime/strategy.py;
    speculative/registry.py's `make_strategy`), picklable (a module-level function)."""
    from spruce.runtime.engine import Engine

    if config.tp_size == 1:
        engine = Engine(config, make_strategy=make_strategy)
        if rank_setup is not None:
            rank_setup(engine, 0)
        return engine
    from spruce.distributed.group import check_no_group
    from spruce.distributed.layers import check_divisible
    from spruce.models.hf_config import ModelConfig

    check_divisible(ModelConfig.from_dir(config.model), config.tp_size)
    check_no_group()  # before spawning workers that could never join
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _join_torchrun(config, rank_setup, make_strategy)
    return _spawn(config, rank_setup, make_strategy)


def exit_on_worker_failure(engine) -> None:
    """Make a worker's death end this process at once with the error (a server cannot serve without it)."""
    workers = getattr(engine, "_workers", None)
    if workers is not None:
        workers.exit_at_once = True


# --- spawned workers ---------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(config, rank_setup, make_strategy):
    from spruce.distributed.group import init_tp_group
    from spruce.runtime.replicated_engine import DriverEngine, leave_group

    if config.device != "cpu":
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # the workers inherit it (NVLink multicast off)
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    ctx = child_process.context()
    messages = ctx.Queue()
    procs = [child_process.process(ctx, _worker_main, name=f"spruce-tp-rank{rank}", daemon=True,
                                   args=(rank, config, init_method, messages, rank_setup, make_strategy, os.getpid()))
             for rank in range(1, config.tp_size)]
    for p in procs:
        p.start()
    workers = WorkerSet(procs, messages)
    engine = None
    try:
        workers.wait_ready(READY_TIMEOUT_S)
        tp = init_tp_group(0, config.tp_size, config.device, init_method)
        engine = DriverEngine(config, tp, workers, make_strategy=make_strategy)
        workers.watch(engine)
        if rank_setup is not None:
            rank_setup(engine, 0)
    except BaseException as e:
        failure = workers.wait_failure(5.0)
        workers.stopping = True
        workers.join(5.0)
        leave_group(engine)
        if failure is not None and not isinstance(e, WorkerFailedError):
            raise WorkerFailedError(failure) from e
        raise
    _shutdown_at_exit(engine)
    return engine


def _shutdown_at_exit(engine) -> None:
    ref = weakref.ref(engine)

    def shutdown():
        live = ref()
        if live is not None:
            live.shutdown(timeout=10.0)

    atexit.register(shutdown)


def _worker_main(rank: int, config, init_method: str, messages, rank_setup, make_strategy, parent_pid: int) -> None:
    """A spawned worker: join the group, build the engine replica, serve the driver until it shuts down."""
    from spruce.distributed.group import init_tp_group
    from spruce.runtime.replicated_engine import leave_group, serve_commands
    from spruce.runtime.engine import Engine

    _watch_parent(parent_pid)
    if config.device == "cpu":  # the ranks share the host's cores
        import torch

        torch.set_num_threads(max(1, torch.get_num_threads() // config.tp_size))
    try:
        messages.put(("ready", rank, ""))
        tp = init_tp_group(rank, config.tp_size, config.device, init_method)
        engine = Engine(config, tp, make_strategy=make_strategy)
        if rank_setup is not None:
            rank_setup(engine, rank)
        serve_commands(engine, tp)
        leave_group(engine)
    except BaseException as e:
        messages.put(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        time.sleep(0.2)  # let the queue's feeder thread hand the report over
        sys.exit(1)


def _watch_parent(parent_pid: int) -> None:
    """Exit if the driver process goes away (e.g. killed while this worker waits in a collective): the driver's
    pid is gone, or this process's parent changed (the fork server, which exits with the driver:
    runtime/child_process.py)."""
    start_parent = os.getppid()

    def watch():
        while True:
            if os.getppid() != start_parent or not _pid_exists(parent_pid):
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watch, name="spruce-tp-parent-watch", daemon=True).start()


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class WorkerSet:
    """The spawned workers, their reports, and the driver's watchdog over them."""

    def __init__(self, procs, messages):
        self.procs = procs
        self.messages = messages
        self.stopping = False  # set before a shutdown: exits are expected from then on
        self.exit_at_once = False
        self._ready: set[int] = set()
        self._errors: dict[int, str] = {}
        self._failure: str | None = None
        self._cond = threading.Condition()
        self._engine = None

    # --- reports -------------------------------------------------------------------------------------------------
    def _poll(self, timeout: float) -> None:
        """Read the workers' reports (waiting up to `timeout` for the first) and note a dead worker."""
        try:
            kind, rank, text = self.messages.get(timeout=timeout)
            with self._cond:
                (self._ready.add(rank) if kind == "ready" else self._errors.__setitem__(rank, text))
                self._cond.notify_all()
        except (queue.Empty, OSError, EOFError, ValueError):
            pass
        if self._failure is None and not self.stopping:
            dead = next((p for p in self.procs if p.exitcode is not None), None)
            if dead is not None:
                self._set_failure(dead)

    def _set_failure(self, proc) -> None:
        rank = self.procs.index(proc) + 1
        deadline = time.monotonic() + 1.0
        while rank not in self._errors and time.monotonic() < deadline:  # its report may still be in transit
            try:
                kind, r, text = self.messages.get(timeout=0.1)
                if kind == "error":
                    self._errors[r] = text
            except (queue.Empty, OSError, EOFError, ValueError):
                pass
        report = self._errors.get(rank, "").strip()
        last = report.splitlines()[0] if report else "no error report (killed, or crashed in native code)"
        with self._cond:
            self._failure = (f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code "
                             f"{proc.exitcode}: {last}")
            self._cond.notify_all()
        logger.error("%s%s", self._failure, f"\n{report}" if report else "")

    @property
    def failure(self) -> str | None:
        return self._failure

    def wait_ready(self, timeout: float) -> None:
        """Until every worker is about to join the group; WorkerFailedError if one dies first."""
        deadline = time.monotonic() + timeout
        while len(self._ready) < len(self.procs):
            self._poll(POLL_S)
            if self._failure is not None:
                raise WorkerFailedError(self._failure)
            if time.monotonic() > deadline:
                raise WorkerFailedError(f"tensor-parallel workers {sorted(set(range(1, len(self.procs) + 1)) - self._ready)}"
                                        f" did not start within {timeout:.0f} s")

    def wait_failure(self, timeout: float) -> str | None:
        """The failure of a dead worker, waiting up to `timeout` for one to show (None: all alive)."""
        deadline = time.monotonic() + timeout
        while self._failure is None and time.monotonic() < deadline:
            if self._engine is None:  # no watchdog yet: poll here
                self._poll(POLL_S)
            else:
                with self._cond:
                    self._cond.wait(POLL_S)
        return self._failure

    # --- the watchdog --------------------------------------------------------------------------------------------
    def watch(self, engine) -> None:
        """Start the watchdog thread over `engine`'s workers (see the module docstring for what it does)."""
        self._engine = weakref.ref(engine)
        threading.Thread(target=self._watchdog, name="spruce-tp-watchdog", daemon=True).start()

    def _watchdog(self) -> None:
        grace = float(os.environ.get(GRACE_ENV, "10"))
        while not self.stopping:
            self._poll(POLL_S)
            if self._failure is None:
                continue
            engine = self._engine()
            if engine is not None and engine.failure is None:
                engine.failure = self._failure
            if self.exit_at_once:
                self._exit()
            stuck_since = time.monotonic()
            while not self.stopping and engine is not None and engine.busy_since is not None:
                if time.monotonic() - stuck_since > grace:
                    self._exit()
                time.sleep(POLL_S)
            return

    def _exit(self) -> None:
        print(f"spruce: error: {self._failure}; ending the driver process", file=sys.stderr, flush=True)
        os._exit(1)

    def join(self, timeout: float) -> None:
        """Wait for the workers to exit; terminate those still alive after `timeout`."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(deadline - time.monotonic(), 0.0))
        for p in self.procs:
            if p.exitcode is None:
                p.terminate()
                p.join(5.0)


# --- torchrun -----------------------------------------------------------------------------------------------------
def _join_torchrun(config, rank_setup, make_strategy):
    from spruce.distributed.group import init_tp_group
    from spruce.runtime.replicated_engine import DriverEngine, leave_group, serve_commands
    from spruce.runtime.engine import Engine

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != config.tp_size:
        raise ConfigError(f"torchrun started {world} processes (WORLD_SIZE) but tp_size={config.tp_size}; "
                          f"they must be equal")
    tp = init_tp_group(rank, world, config.device, "env://", local_rank=int(os.environ.get("LOCAL_RANK", rank)))
    if rank == 0:
        engine = DriverEngine(config, tp, make_strategy=make_strategy)
        if rank_setup is not None:
            rank_setup(engine, 0)
        _shutdown_at_exit(engine)
        return engine
    engine = Engine(config, tp, make_strategy=make_strategy)
    if rank_setup is not None:
        rank_setup(engine, rank)
    serve_commands(engine, tp)
    leave_group(engine)
    raise SystemExit(0)
