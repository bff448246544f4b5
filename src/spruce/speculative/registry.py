"""Which decode strategy an engine runs: the one place that maps what the runner loaded to a strategy."""

from __future__ import annotations

from spruce.runtime.model_runner import ModelRunner
from spruce.speculative.strategy import DecodeStrategy, PlainDecoding


def make_strategy(runner: ModelRunner, debug: bool = False) -> DecodeStrategy:
    """EAGLE (EAGLE, EAGLE-3) when a draft is loaded, else plain decoding."""
    if runner.draft is None:
        return PlainDecoding(runner)
    from spruce.speculative.eagle_worker import EagleWorker

    return EagleWorker(runner, debug=debug)
