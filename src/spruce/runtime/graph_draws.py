"""Graph draws: which capture of the one-request decode graph to keep (`BucketGraphs.keep_fastest`).

A decode graph's replay takes a different time depending on where its capture lands in device memory, with the same
kernels computing the same values: on the H100 (2026-11-28, pycode-19m, bench/graph_replays_alone.py --rerolls)
seven captures of the bucket-1 plain decode graph in one process, each in a memory pool of its own, replayed over a
request's 1.3k-position KV in 283-304 us, the stream idle longer between the kernels of the slow ones; the same
sequence of captures reproduced to within 0.5 us in a second process, and the first capture (the one a server
keeps) was among the slowest in all three sequences tried (298, 303 and 300 us against a best of 284, 283 and 287).
So two engines built alike but for what else they allocate (a plain one, an adaptive one whose plain steps run the
plain engine's kernels) hold graphs of different speed, by a few percent at one request, each the same in every
process: the placement, not the work.

`EngineConfig.cuda_graph_draws` captures the plain decode graph of the smallest bucket (one request, where a step
is shortest and the gaps between kernels weigh most) that many times and keeps the fastest. Each draw is timed on
the stream (CUDA events around DRAW_REPLAYS replays back to back) over one row at each of DRAW_KV_LENGTHS positions
(the dummy row for 1; a row of the pool's own pages for the others, borrowed at start-up and given back as they
were), DRAW_ROUNDS rounds over all draws in turn, and scored by the sum over the lengths of each length's median:
the rank of the draws moves with the KV length (the correlation between a draw's time over 640 positions and over
1.3k was 0.29-0.96 across the three sequences), so no one length decides it. The replays advance the row's state
and write its KV past the timed positions; the row is set back before each timing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from spruce.runtime.model_runner import ModelRunner

DRAW_KV_LENGTHS = (1, 256, 1024)  # positions of the timed row (capped by what one request may hold)
DRAW_REPLAYS = 50  # replays back to back per timing
DRAW_ROUNDS = 3  # timings per draw and length (in turn over the draws), their median counted


def draw_lengths(runner: ModelRunner) -> list[int]:
    """DRAW_KV_LENGTHS that one request's row can hold with DRAW_REPLAYS more positions after them (and the
    lookahead's pages), in the pages the pool has free."""
    lim = runner.limits
    room = min(lim.kv_capacity, lim.page_size * runner.allocator.num_free) - lim.lookahead - DRAW_REPLAYS
    return [length for length in DRAW_KV_LENGTHS if length == 1 or length <= room]


def score_draws(runner: ModelRunner, rows: torch.Tensor, replays: list[Callable[[], None]]) -> list[float]:
    """Seconds a replay of each draw's one-request decode graph (`replays`), summed over `draw_lengths`: the
    graphs read their row from `rows[0]` (the strategy's static input), which this sets to the timed row."""
    lengths = draw_lengths(runner)
    longest = max(lengths)
    lim = runner.limits
    row, pages = None, []
    if longest > 1:
        row = runner.page_table.alloc_row()
        pages = runner.allocator.alloc(lim.pages_for(longest + DRAW_REPLAYS + lim.lookahead))
        runner.page_table.append_pages(row, pages)
    row_t = torch.tensor([lim.dummy_row if row is None else row], device=runner.device)
    timings: dict[tuple[int, int], list[float]] = {}
    try:
        for _ in range(DRAW_ROUNDS):
            for length in lengths:
                rows[0] = lim.dummy_row if length == 1 else row
                for i, replay in enumerate(replays):
                    if length > 1:
                        runner.row_state.set(row_t, torch.full_like(row_t, length), torch.zeros_like(row_t))
                    timings.setdefault((i, length), []).append(stream_seconds(replay, DRAW_REPLAYS, runner.device))
    finally:
        rows[0] = lim.dummy_row
        if row is not None:
            runner.row_state.set(row_t, torch.zeros_like(row_t), torch.zeros_like(row_t))
            runner.allocator.free(list(reversed(runner.page_table.release_row(row))))  # the free list as it was
    return [sum(statistics.median(timings[(i, length)]) for length in lengths) for i in range(len(replays))]


def stream_seconds(run: Callable[[], None], count: int, device: torch.device) -> float:
    """The stream's seconds per call of `run`, `count` calls back to back between two events (on the CPU, where
    the calls are the work, their wall time)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(count):
            run()
        return (time.perf_counter() - t0) / count
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.current_stream().synchronize()
    start.record()
    for _ in range(count):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / count
