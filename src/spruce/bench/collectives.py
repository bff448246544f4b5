"""The collectives a tensor-parallel decode step pays, measured alone on the GPUs the engine uses.

A Llama decode step at tp ranks runs 2 all-reduces per layer (o_proj, down_proj) of [bs, hidden] plus one for
the embedding, and one all-gather of [bs, vocab / tp] logits. `measure_tp_collectives` times each, at every
batch size, on `tp` spawned processes (NCCL through the same group setup as the engine, NVLink multicast off),
replaying a CUDA graph of `iters` back-to-back collectives (as the engine's graphs run them) and reporting the
median time per collective. Run it when no engine holds the GPUs' NCCL (before or after the engines).
"""

from __future__ import annotations

import socket

import torch
import torch.multiprocessing as mp

ITERS = 50
REPEATS = 7


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed_graph(fn, iters: int) -> float:
    """Median milliseconds per call of `fn` over REPEATS replays of a graph holding `iters` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return sorted(times)[len(times) // 2]


def _rank(rank: int, tp: int, init_method: str, hidden: int, vocab: int, batch_sizes, dtype, results) -> None:
    from spruce.distributed.group import destroy_tp_group, init_tp_group

    group = init_tp_group(rank, tp, "cuda", init_method)
    out = {}
    for bs in batch_sizes:
        x = torch.randn(bs, hidden, dtype=dtype, device=group.device)
        logits = torch.randn(bs, vocab // tp, dtype=dtype, device=group.device)
        out[bs] = {"all_reduce_ms": _timed_graph(lambda: group.all_reduce(x), ITERS),
                   "all_gather_logits_ms": _timed_graph(lambda: group.all_gather_last(logits), ITERS)}
    if rank == 0:
        results.put(out)
    torch.distributed.barrier()
    destroy_tp_group()


def measure_tp_collectives(tp: int, hidden: int, vocab: int, batch_sizes: list[int],
                           dtype: torch.dtype = torch.bfloat16) -> dict[int, dict[str, float]]:
    """{batch size: {all_reduce_ms: one all-reduce of [bs, hidden], all_gather_logits_ms: one all-gather of
    [bs, vocab / tp] into [bs, vocab]}} on cuda:0..tp-1."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, tp, init_method, hidden, vocab, list(batch_sizes), dtype, results))
             for r in range(tp)]
    for p in procs:
        p.start()
    try:
        out = results.get(timeout=600)
    finally:
        for p in procs:
            p.join(60)
            if p.exitcode is None:
                p.terminate()
    return out


def collective_ms_per_step(collectives: dict[str, float], num_layers: int) -> float:
    """What one plain Llama decode step spends in collectives: 2 all-reduces per layer + the embedding's, and
    the logits' all-gather (each measured alone: an upper bound where NCCL overlaps nothing)."""
    return (2 * num_layers + 1) * collectives["all_reduce_ms"] + collectives["all_gather_logits_ms"]
