"""Per-phase timing for benchmarks: CUDA events on the GPU, wall clock on the CPU. Off by default."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch


_OFF = contextlib.nullcontext()  # what `phase` returns while off: reusable, no generator per call


class PhaseTimer:
    """`with timer.phase("verify"): ...` records the phase's time when enabled; a no-op otherwise."""

    def __init__(self, device: torch.device):
        self.device = device
        self.enabled = False
        self._pending: list[tuple[str, object, object]] = []
        self.totals: dict[str, float] = defaultdict(float)  # milliseconds
        self.counts: dict[str, int] = defaultdict(int)

    def phase(self, name: str):
        """A context that times its block as phase `name` when enabled; while off, a shared no-op (a decode step
        enters several; a generator context costs ~1 us more per block, a shared one nothing)."""
        return self._timed(name) if self.enabled else _OFF

    @contextlib.contextmanager
    def _timed(self, name: str):
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((name, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.totals[name] += (time.perf_counter() - t0) * 1e3
            self.counts[name] += 1

    def collect(self) -> dict[str, dict[str, float]]:
        """Sync once and return {phase: {total_ms, count, mean_ms}}."""
        if self._pending:
            torch.cuda.synchronize(self.device)
            for name, start, end in self._pending:
                self.totals[name] += start.elapsed_time(end)
                self.counts[name] += 1
            self._pending.clear()
        return {k: {"total_ms": self.totals[k], "count": self.counts[k], "mean_ms": self.totals[k] / self.counts[k]}
                for k in self.totals}

    def reset(self) -> None:
        self._pending.clear()
        self.totals.clear()
        self.counts.clear()
