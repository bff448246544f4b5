"""`python -m spruce.bench.peer_client LEVELS.json [--client auto|vllm|spruce]`: run `vllm bench serve` once per argv
of LEVELS.json (a JSON list of argument lists, each what follows `vllm bench serve`), in this one process when vLLM's
benchmark module imports (importing vLLM takes ~12 s: once, not once per level), else as the `vllm bench serve`
command per level. Each level saves its own result file (its --save-result arguments). spruce.bench.peer runs it.

With `--client spruce` (or auto where vLLM does not import) spruce's own client runs the same levels
(`run_spruce_level`): the argvs' random dataset as token-id prompts (--random-input-len ids drawn from the
--tokenizer directory's vocabulary, seeded by --seed), streamed by bench/serving_client.py with --max-concurrency in
flight, and a result file with vLLM's names of the figures spruce.bench.peer reads (output_throughput, median_tpot_ms,
...). Spruce-only comparisons then need no vLLM."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace


def vllm_parser():
    """vLLM's `bench serve` parser and its main(args), or None where this vLLM lacks them."""
    try:
        from vllm.benchmarks.serve import add_cli_args, main
    except ImportError as e:
        print(f"[peer_client] vllm.benchmarks.serve does not import ({e}); running the command per level", flush=True)
        return None
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        try:
            from vllm.utils import FlexibleArgumentParser
        except ImportError:
            FlexibleArgumentParser = argparse.ArgumentParser
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return parser, main


def run_in_process(parser, main, argv: list[str]) -> None:
    result = main(parser.parse_args(argv))
    if asyncio.iscoroutine(result):
        asyncio.run(result)


def run_command(argv: list[str]) -> int:
    return subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", *argv]).returncode


# --- spruce's own client ----------------------------------------------------------------------------------------
def level_parser() -> argparse.ArgumentParser:
    """The `vllm bench serve` arguments spruce's client reads (spruce.bench.peer.client_argv writes them); others
    are ignored."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in ("--base-url", "--model", "--tokenizer", "--result-dir", "--result-filename", "--dataset-name"):
        p.add_argument(flag, required=flag != "--dataset-name")
    for flag in ("--random-input-len", "--random-output-len", "--num-prompts", "--max-concurrency"):
        p.add_argument(flag, type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--timeout", type=float, default=600.0)
    return p


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`num` prompts of `length` token ids, uniform in [0, vocab_size), the same for every server given `seed`."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(num)]


def vocab_size(model_dir: str) -> int:
    """The vocabulary of the model directory's config.json."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return int(cfg.get("vocab_size") or cfg["text_config"]["vocab_size"])


def summarize(sent, num_prompts: int) -> dict:
    """A level's figures under vLLM's `--save-result` names from serving_client's `Sent`: output tok/s over the
    level's span, TTFT / TPOT / ITL in ms (median, mean, p99). TPOT of a request: (e2e - ttft) / (tokens - 1).
    E.g. two requests of 11 tokens, ttft 0.1 s, e2e 1.1 s, over 1.2 s: 22 / 1.2 = 18.3 tok/s, TPOT 100 ms."""
    ok = [r for r in sent.results if r.ok]
    span = max(sent.ended - sent.started, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    ttft = [r.ttft * 1e3 for r in ok]
    tpot = [(r.e2e - r.ttft) * 1e3 / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [v * 1e3 for r in ok for v in r.itls]
    out = {"completed": len(ok), "failed": len(sent.results) - len(ok), "num_prompts": num_prompts,
           "duration": span, "total_output_tokens": out_tokens, "output_throughput": out_tokens / span,
           "errors": sorted({r.error for r in sent.results if not r.ok})[:5], "client": "spruce"}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        out[f"median_{name}_ms"] = statistics.median(values) if values else None
        out[f"mean_{name}_ms"] = statistics.fmean(values) if values else None
        out[f"p99_{name}_ms"] = sorted(values)[min(len(values) - 1, int(0.99 * len(values)))] if values else None
    return out


def run_spruce_level(argv: list[str], pool=None) -> int:
    """One level's argv with spruce's client (module docstring); writes its result file. Returns 0, or 1 when a
    request failed."""
    from spruce.bench.serving_client import client_processes, send_level

    a, _ = level_parser().parse_known_args(argv)
    prompts = random_prompts(a.num_prompts, a.random_input_len, vocab_size(a.tokenizer), a.seed)
    sampling = SimpleNamespace(timeout=a.timeout, temperature=a.temperature, no_ignore_eos=not a.ignore_eos,
                               max_tokens=a.random_output_len, max_tokens_min=None)
    processes = client_processes(0, a.max_concurrency) if pool is not None else 1
    sent = asyncio.run(send_level(a.base_url, {}, a.model, prompts, a.max_concurrency, a.num_prompts, sampling,
                                  pool, processes))
    result = summarize(sent, a.num_prompts)
    Path(a.result_dir).mkdir(parents=True, exist_ok=True)
    (Path(a.result_dir) / a.result_filename).write_text(json.dumps(result, indent=1))
    print(f"[peer_client] spruce client: {result['completed']}/{a.num_prompts} ok, "
          f"{result['output_throughput']:.1f} tok/s, errors {result['errors']}", flush=True)
    return 1 if result["failed"] else 0


def run_spruce_levels(levels: list[list[str]]) -> int:
    """Every level with spruce's client, its concurrency spread over a pool of client processes (one per 4
    streams in flight, serving_client.client_processes) started once for all levels."""
    from spruce.bench.serving_client import ClientPool, client_processes

    most = max(client_processes(0, level_parser().parse_known_args(argv)[0].max_concurrency) for argv in levels)
    pool = ClientPool(most) if most > 1 else None
    try:
        return 1 if sum(run_spruce_level(argv, pool) for argv in levels) else 0
    finally:
        if pool is not None:
            pool.shutdown()


def chosen_client(client: str) -> str:
    """'vllm' or 'spruce': `client`, or for 'auto' vLLM's where the vllm package is importable."""
    if client != "auto":
        return client
    return "vllm" if importlib.util.find_spec("vllm") is not None else "spruce"


def main(path: str, client: str = "auto") -> int:
    levels = json.loads(open(path).read())
    if chosen_client(client) == "spruce":
        print("[peer_client] spruce's own client", flush=True)
        return run_spruce_levels(levels)
    found = vllm_parser()
    failed = 0
    for argv in levels:
        print(f"[peer_client] vllm bench serve {' '.join(argv)}", flush=True)
        if found is not None:
            try:
                run_in_process(*found, argv)
                continue
            except (Exception, SystemExit) as e:  # noqa: BLE001 (vLLM's internals: any failure falls back)
                print(f"[peer_client] in-process run failed ({type(e).__name__}: {e}); the command from here on",
                      flush=True)
                found = None
        failed += run_command(argv) != 0
    return 1 if failed else 0


def parse_cli(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m spruce.bench.peer_client", description=__doc__, allow_abbrev=False)
    p.add_argument("levels", help="a JSON list of `vllm bench serve` argument lists, one per level")
    p.add_argument("--client", choices=("auto", "vllm", "spruce"), default="auto")
    return p.parse_args(argv)


if __name__ == "__main__":
    cli = parse_cli(sys.argv[1:])
    raise SystemExit(main(cli.levels, cli.client))
