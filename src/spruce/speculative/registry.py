"""Which decode strategy an engine runs: the one place that maps what the runner loaded to a strategy."""

from __future__ import annotations

from spruce.memory.prefix_cache import PrefixCache
from spruce.runtime.model_runner import ModelRunner
from spruce.speculative.strategy import DecodeStrategy, PlainDecoding


def make_strategy(runner: ModelRunner, debug: bool = False, adaptive: bool = False,
                  prefix_cache: PrefixCache | None = None) -> DecodeStrategy:
    """EAGLE (EAGLE, EAGLE-3, NEXTN) when a draft is loaded, else plain decoding; `adaptive`: the EAGLE worker
    or a plain step per decode step, whichever is expected to commit more tokens per second (it asks the engine's
    `prefix_cache` which prompts repeat)."""
    if runner.draft is None:
        return PlainDecoding(runner)
    from spruce.speculative.eagle_worker import EagleWorker

    worker = EagleWorker(runner, debug=debug)
    if not adaptive:
        return worker
    from spruce.speculative.adaptive import AdaptiveDecoding

    return AdaptiveDecoding(worker, prefix_cache)
