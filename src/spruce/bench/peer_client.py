"""`python -m spruce.bench.peer_client LEVELS.json`: run `vllm bench serve` once per argv of LEVELS.json (a JSON list
of argument lists, each what follows `vllm bench serve`), in this one process when vLLM's benchmark module imports
(importing vLLM takes ~12 s: once, not once per level), else as the `vllm bench serve` command per level. Each level
saves its own result file (its --save-result arguments). Needs vLLM importable; spruce.bench.peer runs it."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys


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


def main(path: str) -> int:
    levels = json.loads(open(path).read())
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


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
