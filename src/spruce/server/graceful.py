"""`GracefulServer`: uvicorn's server with a draining shutdown.

uvicorn alone, on SIGTERM, stops listening at once, waits `timeout_graceful_shutdown` for open responses and
then cancels them: streams end mid-body (clients read `incomplete chunked read`) and the log fills with
CancelledError tracebacks; it also re-raises the signal at exit, so the process dies by it instead of
exiting 0. Here the first SIGTERM or SIGINT runs the app's `drain` (keep listening but refuse new requests
with 503, let running ones finish within a grace period, end the rest with an error) and only then lets
uvicorn shut down, which by then finds only finished responses. A second signal stops at once.

Given `engine_failure` (why the engine failed, or None), the server also shuts down once the engine has failed
(every request in flight has its error by then) and `exit_code` becomes ENGINE_FAILED_EXIT_CODE, so that a
supervisor (systemd, Kubernetes) restarts it (DESIGN §20).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

import uvicorn

log = logging.getLogger("spruce.server")
ENGINE_FAILED_EXIT_CODE = 70  # sysexits' EX_SOFTWARE: the engine raised (0: a clean shutdown, 1: no start)


class GracefulServer(uvicorn.Server):
    """uvicorn.Server whose shutdown signal first awaits `drain()`; exits without re-raising the signal, and
    (with `engine_failure`) once the engine has failed."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]],
                 engine_failure: Callable[[], str | None] | None = None):
        super().__init__(config)
        self._drain = drain
        self._drain_requested = False
        self._drain_task: asyncio.Task | None = None
        self._engine_failure = engine_failure
        self.exit_code = 0  # what the process should exit with once `run` returns (after a start)

    def handle_exit(self, sig, frame) -> None:
        """Signal handler (also callable directly): the first call asks for a drain, a second stops now."""
        if self._drain_requested:
            log.warning("shutdown signal received again: stopping now")
            self.should_exit = self.force_exit = True
            return
        self._drain_requested = True

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's periodic tick (every 0.1 s): starts a requested drain on the event loop."""
        if self._drain_requested and self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain_then_exit())
        failure = self._engine_failure() if self._engine_failure is not None and not self.should_exit else None
        if failure is not None:
            log.error("the engine failed (%s): shutting down with exit code %d so that a supervisor restarts the "
                      "server", failure, ENGINE_FAILED_EXIT_CODE)
            self.exit_code = ENGINE_FAILED_EXIT_CODE
            self.should_exit = True
        return await super().on_tick(counter)

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        except Exception:
            log.exception("graceful shutdown failed; stopping now")
        self.should_exit = True
