"""Which decode strategy an engine runs: the one place that maps what the runner loaded to a strategy."""

from __future__ import annotations

from spruce.runtime.model_runner import ModelRunner
from spruce.speculative.strategy import DecodeStrategy, PlainDecoding


def make_strategy(runner: ModelRunner, debug: bool = False, adaptive: bool = False) -> DecodeStrategy:
    """EAGLE (EAGLE, EAGLE-3, NEXTN) when a draft is loaded, else plain decoding; `adaptive`: per decode step the
    EAGLE worker's round or a plain step, whichever is expected to commit more tokens per second
    (speculative/adaptive.py)."""
    if runner.draft is None:
        return PlainDecoding(runner)
    from spruce.speculative.eagle_worker import EagleWorker

    worker = EagleWorker(runner, debug=debug)
    if not adaptive:
        return worker
    from spruce.speculative.adaptive import AdaptiveDecoding

    return AdaptiveDecoding(worker)
