"""The engine flags every model-loading subcommand shares, and the lazy subcommand action: the argument helpers
that `spruce.cli`, `spruce.server.cli` and `spruce.bench.cli` import (they import nothing of those)."""

from __future__ import annotations

import argparse


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags shared by every subcommand that loads a model (SGLang's names)."""
    from spruce.attention import registry as attention_registry  # names and capabilities only: no torch

    p.add_argument("--model", "--model-path", dest="model", default=None,
                   help="HF model directory (default: the bundled pycode-6m demo model)")
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights built from config.json alone, no safetensors read (vLLM's flag; for "
                        "benchmarks at real shapes: speed does not depend on the values)")
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: quantize a bf16 checkpoint's linear weights to FP8 at load, one scale per output channel "
                        "(vLLM's flag); FP8 checkpoints (block-wise, per-channel, per-tensor) load as FP8 without it")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="auto: the model dtype; fp8 / fp8_e4m3: the target's KV cache in float8_e4m3fn with the "
                        "checkpoint's per-layer k_scale / v_scale (else 1.0); torch and triton attention backends")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--attention-backend", default=None, choices=attention_registry.choices(),
                   help=f"default: {attention_registry.AUTO} on cuda (per phase, the backend this GPU's kernel table "
                        f"measured faster; else {attention_registry.AUTO_FALLBACK}), "
                        f"{attention_registry.AUTO_CPU_BACKEND} on cpu")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-running-requests", type=int, default=16)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    p.add_argument("--chunked-prefill-size", type=int, default=2048)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None)
    p.add_argument("--cuda-graph-max-prefill-tokens", type=int, default=256,
                   help="prefill batches of at most this many new tokens replay CUDA graphs (padded up to a token "
                        "bucket); 0: every prefill runs eagerly")
    p.add_argument("--speculative-algorithm", default=None, choices=["EAGLE", "EAGLE3", "NEXTN", "MTP"],
                   help="NEXTN (alias MTP): draft with the target checkpoint's own MTP layers (no draft path needed)")
    p.add_argument("--speculative-draft-model-path", default=None)
    p.add_argument("--speculative-num-steps", type=int, default=None)
    p.add_argument("--speculative-eagle-topk", type=int, default=None)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    p.add_argument("--speculative-synthetic-acceptance-length", type=float, default=None, metavar="L",
                   help="BENCHMARK SETTING, outputs are not the target's: accept drafts instead of verifying them, at "
                        "mean acceptance length L (tokens a round commits, bonus included; 1 to steps+1), as vLLM's "
                        "rejection_sample_method='synthetic' (for random-weight models at a real acceptance)")
    p.add_argument("--speculative-synthetic-acceptance-rates", type=_rates, default=None, metavar="R1,R2,...",
                   help="BENCHMARK SETTING, as --speculative-synthetic-acceptance-length but per draft depth: "
                        "R_d is the probability a round accepts depths 1..d (one per step, non-increasing)")
    p.add_argument("--speculative-adaptive", action="store_true", default=None,
                   help="per decode step, run a speculative round or a plain step, whichever the step costs measured "
                        "at start-up and the running acceptance expect to commit more tokens per second")
    p.add_argument("--speculative-adaptive-widths", type=int, nargs="+", default=None, metavar="N'",
                   help="with --speculative-adaptive: narrower verify trees (each below --speculative-num-draft-tokens)"
                        " its rounds may run; per batch size the width with the most expected tokens per second")
    p.add_argument("--disable-speculative", action="store_true",
                   help="run the bundled demo model without its bundled draft head")
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--disable-radix-cache", action="store_true",
                   help="no prefix cache: every prompt is computed in full (SGLang's flag)")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="resolve each step before planning the next (overlap scheduling is on by default)")
    p.add_argument("--scheduler-delay-factor", type=float, default=0.0,
                   help="prefill batching (vLLM's option): while requests decode, hold arrivals until their waits "
                        "add up to the stall a prefill would cost the decoding requests, at most this many times "
                        "the recent prefill launch time; fewer prefill launches for more TTFT (default 0: admit at "
                        "once)")
    p.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1,
                   help="tensor-parallel ranks: this process and N-1 spawned workers (rank r on cuda:r; gloo on "
                        "cpu), or the processes torchrun started (WORLD_SIZE must equal N)")


def _rates(text: str) -> tuple[float, ...]:
    """argparse type: comma-separated numbers, e.g. '0.9,0.7,0.5' (their range is checked with the config)."""
    try:
        return tuple(float(r) for r in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers such as 0.9,0.7,0.5, got {text!r}")


SPECULATIVE_FLAGS = ("speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps",
                     "speculative_eagle_topk", "speculative_num_draft_tokens",
                     "speculative_synthetic_acceptance_length", "speculative_synthetic_acceptance_rates",
                     "speculative_adaptive",
                     "speculative_adaptive_widths")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def draft_path(args: argparse.Namespace) -> str | None:
    """The draft to load: --speculative-draft-model-path, else the bundled head when running the bundled demo
    model; None with --disable-speculative. Speculation flags that would be ignored are refused."""
    from spruce.config import builtin_draft_path
    from spruce.errors import ConfigError

    given = [_flag(d) for d in SPECULATIVE_FLAGS if getattr(args, d) is not None]
    if args.disable_speculative:
        if given:
            raise ConfigError(f"{', '.join(given)} conflicts with --disable-speculative; drop one or the other")
        return None
    if args.speculative_draft_model_path is not None:
        return args.speculative_draft_model_path
    if (args.speculative_algorithm or "").upper() in ("NEXTN", "MTP"):
        return None  # the target's own MTP layers
    if args.model is None and builtin_draft_path().exists():
        return str(builtin_draft_path())
    if given:
        raise ConfigError(f"{', '.join(given)} given without a draft model: add --speculative-draft-model-path DRAFT "
                          f"(an EAGLE or EAGLE-3 head for --model), or drop the speculation flags")
    return None


def engine_kwargs(args: argparse.Namespace) -> dict:
    """LLM(...) keyword arguments from parsed engine flags."""
    import torch

    draft = draft_path(args)
    # speculation is on with a draft path, or with NEXTN alone (the target's own MTP layers)
    spec = draft is not None or (not args.disable_speculative
                                 and (args.speculative_algorithm or "").upper() in ("NEXTN", "MTP"))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    return dict(
        model=args.model, tokenizer=args.tokenizer_path, device=device, dtype=dtype,
        attention_backend=args.attention_backend, page_size=args.page_size,
        max_running_requests=args.max_running_requests, context_length=args.context_length,
        max_total_tokens=args.max_total_tokens, mem_fraction_static=args.mem_fraction_static,
        chunked_prefill_size=args.chunked_prefill_size,
        cuda_graph=False if args.disable_cuda_graph else None, cuda_graph_max_bs=args.cuda_graph_max_bs,
        cuda_graph_max_prefill_tokens=args.cuda_graph_max_prefill_tokens,
        draft_model=draft, speculative_algorithm=args.speculative_algorithm if spec else None,
        speculative_num_steps=args.speculative_num_steps if spec else None,
        speculative_eagle_topk=args.speculative_eagle_topk if spec else None,
        speculative_num_draft_tokens=args.speculative_num_draft_tokens if spec else None,
        speculative_synthetic_acceptance_length=args.speculative_synthetic_acceptance_length if spec else None,
        speculative_synthetic_acceptance_rates=args.speculative_synthetic_acceptance_rates if spec else None,
        speculative_adaptive=bool(spec and args.speculative_adaptive),
        speculative_adaptive_widths=tuple(args.speculative_adaptive_widths or ()) if spec else (),
        load_format=args.load_format, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        seed=args.random_seed, show_progress=True, disable_overlap_schedule=args.disable_overlap_schedule,
        disable_radix_cache=args.disable_radix_cache, tp_size=args.tp_size,
        scheduler_delay_factor=args.scheduler_delay_factor,
    )


class LazySubcommands(argparse._SubParsersAction):
    """Subcommands listed by name and help, whose flags are registered only once that subcommand is chosen:
    listing them (`--help`) imports nothing of the modules that define them.

    `add_lazy(name, help, register)` lists `name`; when it is chosen, `register(self)` adds the real parser
    through `self.add_parser(name, ...)`, in place of the listed one.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._registrars = {}

    def add_lazy(self, name: str, help: str, register) -> None:
        self.add_parser(name, help=help)
        self._registrars[name] = register

    def __call__(self, parser, namespace, values, option_string=None):
        register = self._registrars.pop(values[0], None)
        if register is not None:
            del self._name_parser_map[values[0]]
            register(self)
        super().__call__(parser, namespace, values, option_string)
