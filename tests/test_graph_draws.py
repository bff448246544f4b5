"""Graph draws (runtime/graph_draws.py): the flag, and the timed row borrowed from the pool and given back as it
was. The draws themselves (captures kept or freed, outputs unchanged) need CUDA: tests/test_gpu.py."""

from __future__ import annotations

import time

import pytest
import torch

from spruce import LLM
from spruce.cli import build_parser, engine_kwargs
from spruce.config import EngineConfig, builtin_model_path
from spruce.errors import ConfigError
from spruce.runtime import graph_draws
from spruce.runtime.graph_draws import DRAW_KV_LENGTHS, DRAW_REPLAYS, DRAW_ROUNDS, draw_lengths, score_draws

TARGET = builtin_model_path()


def test_the_draws_flag():
    """--cuda-graph-draws reaches the config (default 6); values below 1 or not integers fail naming the value;
    the CPU captures nothing, so nothing is drawn."""
    args = build_parser().parse_args(["generate", "--model", str(TARGET), "--prompt", "x", "--cuda-graph-draws", "3"])
    assert engine_kwargs(args)["cuda_graph_draws"] == 3
    args = build_parser().parse_args(["generate", "--model", str(TARGET), "--prompt", "x"])
    assert engine_kwargs(args)["cuda_graph_draws"] == 6
    for bad in (0, -2, 1.5, True, "3"):
        with pytest.raises(ConfigError, match=f"cuda_graph_draws must be an integer >= 1.*got {bad!r}"):
            EngineConfig(model=str(TARGET), cuda_graph_draws=bad)
    llm = LLM(TARGET, max_running_requests=2, context_length=64, cuda_graph_draws=3)
    assert llm.engine.info()["cuda_graph_draws"] == "off" and not llm.engine.runner.graphs.draws


def test_a_draw_is_timed_over_a_borrowed_row_that_goes_back_as_it_was():
    """score_draws times each draw over the dummy row and over a row of the pool's pages at each length, every
    timing from the same state, and leaves the allocator's free list, the page table, the row state and the
    static input exactly as they were (the first request after start-up gets the pages it would have got). A draw
    that takes longer scores higher."""
    llm = LLM(TARGET, max_running_requests=4, context_length=2048)
    engine = llm.engine
    runner = engine.runner
    rows = engine.strategy.rows
    assert draw_lengths(runner) == list(DRAW_KV_LENGTHS)
    before = (list(runner.allocator._free), list(runner.page_table._free_rows), runner.page_table.table.clone(),
              runner.row_state.committed.clone(), runner.row_state.last_token.clone(), rows.clone())
    seen: list[list[tuple[int, int]]] = [[], []]

    def replay(draw: int):
        def run():  # a decode graph's effect on the row's state: one position further
            row = int(rows[0])
            committed = int(runner.row_state.committed[row])
            seen[draw].append((row, committed))
            if row != runner.limits.dummy_row:
                runner.row_state.set(rows[:1], runner.row_state.committed[rows[:1]] + 1, rows[:1] * 0)
                assert runner.page_table.table[row, (committed + 1) // runner.limits.page_size] != 0
            if draw == 1:
                time.sleep(2e-4)
        return run

    scores = score_draws(runner, rows, [replay(0), replay(1)])
    assert scores[1] > scores[0] + 0.5 * 2e-4 * len(DRAW_KV_LENGTHS)
    for calls in seen:
        assert len(calls) == DRAW_ROUNDS * len(DRAW_KV_LENGTHS) * DRAW_REPLAYS
        starts = calls[::DRAW_REPLAYS]
        dummy = runner.limits.dummy_row
        timed = [committed for row, committed in starts if row != dummy]
        assert timed == [length for _ in range(DRAW_ROUNDS) for length in DRAW_KV_LENGTHS[1:]]
        assert sum(row == dummy for row, _ in starts) == DRAW_ROUNDS
    after = (list(runner.allocator._free), list(runner.page_table._free_rows), runner.page_table.table,
             runner.row_state.committed, runner.row_state.last_token, rows)
    assert before[:2] == after[:2]
    assert all(torch.equal(b, a) for b, a in zip(before[2:], after[2:]))
    engine.check_no_leaks()


def test_the_lengths_a_small_pool_or_context_can_time(monkeypatch):
    """Lengths a row cannot hold (with the replays and the lookahead after them) or the free pages cannot are left
    out; the dummy row's always stays; the pages of the longest kept are there to borrow."""
    llm = LLM(TARGET, max_running_requests=2, context_length=512)
    runner = llm.engine.runner
    lim = runner.limits
    assert draw_lengths(runner) == [1, 256]
    assert lim.lookahead >= 1 and (302 + DRAW_REPLAYS) % lim.page_size == 0  # the lookahead needs a page more
    monkeypatch.setattr(graph_draws, "DRAW_KV_LENGTHS", (1, 302, 2048))
    assert draw_lengths(runner) == [1, 302]
    needed = lim.pages_for(302 + DRAW_REPLAYS + lim.lookahead)
    for free in (needed, needed - 1):
        held = runner.allocator.alloc(runner.allocator.num_free - free)
        lengths = draw_lengths(runner)
        assert lengths == ([1, 302] if free == needed else [1])
        assert lim.pages_for(max(lengths) + DRAW_REPLAYS + lim.lookahead) <= runner.allocator.num_free
        runner.allocator.free(held)
