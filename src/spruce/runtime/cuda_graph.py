"""CUDA graphs per bucket: batch sizes for the decode-time phases, token counts for prefills (DESIGN §4).

A phase is a function `fn(P, max_kv_len, *previous)` of the padded batch size P that reads its inputs from
persistent buffers (the metadata builder's, the caller's static inputs with rows past the real batch set to
the dummy row) and from the previous phase's output, passed explicitly, and returns tensors. The very same function runs eagerly
(P = real batch, max_kv_len = the real bound) or is captured once per bucket (max_kv_len = the Limits
bound) and replayed. A batch larger than the largest bucket runs every phase eagerly, so each phase reads
the eager outputs of the one before, never a graph's buffers: an always-on check compares the rows a phase's
input was made for (`batch_rows`) with the rows it runs (SGLang #22832: a multi-layer draft extend read a
decode graph's buffers after the decode had run eagerly).

A phase comes with a plan callback `plan(P, max_kv_len)` (DESIGN §13): it plans the attention backend for the
forwards the phase will run, on the host, outside any graph. `run` calls it before the eager `fn` and before
`graph.replay()` (with the replay's own batch: the bucket's rows and the real max_kv_len), `capture` before
warming up and capturing; while a phase's Python code runs, `phase` names it, and the runner then requires its
forwards to be planned (model_runner.py).
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Any, Callable

import torch
from tqdm import tqdm

from spruce.errors import InvariantError
from spruce.limits import Limits

PhaseFn = Callable[..., Any]
PlanFn = Callable[[int, int], None]  # plan(P, max_kv_len): plan the phase's forwards for P rows (DESIGN §13)


class BucketGraphs:
    """Graphs of phases keyed by (name, bucket). The decode-time phases' buckets are batch sizes (the default,
    `Limits.graph_buckets`); the prefill's are token counts (`Limits.prefill_graph_tokens`, `for_prefill`)."""

    def __init__(self, limits: Limits, device: torch.device, enabled: bool, buckets: tuple[int, ...] | None = None,
                 bucket_for: Callable[[int], int | None] | None = None):
        self.limits = limits
        self.device = device
        self.buckets = limits.graph_buckets if buckets is None else buckets
        self._bucket_for = limits.bucket_for if bucket_for is None else bucket_for
        self.enabled = enabled and device.type == "cuda" and bool(self.buckets)
        self.graphs: dict[tuple[str, int], tuple[torch.cuda.CUDAGraph, Any]] = {}
        self.predecessor: dict[str, str] = {}  # phase -> the phase whose output it reads (set by capture)
        self.phase: str | None = None  # the phase whose Python code (eager run, warm-up, capture) is running

    @contextmanager
    def running(self, name: str):
        """Mark phase `name`'s Python code as running (its forwards must then be planned: DESIGN §13)."""
        outer, self.phase = self.phase, name
        try:
            yield
        finally:
            self.phase = outer

    @classmethod
    def for_prefill(cls, limits: Limits, device: torch.device, enabled: bool) -> "BucketGraphs":
        """Graphs of the prefill, one per token bucket (a batch of prompt chunks padded up to it)."""
        return cls(limits, device, enabled, limits.prefill_graph_tokens, limits.prefill_bucket_for)

    @property
    def kv_bound(self) -> int:
        """max_kv_len graphs are captured with: the most positions any request can hold."""
        return self.limits.kv_capacity

    def bucket(self, bs: int) -> int | None:
        """The bucket a batch of `bs` (requests, or a prefill's tokens) replays, or None (eager)."""
        return self._bucket_for(bs) if self.enabled else None

    def captured(self, name: str, bucket: int) -> bool:
        """Whether phase `name` has a graph for `bucket`."""
        return (name, bucket) in self.graphs

    @property
    def count(self) -> int:
        """Graphs captured (every phase, every bucket; Engine.info's cuda_graphs_captured)."""
        return len(self.graphs)

    def padded_size(self, bs: int) -> int:
        """Rows the caller fills (real + dummy padding) for a batch of `bs` requests."""
        return self.bucket(bs) or bs

    def run(self, name: str, fn: PhaseFn, bs: int, max_kv_len: int, *previous, plan: PlanFn | None = None):
        """Replay phase `name` for the batch's bucket, or run `fn(bs, max_kv_len, *previous)` eagerly.

        `previous` is the output of the phase before (eager, or the replayed graph's own static output, which
        is what that graph's successor was captured reading). `plan(rows, max_kv_len)` runs first, outside the
        graph: rows = bs (eager) or the bucket (replay: padding rows included)."""
        bucket = self.bucket(bs)
        if bucket is not None and bucket < bs:
            raise InvariantError(
                f"{name}: batch of {bs} requests would replay the graph captured for {bucket} "
                f"(buckets {self.buckets}, max_running_requests {self.limits.max_running_requests})"
            )
        entry = self.graphs.get((name, bucket)) if bucket is not None else None
        if entry is None and "eager_reads_eager_outputs" in self.limits.reverted_fixes and name in self.predecessor:
            largest = self.graphs.get((self.predecessor[name], self.buckets[-1]))
            if largest is not None:  # reverted: the static output of the largest graph, whatever ran
                previous = (largest[1],)
        rows = bucket if entry is not None else bs
        for prev in previous:
            made_for = getattr(prev, "batch_rows", rows)
            if made_for != rows:
                raise InvariantError(
                    f"{name}: a batch of {bs} requests ({'graph bucket ' + str(bucket) if entry else 'eager'}) would "
                    f"read its predecessor's output made for {made_for} rows (a graph's static buffers read by an "
                    f"eager phase, or the reverse)"
                )
        if plan is not None:
            plan(rows, max_kv_len)
        if entry is None:
            with self.running(name):
                return fn(bs, max_kv_len, *previous)
        graph, out = entry
        graph.replay()
        return out

    def release(self) -> None:
        """Free every captured graph; later phases run eagerly. A tensor-parallel rank calls this before it
        leaves its NCCL group: NCCL waits for the collectives captured in live graphs, so destroying the group
        while they exist hangs (seen on 2 H200s)."""
        if self.graphs:
            torch.cuda.synchronize(self.device)
            for graph, _ in self.graphs.values():
                graph.reset()
            self.graphs.clear()
        self.enabled = False

    def capture(self, phases: list[tuple[str, PhaseFn, PlanFn | None]], prepare: Callable[[int], None], desc: str,
                show_progress: bool = False) -> None:
        """Capture the chain of phases (name, fn, plan) for every bucket (largest first; one memory pool for all).

        `prepare(P)` fills the static inputs with P padding rows. Each phase is planned (outside the graph),
        warmed up eagerly, captured, then replayed once so the next phase's warm-up reads real values; its
        captured output is the next phase's `previous` argument.
        """
        if not self.enabled:
            return
        with _no_gc_during_capture():
            self._capture(phases, prepare, desc, show_progress)

    def _capture(self, phases, prepare, desc: str, show_progress: bool) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for bucket in tqdm(sorted(self.buckets, reverse=True), desc=desc, disable=not show_progress):
            self._capture_bucket(phases, prepare, bucket, pool, stream)
        torch.cuda.synchronize(self.device)

    def _capture_bucket(self, phases, prepare, bucket: int, pool, stream: torch.cuda.Stream) -> None:
        """Capture the chain of phases for one bucket into memory pool `pool` (`capture`)."""
        prepare(bucket)
        previous: tuple = ()
        for before, (name, fn, plan) in zip([None, *(p[0] for p in phases)], phases):
            if before is not None:
                self.predecessor[name] = before
            if plan is not None:
                plan(bucket, self.kv_bound)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), self.running(name):
                fn(bucket, self.kv_bound, *previous)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream), self.running(name):
                out = fn(bucket, self.kv_bound, *previous)
            graph.replay()
            self.graphs[(name, bucket)] = (graph, out)
            previous = (out,)


@contextmanager
def _no_gc_during_capture():
    """Collect garbage now and not while graphs are captured: a collection during capture can free an earlier
    engine's pinned host buffers, whose release records CUDA events on other streams, which invalidates the
    capture (`cudaErrorStreamCaptureInvalidated`: seen on the H100 with FlashInfer, creating an engine after
    deleting one). torch.cuda.graph no longer collects before capture by default."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
