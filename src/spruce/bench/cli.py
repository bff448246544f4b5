"""`spruce bench {latency,serving,parity,tp-parity,serving-compare,structured,ngram-accept,peer,moe,fp8}`.
Each benchmark's module (torch, httpx) loads only when it is chosen."""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = (
    ("latency", "offline latency/throughput benchmark", "spruce.bench.latency", "add_latency_parser"),
    ("serving", "online benchmark against a running server", "spruce.bench.serving", "add_serving_parser"),
    ("parity", "plain vs speculative greedy: divergences vs near-ties", "spruce.bench.parity", "add_parity_parser"),
    ("tp-parity", "tensor-parallel vs one-GPU greedy: match rate, divergences vs near-ties", "spruce.bench.tp_parity",
     "add_tp_parity_parser"),
    ("serving-compare", "several serving results on the same axes", "spruce.bench.serving_compare",
     "add_serving_compare_parser"),
    ("structured", "structured output: cost per round with and without speculation", "spruce.bench.structured",
     "add_structured_parser"),
    ("ngram-accept", "NGRAM speculation vs vLLM's ngram on a prompt-copying workload", "spruce.bench.ngram_accept",
     None),
    ("peer", "spruce served beside vLLM on one GPU, the same prompts and client", "spruce.bench.peer", None),
    ("moe", "one layer's routed experts per decode tile configuration, against the bytes read", "spruce.bench.moe",
     None),
    ("fp8", "FP8 weights and KV cache against bf16: GEMMs, decode steps, perplexity", "spruce.bench.fp8", None),
)  # (name, summary, module, its parser's registrar; None: the module's add_arguments(p) and run_main(args))


def add_parser(sub, add_engine_args) -> None:
    """Register `spruce bench` and list its benchmarks; their flags are registered once one is chosen."""
    from spruce.cli_args import LazySubcommands

    p = sub.add_parser("bench", help="benchmarks (results go to bench/results/)")
    bench_sub = p.add_subparsers(dest="bench", required=True, action=LazySubcommands)
    for name, summary, module, function in BENCHMARKS:
        bench_sub.add_lazy(name, summary, _registrar(name, module, function, summary))


def _registrar(name: str, module: str, function: str | None, summary: str = ""):
    """register(subparsers): import `module` and call its `function(subparsers)` (None: a parser `name` described
    by the module's docstring, its flags from `add_arguments(p)`, run by `run_main(args)`); a missing package is a
    clean argparse error naming it (a missing spruce module is a bug, and raises as it is)."""

    def register(subparsers) -> None:
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            if e.name is None or e.name.split(".")[0] == "spruce":
                raise
            raise argparse.ArgumentError(None, f"spruce bench {name} needs {e.name}, which is not installed: "
                                               f"pip install {e.name}") from e
        if function is not None:
            getattr(mod, function)(subparsers)
            return
        p = subparsers.add_parser(name, help=summary, description=mod.__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(func=mod.run_main)

    return register
