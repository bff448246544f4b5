"""The engine flags every model-loading subcommand shares, and the lazy subcommand action: the argument helpers
that `spruce.cli`, `spruce.server.cli` and `spruce.bench.cli` import (they import nothing of those).

Flag names are SGLang's, with vLLM's beside them meaning the same (`--max-model-len` = `--context-length`, ...),
vLLM's `--speculative-config '{json}'`, `--config FILE.yaml` and a positional model. Flags are matched exactly
(no prefixes: `--max-q 3` is an error, not `--max-queued-requests 3`).
"""

from __future__ import annotations

import argparse
import json
import sys


def add_engine_args(p: argparse.ArgumentParser, engine_seed_alias: bool = True) -> None:
    """Engine flags shared by every subcommand that loads a model (SGLang's names, vLLM's beside them).

    `engine_seed_alias`: register vLLM's `--seed` for `--random-seed` (`spruce generate` keeps `--seed` for its
    request's sampling seed)."""
    from spruce.attention import registry as attention_registry  # names and capabilities only: no torch

    p.set_defaults(_engine_args=True)  # ArgumentParser.parse_known_args finishes these (finish_engine_args)
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="HF model directory, as vLLM's `vllm serve MODEL` (same as --model)")
    p.add_argument("--model", "--model-path", dest="model", default=None,
                   help="HF model directory (default: the bundled pycode-6m demo model)")
    p.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="vLLM's config file: a YAML mapping of flag names (without --) to values, e.g. "
                        "'max-model-len: 4096'; flags on the command line win over it")
    p.add_argument("--tokenizer-path", "--tokenizer", dest="tokenizer_path", default=None)
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights built from config.json alone, no safetensors read (vLLM's flag; for "
                        "benchmarks at real shapes: speed does not depend on the values)")
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: quantize a bf16 checkpoint's linear weights to FP8 at load, one scale per output channel "
                        "(vLLM's flag); FP8 checkpoints (block-wise, per-channel, per-tensor) load as FP8 without it")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="auto: the model dtype; fp8 / fp8_e4m3: the target's KV cache in float8_e4m3fn with the "
                        "checkpoint's per-layer k_scale / v_scale (else 1.0); torch and triton attention backends "
                        "(auto: triton on CUDA)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default="auto", type=_dtype, metavar="{" + ",".join(DTYPE_CHOICES) + "}",
                   help="auto (default): the checkpoint's torch_dtype on cuda (bfloat16 for a float32 checkpoint, "
                        "as vLLM), float32 on cpu; half = float16, float = float32")
    p.add_argument("--attention-backend", default=None, choices=attention_registry.choices(),
                   help=f"default: {attention_registry.AUTO} on cuda (per phase, the backend this GPU's kernel table "
                        f"measured faster; else {attention_registry.AUTO_FALLBACK}), "
                        f"{attention_registry.AUTO_CPU_BACKEND} on cpu")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-running-requests", "--max-num-seqs", dest="max_running_requests", type=int, default=None,
                   help="requests decoded together (vLLM's --max-num-seqs). Default: on cuda vLLM's, by the GPU's "
                        "memory (1024 with 70 GiB or more, except an A100; else 256); on cpu 16")
    p.add_argument("--context-length", "--max-model-len", dest="context_length", type=int, default=None,
                   help="most tokens (prompt + output) of one request (default: the model's max_position_embeddings)")
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--mem-fraction-static", "--gpu-memory-utilization", dest="mem_fraction_static", type=float,
                   default=0.85, help="fraction of the GPU's memory for the weights and the KV cache")
    p.add_argument("--chunked-prefill-size", "--max-num-batched-tokens", dest="chunked_prefill_size", type=int,
                   default=2048, help="most prompt tokens one step computes (with plain decoding, decode rows and "
                                      "prompt chunks share it: vLLM's --max-num-batched-tokens)")
    p.add_argument("--disable-cuda-graph", "--enforce-eager", dest="disable_cuda_graph", action="store_true")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None)
    p.add_argument("--cuda-graph-max-prefill-tokens", type=int, default=256,
                   help="prefill batches of at most this many new tokens replay CUDA graphs (padded up to a token "
                        "bucket); 0: every prefill runs eagerly")
    p.add_argument("--speculative-algorithm", default=None, type=str.upper,
                   choices=["EAGLE", "EAGLE3", "NEXTN", "MTP", "STANDALONE", "NGRAM"],
                   help="any case; NEXTN (alias MTP): draft with the target checkpoint's own MTP layers (no draft "
                        "path needed); STANDALONE: the draft path is a small causal LM with the target's vocabulary; "
                        "NGRAM: drafts copied from the prompt and output (prompt lookup), no draft model")
    p.add_argument("--speculative-config", default=None, type=_json_object, metavar="JSON",
                   help="vLLM's speculative settings as JSON: method (eagle, eagle3, mtp, deepseek_mtp, draft_model), "
                        "model, "
                        "num_speculative_tokens (a chain of that many drafts unless eagle_topk / num_draft_tokens "
                        "make a tree), draft_tensor_parallel_size (the target's), rejection_sample_method "
                        "(standard, or synthetic with synthetic_acceptance_length or synthetic_acceptance_rates); "
                        "method ngram with prompt_lookup_min / prompt_lookup_max")
    p.add_argument("--speculative-draft-model-path", default=None)
    p.add_argument("--speculative-prompt-lookup-min", type=int, default=None, metavar="N",
                   help="NGRAM: the shortest n-gram ending the context that is looked up in it (vLLM's "
                        "prompt_lookup_min; default: the max, or 5)")
    p.add_argument("--speculative-prompt-lookup-max", type=int, default=None, metavar="N",
                   help="NGRAM: the longest n-gram looked up; the longest that occurred earlier wins, its earliest "
                        "occurrence proposes the tokens after it (vLLM's prompt_lookup_max; default: the min, or 5)")
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
    seed_flags = ("--random-seed", "--seed") if engine_seed_alias else ("--random-seed",)
    p.add_argument(*seed_flags, dest="random_seed", type=int, default=0)
    p.add_argument("--disable-radix-cache", "--no-enable-prefix-caching", dest="disable_radix_cache",
                   action="store_true", help="no prefix cache: every prompt is computed in full (SGLang's flag; "
                                             "vLLM's --no-enable-prefix-caching)")
    p.add_argument("--disable-mixed-steps", action="store_true",
                   help="run prompt chunks as steps of their own, alternating with decode steps (by default plain "
                        "decoding runs them inside decode steps, the decode rows and chunks sharing "
                        "--chunked-prefill-size tokens a step: vLLM's --max-num-batched-tokens)")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="resolve each step before planning the next (overlap scheduling is on by default)")
    p.add_argument("--scheduler-delay-factor", type=float, default=0.0,
                   help="prefill batching (vLLM's option): while requests decode, hold arrivals until their waits "
                        "add up to the stall a prefill would cost the decoding requests, at most this many times "
                        "the recent prefill launch time; fewer prefill launches for more TTFT (default 0: admit at "
                        "once)")
    p.add_argument("--tp-size", "--tensor-parallel-size", "-tp", dest="tp_size", type=int, default=1,
                   help="tensor-parallel ranks: this process and N-1 spawned workers (rank r on cuda:r; gloo on "
                        "cpu), or the processes torchrun started (WORLD_SIZE must equal N)")


DTYPE_CHOICES = ("auto", "half", "float16", "bfloat16", "float", "float32")


def _dtype(text: str) -> str:
    """argparse type: a --dtype value (vLLM's names; `half` and `float` resolve in spruce.config.resolve_dtype)."""
    if text not in DTYPE_CHOICES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(DTYPE_CHOICES)}, got {text!r}")
    return text


def _json_object(text: str) -> dict:
    """argparse type: a JSON object, e.g. '{"method": "eagle3", "num_speculative_tokens": 3}'."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


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
                     "speculative_adaptive_widths", "speculative_prompt_lookup_min", "speculative_prompt_lookup_max")


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
    if (args.speculative_algorithm or "").upper() in ("NEXTN", "MTP", "NGRAM"):
        return None  # the target's own MTP layers; NGRAM loads no draft
    if (args.speculative_algorithm or "").upper() == "STANDALONE":
        raise ConfigError("--speculative-algorithm STANDALONE needs --speculative-draft-model-path DRAFT (a small "
                          "causal LM with the target's vocabulary)")
    if args.model is None and builtin_draft_path().exists():
        return str(builtin_draft_path())
    if given:
        raise ConfigError(f"{', '.join(given)} given without a draft model: add --speculative-draft-model-path DRAFT "
                          f"(an EAGLE or EAGLE-3 head for --model), or drop the speculation flags")
    return None


class ArgumentParser(argparse.ArgumentParser):
    """spruce's parsers: exact flag names only (`allow_abbrev=False`: a prefix of a flag is refused, not taken for
    it), `--config FILE.yaml` read where a parser has it, and the engine flags finished after parsing
    (`finish_engine_args`). Subcommand parsers are of this class too (argparse makes them of the parent's)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        if "--config" in self._option_string_actions:
            args = expand_config(args, self._option_string_actions, self.error)
        ns, rest = super().parse_known_args(args, namespace)
        if getattr(ns, "_engine_args", False):
            try:
                finish_engine_args(ns)
            except ValueError as e:
                self.error(str(e))
        return ns, rest


def expand_config(args: list[str], flags: dict, error) -> list[str]:
    """`args` with `--config FILE` (or `--config=FILE`) replaced by the file's flags, put first so that the command
    line's own flags win (argparse keeps a flag's last value), as vLLM does.

    The file is a YAML mapping of flag names (`max-model-len` or `max_model_len`) to values: `true` gives a switch,
    `false` leaves it off, a list gives its items, a mapping its JSON (`speculative-config`). e.g.
    {'max-model-len': 4096, 'enforce-eager': True} -> ['--max-model-len', '4096', '--enforce-eager']."""
    out, from_file, i = [], [], 0
    while i < len(args):
        a = args[i]
        if a == "--config" or a.startswith("--config="):
            path = a.partition("=")[2] if "=" in a else (args[i + 1] if i + 1 < len(args) else None)
            if path is None:
                error("argument --config: expected one argument")
            from_file += config_file_args(path, flags, error)
            i += 1 if "=" in a else 2
            continue
        out.append(a)
        i += 1
    return from_file + out


def config_file_args(path: str, flags: dict, error) -> list[str]:
    """The flags a --config YAML file stands for (see expand_config); an unknown key is an error naming it."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        error(f"--config {path}: cannot read it as YAML: {e}")
    if data is None:
        return []
    if not isinstance(data, dict):
        error(f"--config {path}: expected a mapping of flag names to values, got {type(data).__name__}")
    out = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if flag not in flags or flag == "--config":
            error(f"--config {path}: unknown key {key!r} (not a flag of this command)")
        if isinstance(value, bool):
            out += [flag] if value else []
        elif isinstance(value, list):
            out += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        elif value is not None:
            out += [flag, str(value)]
    return out


# vLLM's --speculative-config: method names, and the engine flag each key sets
SPEC_CONFIG_METHODS = {"eagle": "EAGLE", "eagle3": "EAGLE3", "mtp": "NEXTN", "deepseek_mtp": "NEXTN",
                       "nextn": "NEXTN", "draft_model": "STANDALONE", "ngram": "NGRAM"}
SPEC_CONFIG_FLAGS = {"method": "speculative_algorithm", "model": "speculative_draft_model_path",
                     "num_speculative_tokens": "speculative_num_steps", "eagle_topk": "speculative_eagle_topk",
                     "num_draft_tokens": "speculative_num_draft_tokens",
                     "synthetic_acceptance_length": "speculative_synthetic_acceptance_length",
                     "synthetic_acceptance_rates": "speculative_synthetic_acceptance_rates",
                     "prompt_lookup_min": "speculative_prompt_lookup_min",
                     "prompt_lookup_max": "speculative_prompt_lookup_max"}
SPEC_CONFIG_KEYS = (*SPEC_CONFIG_FLAGS, "draft_tensor_parallel_size", "rejection_sample_method")


def speculative_config_flags(cfg: dict) -> dict:
    """The engine flags (argparse dests) vLLM's --speculative-config JSON stands for. ValueError names a key or value
    spruce does not take.

    e.g. {"method": "eagle3", "model": "D", "num_speculative_tokens": 3} -> speculative_algorithm="EAGLE3",
    speculative_draft_model_path="D", speculative_num_steps=3, speculative_eagle_topk=1 (vLLM drafts a chain of
    num_speculative_tokens unless eagle_topk / num_draft_tokens, spruce's own keys, make a tree)."""
    unknown = [k for k in cfg if k not in SPEC_CONFIG_KEYS]
    if unknown:
        raise ValueError(f"--speculative-config: unknown key {unknown[0]!r}; spruce takes "
                         f"{', '.join(SPEC_CONFIG_KEYS)}")
    out = {SPEC_CONFIG_FLAGS[k]: v for k, v in cfg.items() if k in SPEC_CONFIG_FLAGS}
    method = cfg.get("method")
    if method is not None:
        if not isinstance(method, str) or method.lower() not in SPEC_CONFIG_METHODS:
            raise ValueError(f"--speculative-config: method {method!r} is not supported; expected one of "
                             f"{', '.join(SPEC_CONFIG_METHODS)}")
        out["speculative_algorithm"] = SPEC_CONFIG_METHODS[method.lower()]
    draft_tp = cfg.get("draft_tensor_parallel_size", 1)
    if draft_tp != 1:
        raise ValueError(f"--speculative-config: draft_tensor_parallel_size={draft_tp!r} is not supported: spruce "
                         f"runs the draft whole on every tensor-parallel rank (1)")
    sample = cfg.get("rejection_sample_method", "standard")
    synthetic = [k for k in ("synthetic_acceptance_length", "synthetic_acceptance_rates") if k in cfg]
    if sample not in ("standard", "synthetic"):
        raise ValueError(f"--speculative-config: rejection_sample_method={sample!r} is not supported; expected "
                         f"'standard' (drafts verified) or 'synthetic' (a benchmark setting)")
    if (sample == "synthetic") != bool(synthetic):
        raise ValueError("--speculative-config: rejection_sample_method 'synthetic' goes with "
                         "synthetic_acceptance_length or synthetic_acceptance_rates, and they with it")
    rates = out.get("speculative_synthetic_acceptance_rates")
    if isinstance(rates, list):
        out["speculative_synthetic_acceptance_rates"] = tuple(rates)
    if "num_speculative_tokens" in cfg and "eagle_topk" not in cfg and "num_draft_tokens" not in cfg:
        out["speculative_eagle_topk"] = 1
    return out


def finish_engine_args(ns: argparse.Namespace) -> None:
    """After parsing: the positional model into `model`, and --speculative-config into the speculative flags.
    ValueError when they contradict a flag given beside them."""
    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            raise ValueError(f"the model is given twice: {ns.model_tag!r} and --model {ns.model!r}; give one")
        ns.model = ns.model_tag
    if ns.speculative_config is None:
        return
    for dest, value in speculative_config_flags(ns.speculative_config).items():
        given = getattr(ns, dest)
        if given is not None and given != value and not (dest == "speculative_eagle_topk"
                                                         and "eagle_topk" not in ns.speculative_config):
            raise ValueError(f"--speculative-config sets {_flag(dest)} to {value!r}, but {_flag(dest)} {given!r} "
                             f"is given too; give one")
        if given is None:
            setattr(ns, dest, value)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """LLM(...) keyword arguments from parsed engine flags (the device, `auto` dtype and running requests left to
    LLM's defaults when not given: spruce.config.resolve_device / resolve_dtype / resolve_max_running_requests)."""
    draft = draft_path(args)
    # speculation is on with a draft path, or with NEXTN alone (the target's own MTP layers), or NGRAM (no draft)
    spec = draft is not None or (not args.disable_speculative
                                 and (args.speculative_algorithm or "").upper() in ("NEXTN", "MTP", "NGRAM"))
    return dict(
        model=args.model, tokenizer=args.tokenizer_path, device=args.device, dtype=args.dtype,
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
        speculative_prompt_lookup_min=args.speculative_prompt_lookup_min if spec else None,
        speculative_prompt_lookup_max=args.speculative_prompt_lookup_max if spec else None,
        load_format=args.load_format, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        seed=args.random_seed, show_progress=True, disable_overlap_schedule=args.disable_overlap_schedule,
        disable_radix_cache=args.disable_radix_cache, tp_size=args.tp_size, mixed_steps=not args.disable_mixed_steps,
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
