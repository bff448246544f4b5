"""Served spruce against a peer engine (vLLM) on one GPU in one run: same shape, same random prompts, vLLM's own
client, one JSON.

    python -m spruce.bench.peer --shape llama-3.1-8b --mode plain --input-len 512 --output-len 256 \\
        --concurrency 1,4,16,64,128 --out $OUT/peer-8b-plain.json

In turn (vLLM first: it compiles its model at start-up), each engine serves the shape with dummy weights
(`--load-format dummy` on both: config.json alone, nothing uploaded or written but configs and a word-level tokenizer
of the target's vocabulary, bench/shapes.py), `vllm bench serve` (random dataset, the given input / output lengths,
`--ignore-eos`, greedy) runs against it at every concurrency, and the server is stopped. A second spruce server with
the same flags (`spruce-control`) measures the spread of two identical copies. The client is vLLM's when vLLM imports
(its bundle: ../shared/peers/vllm_env.sh), else spruce's own (peer_client.py: the same random prompts as token ids,
the same figures); spruce's servers run without the bundle on their path.

Modes: `plain`; `eagle3`: an EAGLE-3-shaped dummy head, a chain of --steps drafts on both engines, both with
synthetic acceptance at mean length --synthetic-length (vLLM: `rejection_sample_method: "synthetic"`; spruce:
`--speculative-synthetic-acceptance-length`, speculative/synthetic.py), plus spruce trees (--trees S,K,N ...) at the
same acceptance rates, each a server of its own (`spruce-tree-S-K-N`); `ngram`: n-gram (prompt-lookup) drafts on
both engines (vLLM's `{"method": "ngram"}`, spruce's NGRAM, the same --prompt-lookup-min / -max), a chain of
--steps, with the same synthetic acceptance (accepted where a match proposed drafts: where none did, a round
commits one token on either engine), and spruce tries (--trees) beside it. Random prompts rarely repeat: the
matches come from each engine's own outputs, so compare tok/s beside each engine's `tokens_per_step` (output tokens
per forward step of a request, counted alike on both; vLLM's mean acceptance length counts only rounds that
proposed drafts, spruce's every round).

Engines: `vllm`, `spruce` (the chain, or --spruce-tree S,K,N), `spruce-control` (a copy of `spruce`), `spruce-plain`
(the same shape without a draft), `spruce-adaptive` (`spruce`'s flags plus --speculative-adaptive). --synthetic-length
takes several lengths (1.5,4.5): an engine whose server depends on the length runs once per length (named
`ENGINE@L`), the others once. The adaptive A/B, spruce only, in one run:

    python -m spruce.bench.peer --mode eagle3 --engines spruce-plain,spruce,spruce-adaptive,spruce-control \
        --synthetic-length 1.5,4.5 --control-lengths 4.5 --input-len 256 --output-len 128 --concurrency 1,16,64 \
        --out $OUT/adaptive-ab.json

and its JSON's `adaptive_bar`, per length and concurrency: adaptive's tok/s over the better of plain and fixed.

The JSON has, per engine and concurrency, output tok/s, TPOT and TTFT (p50 and mean), the exact server commands and
client arguments, each engine's mean acceptance length as its server counted it, the ratios (each spruce server over
vLLM, the control over spruce, each tree over the chain), and the HBM roofline of a plain decode step at each
concurrency: the bytes it reads (the weights it touches plus the KV cache at the batch's mean context, spruce's own
`weight_bytes_read` and KV pool sizes) over the nominal bandwidth (4.8 TB/s, H200) and over the device-to-device copy
bandwidth measured at the start of the same run. The JSON is rewritten after every engine, so a run cut short keeps
what it measured; --deadline-s skips engines that would not finish in time.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

NOMINAL_HBM_BYTES_PER_S = 4.8e12  # H200's HBM3e
SERVED_NAME = "peer-model"
MODES = ("plain", "eagle3", "ngram")
SPECULATIVE_MODES = ("eagle3", "ngram")  # the modes whose servers draft (and take --synthetic-length)
SERVER_START_TIMEOUT_S = 420  # vLLM compiles its model and captures graphs at start-up
SPRUCE_START_TIMEOUT_S = 240  # a spruce server with dummy weights starts in about a minute
START_ESTIMATE_S = {"vllm": 150.0, "spruce": 60.0}  # a server's start and stop (run_estimate's guess)
STEP_OVER_ROOFLINE = 2.0  # run_estimate's guess of a decode step's time over its roofline time
ENGINES = ("vllm", "spruce", "spruce-control", "spruce-plain", "spruce-adaptive")
BAR = 0.95  # adaptive's bar: at least this fraction of the better of plain and fixed speculation's tok/s
CLIENT_FIELDS = {  # this JSON's name: the names `vllm bench serve --save-result` writes it under, first found
    "output_tok_s": ("output_throughput",),
    "tpot_p50_ms": ("median_tpot_ms", "p50_tpot_ms"),
    "tpot_mean_ms": ("mean_tpot_ms",),
    "ttft_p50_ms": ("median_ttft_ms", "p50_ttft_ms"),
    "ttft_mean_ms": ("mean_ttft_ms",),
    "itl_p50_ms": ("median_itl_ms", "p50_itl_ms"),
    "completed": ("completed",),
    "total_output_tokens": ("total_output_tokens",),
    "duration_s": ("duration",),
}
RATIO_FIELDS = ("output_tok_s", "tpot_p50_ms", "ttft_p50_ms", "tpot_mean_ms", "ttft_mean_ms")


# --- arguments ---------------------------------------------------------------------------------------------------
def positive_ints(text: str) -> tuple[int, ...]:
    """argparse type: '1,4,16' -> (1, 4, 16), each >= 1."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,4,16, got {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def lengths(text: str) -> tuple[float, ...]:
    """argparse type: '1.5,4.5' -> (1.5, 4.5), distinct."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers such as 1.5,4.5, got {text!r}")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct lengths, got {text!r}")
    return values


def tree_spec(text: str) -> tuple[int, int, int]:
    """argparse type: 'S,K,N' (steps, top-k, verify tokens), e.g. '5,4,8'."""
    values = positive_ints(text)
    if len(values) != 3:
        raise argparse.ArgumentTypeError(f"expected S,K,N (steps, topk, draft tokens), got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m spruce.bench.peer", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    from spruce.bench.shapes import TARGET_SHAPES

    p.add_argument("--shape", choices=sorted(TARGET_SHAPES), default="llama-3.1-8b",
                   help="the model shape (config-only directories written under --root)")
    p.add_argument("--root", type=Path, default=Path("/tmp/peer-shapes"), help="where the shape directories go")
    p.add_argument("--mode", choices=MODES, default="plain")
    p.add_argument("--steps", type=int, default=5, help="eagle3, ngram: drafts per round, a chain (vLLM's "
                   "num_speculative_tokens)")
    p.add_argument("--prompt-lookup-min", type=int, default=2, help="ngram: the shortest n-gram matched")
    p.add_argument("--prompt-lookup-max", type=int, default=4, help="ngram: the longest n-gram matched")
    p.add_argument("--synthetic-length", type=lengths, default=(3.0,), metavar="L[,L...]",
                   help="eagle3, ngram: mean acceptance lengths the engines accept drafts at (tokens a round "
                        "commits); each engine that drafts runs once per length")
    p.add_argument("--trees", type=tree_spec, nargs="*", default=[], metavar="S,K,N",
                   help="eagle3, ngram: spruce trees (ngram: tries) to serve too, at the same acceptance rates "
                        "(e.g. 5,4,6 5,8,8)")
    p.add_argument("--spruce-tree", type=tree_spec, default=None, metavar="S,K,N",
                   help="eagle3, ngram: the (S,K,N) that spruce, spruce-control and spruce-adaptive serve "
                        "(default: the chain of --steps drafts, as vLLM)")
    p.add_argument("--engines", default="vllm,spruce,spruce-control",
                   help=f"servers in order, of {', '.join(ENGINES)} (default: the first three; trees follow)")
    p.add_argument("--control-lengths", type=lengths, default=None, metavar="L[,L...]",
                   help="eagle3, ngram: the synthetic lengths spruce-control runs at (default: every "
                        "--synthetic-length)")
    p.add_argument("--client", choices=("auto", "vllm", "spruce"), default="auto",
                   help="the load generator: vLLM's `bench serve` or spruce's own (auto: vLLM's when it imports)")
    p.add_argument("--target-dir", type=Path, default=None,
                   help="serve this model directory (dummy weights) instead of writing --shape's")
    p.add_argument("--draft-dir", type=Path, default=None, help="with --target-dir: its EAGLE-3 head's directory")
    p.add_argument("--device", default="cuda", help="spruce servers' device (cpu: a smoke run on a small model)")
    p.add_argument("--dtype", default="bfloat16", help="both engines' dtype")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--concurrency", type=positive_ints, default=(1, 4, 16, 64, 128))
    p.add_argument("--prompts-per-level", type=int, default=2,
                   help="requests per level: this many times its concurrency (at least --min-prompts)")
    p.add_argument("--min-prompts", type=int, default=6)
    p.add_argument("--temperature", type=float, default=0.0, help="the client's sampling temperature (0: greedy)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs, both engines")
    p.add_argument("--mem-fraction", type=float, default=0.85,
                   help="spruce --mem-fraction-static and vLLM --gpu-memory-utilization")
    p.add_argument("--quantization", choices=("fp8",), default=None,
                   help="both engines quantize the dummy weights to FP8 at load (vLLM's flag: per-channel weights, "
                        "per-token activations); the roofline counts the FP8 weights")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8_e4m3"), default="auto",
                   help="both engines' KV cache dtype; the roofline counts its bytes")
    p.add_argument("--spruce-flags", default="", help="more `spruce serve` flags (shell words), every spruce server")
    p.add_argument("--vllm-flags", default="", help="more `vllm serve` flags (shell words)")
    p.add_argument("--nominal-hbm-tbs", type=float, default=NOMINAL_HBM_BYTES_PER_S / 1e12,
                   help="the roofline's nominal bandwidth, TB/s (default: the H200's)")
    p.add_argument("--port", type=int, default=8310, help="the servers' port (one server at a time)")
    p.add_argument("--deadline-s", type=float, default=480.0,
                   help="skip an engine that would not finish within this many seconds of the start")
    p.add_argument("--out", type=Path, required=True, help="the result JSON")
    p.add_argument("--log-dir", type=Path, default=None, help="server logs and the client's raw results "
                   "(default: beside --out)")


def check_args(args: argparse.Namespace) -> None:
    """SystemExit naming the value for settings that cannot run."""
    bad = [e for e in args.engines.split(",") if e not in ENGINES]
    if bad or not engine_names(args):
        raise SystemExit(f"--engines {args.engines!r}: each must be one of {', '.join(ENGINES)}")
    if args.mode not in SPECULATIVE_MODES:
        for flag, value in (("--trees", args.trees), ("--spruce-tree", args.spruce_tree),
                            ("--control-lengths", args.control_lengths)):
            if value:
                raise SystemExit(f"{flag} {value} needs --mode eagle3 or ngram (it is speculative)")
    if args.mode != "eagle3":
        if args.draft_dir is not None:
            raise SystemExit(f"--draft-dir {args.draft_dir} needs --mode eagle3 (an EAGLE-3 head)")
        if "spruce-adaptive" in engine_names(args):
            raise SystemExit("--engines spruce-adaptive needs --mode eagle3 (adaptive speculation drafts with a "
                             "head)")
    if args.mode == "ngram" and not 1 <= args.prompt_lookup_min <= args.prompt_lookup_max:
        raise SystemExit(f"--prompt-lookup-min {args.prompt_lookup_min} / --prompt-lookup-max "
                         f"{args.prompt_lookup_max}: need 1 <= min <= max")
    if args.mode in SPECULATIVE_MODES:
        for length in args.synthetic_length:
            if not 1.0 <= length <= args.steps + 1:
                raise SystemExit(f"--synthetic-length {length:g} must be in [1, steps + 1 = {args.steps + 1}]")
        for s, k, n in [*args.trees, *([args.spruce_tree] if args.spruce_tree else [])]:
            for length in args.synthetic_length:
                if not 1.0 <= length <= s + 1:
                    raise SystemExit(f"tree {s},{k},{n}: --synthetic-length {length:g} must be in [1, {s + 1}]")
        extra = set(args.control_lengths or ()) - set(args.synthetic_length)
        if extra:
            raise SystemExit(f"--control-lengths {sorted(extra)} are not among --synthetic-length "
                             f"{list(args.synthetic_length)}")
    if args.mode == "eagle3" and (args.target_dir is None) != (args.draft_dir is None):
        raise SystemExit("--target-dir and --draft-dir go together in --mode eagle3 (the target and its head)")
    for flags_name, flags in (("--spruce-flags", args.spruce_flags), ("--vllm-flags", args.vllm_flags)):
        for word in shlex.split(flags):
            given = word.split("=", 1)[0]
            if given in ("--quantization", "--kv-cache-dtype"):
                raise SystemExit(f"{flags_name} {flags!r}: give {given} to `spruce bench peer` itself (both engines "
                                 "get it and the roofline counts its bytes)")
    if args.input_len < 1 or args.output_len < 2 or args.prompts_per_level < 1 or args.min_prompts < 1:
        raise SystemExit("--input-len, --prompts-per-level and --min-prompts must be >= 1, --output-len >= 2")


def engine_names(args: argparse.Namespace) -> list[str]:
    """The engines in the order they run: --engines, then one per tree."""
    names = [e for e in args.engines.split(",") if e]
    return names + [tree_name(t) for t in args.trees]


@dataclass(frozen=True)
class Run:
    """One server of the run: an engine at a synthetic acceptance length (None: its server does not depend on
    one), under `name` in the JSON."""

    engine: str
    length: float | None
    name: str


def drafts(engine: str, args: argparse.Namespace) -> bool:
    """Whether `engine`'s server speculates (so depends on the synthetic length)."""
    return args.mode in SPECULATIVE_MODES and engine != "spruce-plain"


def engine_runs(args: argparse.Namespace) -> list[Run]:
    """Every server in the order they run: each engine in turn, at each synthetic length if it drafts (the control
    at --control-lengths only), else once. Names carry '@L' when there are several lengths.

    e.g. --mode eagle3 --engines spruce-plain,spruce --synthetic-length 1.5,4.5: spruce-plain, spruce@1.5,
    spruce@4.5.
    """
    several = len(args.synthetic_length) > 1
    runs = []
    for engine in engine_names(args):
        if not drafts(engine, args):
            runs.append(Run(engine, None, engine))
            continue
        at = (args.control_lengths or args.synthetic_length) if engine == "spruce-control" else args.synthetic_length
        runs += [Run(engine, length, f"{engine}@{length:g}" if several else engine) for length in at]
    return runs


def tree_name(tree: tuple[int, int, int]) -> str:
    return "spruce-tree-{}-{}-{}".format(*tree)


# --- commands ----------------------------------------------------------------------------------------------------
@dataclass
class Shape:
    """The directories a run serves: the target (with its tokenizer) and the EAGLE-3 head."""

    target: Path
    draft: Path


def context_length(args: argparse.Namespace) -> int:
    """Both engines' context: twice the prompt + output + a round's drafts, rounded up to 64. The client sends
    random token ids as text, which the server encodes again, sometimes into more tokens than were drawn: at
    prompt + output + 64 a server refuses some of them (400), and the two engines no longer run the same load."""
    need = 2 * args.input_len + args.output_len + args.steps + 2
    return -(-need // 64) * 64


def server_command(name: str, args: argparse.Namespace, shape: Shape, port: int,
                   length: float | None = None) -> list[str]:
    """The argv that serves engine `name` (one of ENGINES or 'spruce-tree-S-K-N') at synthetic acceptance length
    `length` (default: the first --synthetic-length)."""
    max_bs, ctx = max(args.concurrency), context_length(args)
    length = args.synthetic_length[0] if length is None else length
    if name == "vllm":
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(shape.target),
               "--served-model-name", SERVED_NAME, "--port", str(port), "--load-format", "dummy",
               "--dtype", args.dtype, "--max-num-seqs", str(max_bs), "--max-model-len", str(ctx), "--seed", "0",
               "--gpu-memory-utilization", str(args.mem_fraction), "--tensor-parallel-size", str(args.tp)]
        if args.mode in SPECULATIVE_MODES:
            spec = ({"method": "eagle3", "model": str(shape.draft)} if args.mode == "eagle3" else
                    {"method": "ngram", "prompt_lookup_min": args.prompt_lookup_min,
                     "prompt_lookup_max": args.prompt_lookup_max})
            spec |= {"num_speculative_tokens": args.steps, "rejection_sample_method": "synthetic",
                     "synthetic_acceptance_length": length}
            cmd += ["--speculative-config", json.dumps(spec)]
        return cmd + precision_flags(args) + shlex.split(args.vllm_flags)
    cmd = [sys.executable, "-m", "spruce.cli", "serve", "--model", str(shape.target),
           "--served-model-name", SERVED_NAME, "--port", str(port), "--load-format", "dummy", "--device", args.device,
           "--dtype", args.dtype, "--max-running-requests", str(max_bs), "--cuda-graph-max-bs", str(max_bs),
           "--context-length", str(ctx), "--mem-fraction-static", str(args.mem_fraction), "--random-seed", "0",
           "--tp-size", str(args.tp)]
    if drafts(name, args):
        s, k, n = spruce_tree(name, args)
        cmd += (["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(shape.draft)]
                if args.mode == "eagle3" else
                ["--speculative-algorithm", "NGRAM", "--speculative-prompt-lookup-min", str(args.prompt_lookup_min),
                 "--speculative-prompt-lookup-max", str(args.prompt_lookup_max)])
        cmd += ["--speculative-num-steps", str(s), "--speculative-eagle-topk", str(k),
                "--speculative-num-draft-tokens", str(n), "--speculative-synthetic-acceptance-length", str(length)]
        if name == "spruce-adaptive":
            cmd.append("--speculative-adaptive")
    return cmd + precision_flags(args) + shlex.split(args.spruce_flags)


def precision_flags(args: argparse.Namespace) -> list[str]:
    """--quantization / --kv-cache-dtype as both engines spell them (the same names and values)."""
    flags = ["--quantization", args.quantization] if args.quantization else []
    return flags + (["--kv-cache-dtype", args.kv_cache_dtype] if args.kv_cache_dtype != "auto" else [])


def spruce_tree(name: str, args: argparse.Namespace) -> tuple[int, int, int]:
    """The (S, K, N) spruce engine `name` serves: a tree engine's own, else --spruce-tree or the chain of --steps."""
    if name.startswith("spruce-tree-"):
        return tuple(int(v) for v in name.removeprefix("spruce-tree-").split("-"))
    return args.spruce_tree or (args.steps, 1, args.steps + 1)


def num_prompts(args: argparse.Namespace, concurrency: int) -> int:
    return max(args.min_prompts, args.prompts_per_level * concurrency)


def client_argv(args: argparse.Namespace, shape: Shape, engine: str, concurrency: int, port: int,
                result_dir: Path, prompts: int | None = None, output_len: int | None = None) -> list[str]:
    """`vllm bench serve` arguments for one level (after `bench serve`)."""
    return ["--backend", "openai", "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
            "--model", SERVED_NAME, "--tokenizer", str(shape.target), "--dataset-name", "random",
            "--random-input-len", str(args.input_len), "--random-output-len", str(output_len or args.output_len),
            "--num-prompts", str(prompts or num_prompts(args, concurrency)), "--max-concurrency", str(concurrency),
            "--ignore-eos", "--seed", "0", "--temperature", str(args.temperature),
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
            "--request-id-prefix", f"{engine}-c{concurrency}-{prompts or 0}-", "--disable-tqdm",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", level_file(engine, concurrency,
                                                                                               prompts)]


def level_file(engine: str, concurrency: int, prompts: int | None = None) -> str:
    return f"{engine}-c{concurrency}{'-warmup' if prompts else ''}.json"


# --- results -----------------------------------------------------------------------------------------------------
def level_result(saved: dict) -> dict:
    """This JSON's figures of one level from what `vllm bench serve --save-result` wrote (None where absent)."""
    out = {}
    for name, keys in CLIENT_FIELDS.items():
        out[name] = next((saved[k] for k in keys if saved.get(k) is not None), None)
    return out


def ratio(a, b) -> float | None:
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def measured_run(engines: dict, engine: str, length: float | None) -> str | None:
    """The name of engine `engine`'s run at `length` (or its one run, if it does not depend on the length) that
    measured levels, else None."""
    for name, e in engines.items():
        if e.get("engine", name) == engine and e.get("levels") and e.get("synthetic_length") in (length, None):
            return name
    return None


def ratios(engines: dict, concurrency: tuple[int, ...]) -> dict:
    """Per pair of runs at the same synthetic length (each spruce server over vllm, the control and each tree over
    spruce): per concurrency, RATIO_FIELDS' ratios (output tok/s above 1: the numerator faster; latencies below 1:
    it is quicker). Keys 'A/B' with the runs' names."""
    pairs = []
    for a, e in engines.items():
        if not e.get("levels"):
            continue
        engine, length = e.get("engine", a), e.get("synthetic_length")
        if engine.startswith("spruce") and (b := measured_run(engines, "vllm", length)):
            pairs.append((a, b))
        if (engine == "spruce-control" or engine.startswith("spruce-tree-")) and \
                (b := measured_run(engines, "spruce", length)):
            pairs.append((a, b))
    out = {}
    for a, b in pairs:
        la, lb = engines[a]["levels"], engines[b]["levels"]
        out[f"{a}/{b}"] = {str(c): {f: ratio(la[str(c)].get(f), lb[str(c)].get(f)) for f in RATIO_FIELDS}
                           for c in concurrency if str(c) in la and str(c) in lb}
    return out


def tok_s(engines: dict, name: str | None, c: int) -> float | None:
    """Output tok/s of run `name` at concurrency `c` (None: not measured)."""
    return engines[name]["levels"].get(str(c), {}).get("output_tok_s") if name else None


def adaptive_bar(engines: dict, lengths: tuple[float, ...], concurrency: tuple[int, ...]) -> dict:
    """Per synthetic length and concurrency: the output tok/s of spruce-adaptive, spruce-plain, spruce (fixed
    speculation) and spruce-control, and adaptive over the better of plain and fixed (`ratio`; `pass`: >= BAR).
    E.g. plain 900, fixed 1200, adaptive 1180 tok/s: ratio 1180 / 1200 = 0.983, pass. `pass` at the top: every
    point measured and passed (None: no point measured)."""
    points = {}
    for length in lengths:
        runs = {role: measured_run(engines, engine, length) for role, engine in
                (("adaptive", "spruce-adaptive"), ("plain", "spruce-plain"), ("fixed", "spruce"),
                 ("control", "spruce-control"))}
        if not runs["adaptive"]:
            continue
        per_c = {}
        for c in concurrency:
            point = {role: tok_s(engines, name, c) for role, name in runs.items()}
            others = [point[r] for r in ("plain", "fixed") if point[r] is not None]
            best = max(others) if others else None
            point["ratio"] = ratio(point["adaptive"], best)
            point["pass"] = None if point["ratio"] is None else point["ratio"] >= BAR
            point["control_over_fixed"] = ratio(point["control"], point["fixed"])
            per_c[str(c)] = point
        points[f"{length:g}"] = per_c
    verdicts = [p["pass"] for per_c in points.values() for p in per_c.values()]
    return {"bar": BAR, "points": points,
            "pass": None if not verdicts else all(v is True for v in verdicts),
            "how": "output tok/s of spruce-adaptive over max(spruce-plain, spruce) at the same length and "
                   "concurrency; control_over_fixed: two identical servers' spread"}


def roofline(concurrency: tuple[int, ...], context: int, weight_bytes, kv_bytes_per_token: int, tp: int,
             nominal: float, measured: float | None) -> dict:
    """Per concurrency c: the bytes a plain decode step of c requests at `context` cached tokens each reads
    (weight_bytes(c) + kv_bytes_per_token * c * context, over `tp` GPUs evenly), and that step's time and output
    tokens/s at the `nominal` and `measured` bandwidths (bytes/s)."""
    out = {}
    for c in concurrency:
        weights, kv = weight_bytes(c) / tp, kv_bytes_per_token * c * context / tp
        total = weights + kv
        entry = {"weights_bytes": weights, "kv_bytes": kv, "bytes": total, "context": context,
                 "step_ms_nominal": total / nominal * 1e3, "tok_s_nominal": c * nominal / total}
        if measured:
            entry |= {"step_ms_measured": total / measured * 1e3, "tok_s_measured": c * measured / total}
        out[str(c)] = entry
    return out


def roofline_fractions(engines: dict, roof: dict) -> None:
    """Each level's `roofline_fraction`: the plain decode step's roofline time (measured bandwidth, else nominal)
    over the level's TPOT p50 (1.0: at the roofline; speculative rounds commit several tokens a step, so theirs may
    pass 1)."""
    for e in engines.values():
        for c, level in e.get("levels", {}).items():
            r = roof.get(c, {})
            step = r.get("step_ms_measured") or r.get("step_ms_nominal")
            level["roofline_fraction"] = ratio(step, level.get("tpot_p50_ms"))


def model_bytes(target: Path, quantization: str | None = None, kv_cache_dtype: str = "auto"):
    """(weight_bytes(batch), KV bytes per token) of the target, from spruce's model built on the meta device (no
    memory): the weights a forward over `batch` tokens reads (decoder.py) and its KV pool's bytes a token.
    quantization="fp8": the model as load-time quantization leaves it (FP8 decoder linears and experts, their
    scales; embedding and lm_head bf16); kv_cache_dtype="fp8_e4m3": an FP8 pool."""
    import torch

    from spruce.memory.kv_pool import target_pool_bytes_per_token
    from spruce.models.hf_config import ModelConfig
    from spruce.models.loader import _build
    from spruce.models.quantization import quantize_model
    from spruce.models.registry import target_class
    from spruce.ops.fp8 import FP8_DTYPE

    cfg = ModelConfig.from_dir(target)
    model = _build(lambda: target_class(cfg)(cfg, None, ()), torch.bfloat16, torch.device("meta"))
    if quantization == "fp8":
        quantize_model(model)
    kv_dtype = FP8_DTYPE if kv_cache_dtype == "fp8_e4m3" else torch.bfloat16
    return model.weight_bytes_read, target_pool_bytes_per_token(cfg, kv_dtype)


def measure_bandwidth() -> dict:
    """The GPU's name and its device-to-device copy bandwidth (bytes read + written per second, bench/common.py)."""
    import torch

    from spruce.bench.common import measure_copy_bandwidth

    return {"gpu": torch.cuda.get_device_name(0), "copy_bandwidth_bytes_per_s": measure_copy_bandwidth("cuda"),
            "how": "bench.common.measure_copy_bandwidth: a 2 GiB device-to-device copy, bytes read + written"}


# --- processes ---------------------------------------------------------------------------------------------------
def spruce_env() -> dict:
    """This environment without the vLLM bundle on PYTHONPATH (spruce's servers import only their own packages)."""
    env = dict(os.environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and "vllm-site" not in p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def get_json(url: str, timeout: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        body = r.read().decode()
    try:
        return json.loads(body)
    except ValueError:
        return body


class Server:
    """One engine's server process (its own session, so that its children stop with it)."""

    def __init__(self, name: str, command: list[str], port: int, log: Path):
        self.name, self.command, self.port, self.log = name, command, port, log
        env = os.environ.copy() if name == "vllm" else spruce_env()
        self._file = open(log, "w")
        self.proc = subprocess.Popen(command, stdout=self._file, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_up(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                return False
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2).read()
                return True
            except OSError:
                time.sleep(1.0)
        return False

    def facts(self) -> dict:
        """What the server says of itself: /version, spruce's /server_info, the acceptance counters of /metrics and
        adaptive speculation's series (its start-up step costs, choices, probes, catch-ups: all levels together)."""
        base, out = f"http://127.0.0.1:{self.port}", {}
        for path in ("/version", "/server_info"):
            try:
                out[path.strip("/")] = get_json(base + path)
            except OSError:
                pass
        try:
            text = get_json(base + "/metrics")
            out["acceptance"] = acceptance_from_metrics(text)
            if isinstance(text, str) and "spruce_adaptive_" in text:
                out["adaptive"] = {name: float(value) for name, _, value in
                                   (line.rpartition(" ") for line in text.splitlines()
                                    if line.startswith("spruce_adaptive_"))}
        except OSError:
            pass
        return out

    def stop(self, grace_s: float = 40.0) -> None:
        """SIGTERM to the server's process group, then wait until none of its processes is left (their GPU memory
        freed before the next server starts); SIGKILL to what is left after `grace_s`."""
        self._signal(signal.SIGTERM)
        end = time.monotonic() + grace_s
        while self._group_alive() and time.monotonic() < end:
            time.sleep(0.5)
        if self._group_alive():
            self._signal(signal.SIGKILL)
            while self._group_alive() and time.monotonic() < end + 20:
                time.sleep(0.5)
        self._file.close()

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def _group_alive(self) -> bool:
        self.proc.poll()  # reaps the leader once it exits
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except ProcessLookupError:
            return False

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def acceptance_from_metrics(text) -> dict:
    """Acceptance from a server's Prometheus text. `mean_accept_length`: tokens a drafting round commits, vLLM's
    spec-decode counters (1 + accepted / drafts; vLLM counts only rounds that proposed drafts, spruce every verify
    round) or spruce's gauge. `tokens_per_step`: output tokens per forward step of a request, the same count on
    both engines whatever a round without drafts is called: each step commits 1 + its accepted drafts, so a
    request's steps are its generated tokens less the accepted ones (generation_tokens / (generation_tokens -
    accepted)); e.g. 1000 tokens of which 600 accepted drafts took 400 steps: 2.5 tokens per step."""
    if not isinstance(text, str):
        return {}
    values = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, _, value = line.rpartition(" ")
        base = name.split("{")[0]
        try:
            values[base] = values.get(base, 0.0) + float(value)
        except ValueError:
            continue

    def counter(name):
        return values.get(f"{name}_total", values.get(name))

    drafts, accepted = counter("vllm:spec_decode_num_drafts"), counter("vllm:spec_decode_num_accepted_tokens")
    generated = counter("vllm:generation_tokens")
    out = {}
    if drafts:
        out = {"mean_accept_length": 1.0 + (accepted or 0.0) / drafts, "drafts": drafts, "accepted": accepted}
    elif "spruce_spec_mean_accept_length" in values:
        out = {"mean_accept_length": values["spruce_spec_mean_accept_length"]}
    if out and generated and generated > (accepted or 0.0):
        out |= {"generation_tokens": generated, "tokens_per_step": generated / (generated - (accepted or 0.0))}
    return out


def run_client(argv_per_level: list[list[str]], log: Path, client: str = "auto") -> int:
    """Run the levels' `vllm bench serve` argvs with `client` (spruce.bench.peer_client, one process for every
    level: vLLM's benchmark or spruce's own client); its output goes to `log`. Returns its exit status."""
    spec = log.with_suffix(".levels.json")
    spec.write_text(json.dumps(argv_per_level))
    with open(log, "a") as f:
        return subprocess.run([sys.executable, "-m", "spruce.bench.peer_client", str(spec), "--client", client],
                              stdout=f, stderr=subprocess.STDOUT).returncode


# --- the run -----------------------------------------------------------------------------------------------------
@dataclass
class Hooks:
    """What a run does outside this process (replaced by fakes in tests)."""

    start_server: Callable = Server  # (name, command, port, log) -> a Server
    run_client: Callable = run_client  # (argv per level, log) -> exit status
    bandwidth: Callable | None = None  # () -> measure_bandwidth's dict (measured in a process of its own)
    clock: Callable = time.monotonic
    model_bytes: Callable = model_bytes  # (target dir) -> (weight_bytes(batch), KV bytes a token)


def bandwidth_in_subprocess() -> dict:
    """measure_bandwidth in a process of its own (its CUDA context gone before the servers start)."""
    code = "import json; from spruce.bench.peer import measure_bandwidth as m; print(json.dumps(m()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=spruce_env(), timeout=120)
    if out.returncode != 0:
        return {"error": out.stderr[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_shapes(args: argparse.Namespace) -> Shape:
    """--target-dir / --draft-dir when given, else --shape's config-only directories written under --root."""
    if args.target_dir is not None:
        return Shape(args.target_dir, args.draft_dir or args.target_dir)
    from spruce.bench.shapes import write_shape_dirs

    target, draft = write_shape_dirs(args.shape, args.root, tokenizer=True)
    return Shape(target, draft)


def server_kind(engine: str) -> str:
    """"vllm" or "spruce" (every spruce engine: plain, control, adaptive, trees): the keys of START_ESTIMATE_S."""
    return "vllm" if engine == "vllm" else "spruce"


def run_estimate(args: argparse.Namespace, runs: list[Run], roof: dict) -> dict:
    """A guess of the run's seconds: per server its start and stop (START_ESTIMATE_S) and its levels (a warm-up,
    then at each concurrency c, ceil(prompts / c) waves of --output-len decode steps, a step STEP_OVER_ROOFLINE
    times its roofline time; speculation counted as plain). E.g. the 8B shape, output 128, concurrency 1/16/64 with
    6/32/128 prompts: ~12 s of levels a server, ~72 s with its start."""
    def levels_s() -> float:
        waves = [(-(-num_prompts(args, c) // c), c) for c in args.concurrency]
        warm = min(max(args.concurrency), 16)
        steps = sum(w * args.output_len * roof[str(c)]["step_ms_nominal"] for w, c in waves)
        steps += 16 * roof[str(warm)]["step_ms_nominal"] if str(warm) in roof else 0.0
        return steps * STEP_OVER_ROOFLINE / 1e3

    per_level = levels_s() if all(str(c) in roof for c in args.concurrency) else 0.0
    servers = {r.name: START_ESTIMATE_S[server_kind(r.engine)] + per_level for r in runs}
    return {"servers": len(runs), "seconds": round(sum(servers.values())),
            "server_s": {kind: round(start + per_level) for kind, start in START_ESTIMATE_S.items()},
            "how": "per server: its start and stop ("
                   + ", ".join(f"{kind} {start:g} s" for kind, start in START_ESTIMATE_S.items())
                   + f") + its levels (waves x output tokens x {STEP_OVER_ROOFLINE:g} x the roofline step)"}


def run(args: argparse.Namespace, hooks: Hooks | None = None, shape: Shape | None = None) -> dict:
    """Serve and measure every engine in turn; returns the result (also written to args.out after each engine)."""
    from spruce.bench.common import git_commit
    from spruce.config import rates_for_length

    hooks = hooks or Hooks(bandwidth=bandwidth_in_subprocess if args.device.startswith("cuda") else None,
                           run_client=functools.partial(run_client, client=args.client))
    t0 = hooks.clock()
    shape = shape or write_shapes(args)
    log_dir = args.log_dir or args.out.parent / (args.out.stem + "-logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    bw = hooks.bandwidth() if hooks.bandwidth else {}
    weight_bytes, kv_per_token = hooks.model_bytes(shape.target, args.quantization, args.kv_cache_dtype)
    nominal = args.nominal_hbm_tbs * 1e12
    ctx = args.input_len + args.output_len // 2  # a request's mean cached context while it decodes
    roof = roofline(args.concurrency, ctx, weight_bytes, kv_per_token, args.tp, nominal,
                    bw.get("copy_bandwidth_bytes_per_s"))
    synthetic = None
    runs = engine_runs(args)
    if args.mode in SPECULATIVE_MODES:
        s = spruce_tree("spruce", args)[0]
        synthetic = {"lengths": list(args.synthetic_length),
                     "chain_rates": {f"{v:g}": list(rates_for_length(v, args.steps)) for v in args.synthetic_length},
                     "spruce_rates": {f"{v:g}": list(rates_for_length(v, s)) for v in args.synthetic_length},
                     "note": "drafts accepted at these rates, not verified: outputs are not the target's"}
        if len(args.synthetic_length) == 1:
            synthetic |= {"length": args.synthetic_length[0],
                          "chain_rates": synthetic["chain_rates"][f"{args.synthetic_length[0]:g}"]}
    estimate = run_estimate(args, runs, roof)
    print(f"[peer] {estimate['servers']} servers: {', '.join(r.name for r in runs)}; estimate ~{estimate['seconds']} s "
          f"(--deadline-s {args.deadline_s:g} skips what would not fit)", flush=True)
    result = {
        "benchmark": "peer", "shape": args.shape, "mode": args.mode, "git_commit": git_commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "gpu": bw.get("gpu"), "tp": args.tp,
        "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
        "input_len": args.input_len, "output_len": args.output_len, "concurrency": list(args.concurrency),
        "prompts": {str(c): num_prompts(args, c) for c in args.concurrency}, "temperature": args.temperature,
        "synthetic_acceptance": synthetic, "target_dir": str(shape.target), "draft_dir": str(shape.draft),
        "client": "vllm bench serve (random dataset, --ignore-eos)",
        "hbm": {"nominal_bytes_per_s": nominal, "measured": bw,
                "note": "roofline: a plain decode step's bytes (weights it reads + KV at the mean context "
                        "input_len + output_len/2) over the bandwidth"},
        "roofline": roof, "estimate": estimate, "engines": {}, "ratios": {},
    }
    spent = {"vllm": [], "spruce": []}  # seconds each server of each kind took, for the deadline
    for r in runs:
        kind = server_kind(r.engine)
        guess = max(spent[kind], default=estimate["server_s"][kind])  # vLLM's start is not spruce's
        if hooks.clock() - t0 + guess > args.deadline_s:
            result["engines"][r.name] = {"engine": r.engine, "synthetic_length": r.length,
                                         "skipped": f"deadline: {hooks.clock() - t0:.0f} s spent, an engine takes "
                                                    f"~{guess:.0f} s, --deadline-s {args.deadline_s:g}"}
            continue
        t_engine = hooks.clock()
        result["engines"][r.name] = measure_engine(r, args, shape, hooks, log_dir)
        spent[kind].append(hooks.clock() - t_engine)
        finish(result, args)
    finish(result, args)
    return result


def finish(result: dict, args: argparse.Namespace) -> None:
    """Ratios and roofline fractions from the engines so far; (re)write args.out."""
    roofline_fractions(result["engines"], result["roofline"])
    result["ratios"] = ratios(result["engines"], args.concurrency)
    if "spruce-adaptive" in engine_names(args):
        result["adaptive_bar"] = adaptive_bar(result["engines"], args.synthetic_length, args.concurrency)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


def measure_engine(run: Run, args: argparse.Namespace, shape: Shape, hooks: Hooks, log_dir: Path) -> dict:
    """Start `run`'s server, run the client's levels (after a warm-up) against it, stop it."""
    name = run.name
    command = server_command(run.engine, args, shape, args.port, run.length)
    entry = {"engine": run.engine, "synthetic_length": run.length, "command": command, "levels": {}}
    t = hooks.clock()
    server = hooks.start_server(run.engine, command, args.port, log_dir / f"{name}.server.log")
    try:
        if not server.wait_up(SERVER_START_TIMEOUT_S if run.engine == "vllm" else SPRUCE_START_TIMEOUT_S):
            entry["error"] = f"{name} did not start:\n{server.tail()}"
            return entry
        entry["startup_s"] = round(hooks.clock() - t, 1)
        warm_c = min(max(args.concurrency), 16)
        argvs = [client_argv(args, shape, name, warm_c, args.port, log_dir, prompts=warm_c, output_len=16)]
        argvs += [client_argv(args, shape, name, c, args.port, log_dir) for c in args.concurrency]
        entry["client_argv"] = argvs
        entry["client_rc"] = hooks.run_client(argvs, log_dir / f"{name}.client.log")
        for c in args.concurrency:
            file = log_dir / level_file(name, c)
            if file.exists():
                entry["levels"][str(c)] = level_result(json.loads(file.read_text()))
        entry |= server.facts()
    finally:
        server.stop()
    return entry


def main(argv: list[str] | None = None) -> int:
    return run_main(build_parser().parse_args(argv))


def run_main(args: argparse.Namespace) -> int:
    """Run, print each engine's levels and the ratios, write --out; 1 where an engine neither ran nor was skipped."""
    check_args(args)
    result = run(args)
    for name, e in result["engines"].items():
        print(name, e.get("skipped") or e.get("error") or
              {c: (round(v["output_tok_s"] or 0, 1), v["tpot_p50_ms"], v["ttft_p50_ms"]) for c, v in
               e["levels"].items()}, {k: round(v, 3) for k, v in (e.get("acceptance") or {}).items()
                                       if k in ("mean_accept_length", "tokens_per_step")}, flush=True)
    print("ratios", json.dumps(result["ratios"]), flush=True)
    if "adaptive_bar" in result:
        bar = result["adaptive_bar"]
        print("adaptive bar", bar["pass"], {L: {c: p["ratio"] and round(p["ratio"], 3) for c, p in per_c.items()}
                                          for L, per_c in bar["points"].items()}, flush=True)
    print("wrote", args.out, flush=True)
    return 0 if all(e.get("levels") or e.get("skipped") for e in result["engines"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
