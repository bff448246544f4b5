"""Which decode strategy an engine runs: the one place that maps what the runner loaded to a strategy.

`make_strategy` is the StrategyFactory (runtime/strategy.py) that whatever builds an Engine passes in (llm.py's
LLM, runtime/launch.py's `create_engine` callers): speculative/ plugs into runtime/, never the other way."""

from __future__ import annotations

from spruce.runtime.model_runner import ModelRunner
from spruce.runtime.strategy import DecodeStrategy, PlainDecoding


def make_strategy(runner: ModelRunner, debug: bool = False, adaptive: bool = False) -> DecodeStrategy:
    """EAGLE (EAGLE, EAGLE-3, NEXTN) or a draft LM (STANDALONE) when a draft is loaded, else plain decoding;
    `adaptive`: per decode step the worker's round or a plain step, whichever is expected to commit more tokens per
    second (speculative/adaptive.py). NGRAM loads no draft: its worker drafts from each request's context."""
    spec = runner.config.speculative
    if spec is not None and spec.algorithm == "NGRAM":
        from spruce.speculative.ngram import NgramWorker

        return NgramWorker(runner, debug=debug)  # speculative_adaptive is refused with NGRAM (config.py)
    if runner.draft is None:
        return PlainDecoding(runner)
    from spruce.speculative.eagle_worker import EagleWorker

    if runner.config.speculative.algorithm == "STANDALONE":
        from spruce.speculative.draft_model import DraftModelWorker

        worker = DraftModelWorker(runner, debug=debug)
    else:
        worker = EagleWorker(runner, debug=debug)
    if not adaptive:
        return worker
    from spruce.speculative.adaptive import AdaptiveDecoding

    return AdaptiveDecoding(worker)
