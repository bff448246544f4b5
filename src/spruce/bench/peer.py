"""Served spruce against a peer engine (vLLM) on one GPU in one run: same shape, same random prompts, vLLM's own
client, one JSON.

    python -m spruce.bench.peer --shape llama-3.1-8b --mode plain --input-len 512 --output-len 256 \\
        --concurrency 1,4,16,64,128 --out $OUT/peer-8b-plain.json

In turn (vLLM first: it compiles its model at start-up), each engine serves the shape with dummy weights
(`--load-format dummy` on both: config.json alone, nothing uploaded or written but configs and a word-level tokenizer
of the target's vocabulary, bench/shapes.py), `vllm bench serve` (random dataset, the given input / output lengths,
`--ignore-eos`, greedy) runs against it at every concurrency, and the server is stopped. A second spruce server with
the same flags (`spruce-control`) measures the spread of two identical copies. vLLM must be importable (its bundle:
../shared/peers/vllm_env.sh); spruce's servers run without the bundle on their path.

Modes: `plain`; `eagle3`: an EAGLE-3-shaped dummy head, a chain of --steps drafts on both engines, both with
synthetic acceptance at mean length --synthetic-length (vLLM: `rejection_sample_method: "synthetic"`; spruce:
`--speculative-synthetic-acceptance-length`, speculative/synthetic.py), plus spruce trees (--trees S,K,N ...) at the
same acceptance rates, each a server of its own (`spruce-tree-S-K-N`).

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
MODES = ("plain", "eagle3")
SERVER_START_TIMEOUT_S = 420  # vLLM compiles its model and captures graphs at start-up
ENGINE_ESTIMATE_S = 150  # a server's start, levels and stop before any has run (the deadline's first guess)
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


def tree_spec(text: str) -> tuple[int, int, int]:
    """argparse type: 'S,K,N' (steps, top-k, verify tokens), e.g. '5,4,8'."""
    values = positive_ints(text)
    if len(values) != 3:
        raise argparse.ArgumentTypeError(f"expected S,K,N (steps, topk, draft tokens), got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    from spruce.bench.shapes import TARGET_SHAPES

    p = argparse.ArgumentParser(prog="python -m spruce.bench.peer", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(TARGET_SHAPES), default="llama-3.1-8b",
                   help="the model shape (config-only directories written under --root)")
    p.add_argument("--root", type=Path, default=Path("/tmp/peer-shapes"), help="where the shape directories go")
    p.add_argument("--mode", choices=MODES, default="plain")
    p.add_argument("--steps", type=int, default=5, help="eagle3: drafts per round, a chain (vLLM's "
                   "num_speculative_tokens)")
    p.add_argument("--synthetic-length", type=float, default=3.0,
                   help="eagle3: mean acceptance length both engines accept drafts at (tokens a round commits)")
    p.add_argument("--trees", type=tree_spec, nargs="*", default=[], metavar="S,K,N",
                   help="eagle3: spruce trees to serve too, at the same acceptance rates (e.g. 5,4,6 5,8,8)")
    p.add_argument("--engines", default="vllm,spruce,spruce-control",
                   help="servers in order, of vllm, spruce, spruce-control (default: all three; trees follow)")
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
    return p


def check_args(args: argparse.Namespace) -> None:
    """SystemExit naming the value for settings that cannot run."""
    engines = engine_names(args)
    bad = [e for e in args.engines.split(",") if e not in ("vllm", "spruce", "spruce-control")]
    if bad or not engines:
        raise SystemExit(f"--engines {args.engines!r}: each must be vllm, spruce or spruce-control")
    if args.trees and args.mode != "eagle3":
        raise SystemExit(f"--trees {args.trees} needs --mode eagle3 (trees are speculative)")
    if args.mode == "eagle3" and not 1.0 <= args.synthetic_length <= args.steps + 1:
        raise SystemExit(f"--synthetic-length {args.synthetic_length} must be in [1, steps + 1 = {args.steps + 1}]")
    for s, k, n in args.trees:
        if args.mode == "eagle3" and not 1.0 <= args.synthetic_length <= s + 1:
            raise SystemExit(f"--trees {s},{k},{n}: --synthetic-length {args.synthetic_length} must be in "
                             f"[1, {s + 1}]")
    if args.input_len < 1 or args.output_len < 2 or args.prompts_per_level < 1 or args.min_prompts < 1:
        raise SystemExit("--input-len, --prompts-per-level and --min-prompts must be >= 1, --output-len >= 2")


def engine_names(args: argparse.Namespace) -> list[str]:
    """The servers in the order they run: --engines, then one per tree."""
    names = [e for e in args.engines.split(",") if e]
    return names + [tree_name(t) for t in args.trees]


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


def server_command(name: str, args: argparse.Namespace, shape: Shape, port: int) -> list[str]:
    """The argv that serves engine `name` ('vllm', 'spruce', 'spruce-control', 'spruce-tree-S-K-N')."""
    max_bs, ctx = max(args.concurrency), context_length(args)
    if name == "vllm":
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(shape.target),
               "--served-model-name", SERVED_NAME, "--port", str(port), "--load-format", "dummy",
               "--dtype", "bfloat16", "--max-num-seqs", str(max_bs), "--max-model-len", str(ctx), "--seed", "0",
               "--gpu-memory-utilization", str(args.mem_fraction), "--tensor-parallel-size", str(args.tp)]
        if args.mode == "eagle3":
            spec = {"method": "eagle3", "model": str(shape.draft), "num_speculative_tokens": args.steps,
                    "rejection_sample_method": "synthetic", "synthetic_acceptance_length": args.synthetic_length}
            cmd += ["--speculative-config", json.dumps(spec)]
        return cmd + shlex.split(args.vllm_flags)
    cmd = [sys.executable, "-m", "spruce.cli", "serve", "--model", str(shape.target),
           "--served-model-name", SERVED_NAME, "--port", str(port), "--load-format", "dummy", "--device", "cuda",
           "--dtype", "bfloat16", "--max-running-requests", str(max_bs), "--cuda-graph-max-bs", str(max_bs),
           "--context-length", str(ctx), "--mem-fraction-static", str(args.mem_fraction), "--random-seed", "0",
           "--tp-size", str(args.tp)]
    if args.mode == "eagle3":
        s, k, n = (args.steps, 1, args.steps + 1) if not name.startswith("spruce-tree-") else \
            tuple(int(v) for v in name.removeprefix("spruce-tree-").split("-"))
        cmd += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(shape.draft),
                "--speculative-num-steps", str(s), "--speculative-eagle-topk", str(k),
                "--speculative-num-draft-tokens", str(n),
                "--speculative-synthetic-acceptance-length", str(args.synthetic_length)]
    return cmd + shlex.split(args.spruce_flags)


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


def ratios(engines: dict, concurrency: tuple[int, ...]) -> dict:
    """Per pair (each spruce server over vllm, the control over spruce, each tree over spruce): per concurrency,
    RATIO_FIELDS' ratios (output tok/s above 1: the numerator faster; latencies below 1: it is quicker)."""
    names = [n for n, e in engines.items() if e.get("levels")]
    pairs = [(n, "vllm") for n in names if n.startswith("spruce") and "vllm" in names]
    if "spruce" in names:
        pairs += [(n, "spruce") for n in names if n == "spruce-control" or n.startswith("spruce-tree-")]
    out = {}
    for a, b in pairs:
        la, lb = engines[a]["levels"], engines[b]["levels"]
        out[f"{a}/{b}"] = {str(c): {f: ratio(la[str(c)].get(f), lb[str(c)].get(f)) for f in RATIO_FIELDS}
                           for c in concurrency if str(c) in la and str(c) in lb}
    return out


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


def model_bytes(target: Path):
    """(weight_bytes(batch), KV bytes per token) of the target, from spruce's model built on the meta device (no
    memory): the weights a forward over `batch` tokens reads (decoder.py) and its KV pool's bytes a token."""
    import torch

    from spruce.memory.kv_pool import target_pool_bytes_per_token
    from spruce.models.hf_config import ModelConfig
    from spruce.models.loader import _build
    from spruce.models.registry import target_class

    cfg = ModelConfig.from_dir(target)
    model = _build(lambda: target_class(cfg)(cfg, None, ()), torch.bfloat16, torch.device("meta"))
    return model.weight_bytes_read, target_pool_bytes_per_token(cfg, torch.bfloat16)


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
        """What the server says of itself: /version, spruce's /server_info, the acceptance counters of /metrics."""
        base, out = f"http://127.0.0.1:{self.port}", {}
        for path in ("/version", "/server_info"):
            try:
                out[path.strip("/")] = get_json(base + path)
            except OSError:
                pass
        try:
            out["acceptance"] = acceptance_from_metrics(get_json(base + "/metrics"))
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
    """Mean acceptance length (tokens a round commits) from a server's Prometheus text: vLLM's spec-decode
    counters (1 + accepted / drafts) or spruce's gauge."""
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
    drafts = values.get("vllm:spec_decode_num_drafts_total", values.get("vllm:spec_decode_num_drafts"))
    accepted = values.get("vllm:spec_decode_num_accepted_tokens_total",
                          values.get("vllm:spec_decode_num_accepted_tokens"))
    if drafts:
        return {"mean_accept_length": 1.0 + (accepted or 0.0) / drafts, "drafts": drafts, "accepted": accepted}
    if "spruce_spec_mean_accept_length" in values:
        return {"mean_accept_length": values["spruce_spec_mean_accept_length"]}
    return {}


def run_client(argv_per_level: list[list[str]], log: Path) -> int:
    """Run `vllm bench serve` once per argv (spruce.bench.peer_client: one process for every level where vLLM's
    benchmark module imports); its output goes to `log`. Returns its exit status."""
    spec = log.with_suffix(".levels.json")
    spec.write_text(json.dumps(argv_per_level))
    with open(log, "a") as f:
        return subprocess.run([sys.executable, "-m", "spruce.bench.peer_client", str(spec)], stdout=f,
                              stderr=subprocess.STDOUT).returncode


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
    from spruce.bench.shapes import write_shape_dirs

    target, draft = write_shape_dirs(args.shape, args.root, tokenizer=True)
    return Shape(target, draft)


def run(args: argparse.Namespace, hooks: Hooks | None = None, shape: Shape | None = None) -> dict:
    """Serve and measure every engine in turn; returns the result (also written to args.out after each engine)."""
    from spruce.bench.common import git_commit
    from spruce.config import rates_for_length

    hooks = hooks or Hooks(bandwidth=bandwidth_in_subprocess)
    t0 = hooks.clock()
    shape = shape or write_shapes(args)
    log_dir = args.log_dir or args.out.parent / (args.out.stem + "-logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    bw = hooks.bandwidth() if hooks.bandwidth else {}
    weight_bytes, kv_per_token = hooks.model_bytes(shape.target)
    nominal = args.nominal_hbm_tbs * 1e12
    ctx = args.input_len + args.output_len // 2  # a request's mean cached context while it decodes
    roof = roofline(args.concurrency, ctx, weight_bytes, kv_per_token, args.tp, nominal,
                    bw.get("copy_bandwidth_bytes_per_s"))
    synthetic = None
    if args.mode == "eagle3":
        synthetic = {"length": args.synthetic_length, "chain_rates": list(rates_for_length(args.synthetic_length,
                                                                                          args.steps)),
                     "note": "drafts accepted at these rates, not verified: outputs are not the target's"}
    result = {
        "benchmark": "peer", "shape": args.shape, "mode": args.mode, "git_commit": git_commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "gpu": bw.get("gpu"), "tp": args.tp,
        "input_len": args.input_len, "output_len": args.output_len, "concurrency": list(args.concurrency),
        "prompts": {str(c): num_prompts(args, c) for c in args.concurrency}, "temperature": args.temperature,
        "synthetic_acceptance": synthetic, "target_dir": str(shape.target), "draft_dir": str(shape.draft),
        "client": "vllm bench serve (random dataset, --ignore-eos)",
        "hbm": {"nominal_bytes_per_s": nominal, "measured": bw,
                "note": "roofline: a plain decode step's bytes (weights it reads + KV at the mean context "
                        "input_len + output_len/2) over the bandwidth"},
        "roofline": roof, "engines": {}, "ratios": {},
    }
    spent = []  # seconds each engine took, for the deadline
    for name in engine_names(args):
        estimate = max(spent) if spent else ENGINE_ESTIMATE_S
        if hooks.clock() - t0 + estimate > args.deadline_s:
            result["engines"][name] = {"skipped": f"deadline: {hooks.clock() - t0:.0f} s spent, an engine takes "
                                                  f"~{estimate:.0f} s, --deadline-s {args.deadline_s:g}"}
            continue
        t_engine = hooks.clock()
        result["engines"][name] = measure_engine(name, args, shape, hooks, log_dir)
        spent.append(hooks.clock() - t_engine)
        finish(result, args)
    finish(result, args)
    return result


def finish(result: dict, args: argparse.Namespace) -> None:
    """Ratios and roofline fractions from the engines so far; (re)write args.out."""
    roofline_fractions(result["engines"], result["roofline"])
    result["ratios"] = ratios(result["engines"], args.concurrency)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


def measure_engine(name: str, args: argparse.Namespace, shape: Shape, hooks: Hooks, log_dir: Path) -> dict:
    """Start engine `name`, run the client's levels (after a warm-up) against it, stop it."""
    command = server_command(name, args, shape, args.port)
    entry = {"command": command, "levels": {}}
    t = hooks.clock()
    server = hooks.start_server(name, command, args.port, log_dir / f"{name}.server.log")
    try:
        if not server.wait_up(SERVER_START_TIMEOUT_S):
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
    args = build_parser().parse_args(argv)
    check_args(args)
    result = run(args)
    for name, e in result["engines"].items():
        print(name, e.get("skipped") or e.get("error") or
              {c: (round(v["output_tok_s"] or 0, 1), v["tpot_p50_ms"], v["ttft_p50_ms"]) for c, v in
               e["levels"].items()}, flush=True)
    print("ratios", json.dumps(result["ratios"]), flush=True)
    print("wrote", args.out, flush=True)
    return 0 if all(e.get("levels") or e.get("skipped") for e in result["engines"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
