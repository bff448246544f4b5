"""A `spruce bench serving --launch` run that a time limit cut short, as a result JSON: from its journal (OUT_DIR/
levels.jsonl, each level as it completed) and its log (OUT_DIR/bench.log, each server's `== NAME: spruce serve
FLAGS` line), the result's config (launch, workload) and per concurrency each server's output tokens/s over the
passes every server completed at that concurrency (the summary `bench/serving_bar.py` pools); the levels themselves
go into the result too. A device call that runs past its limit keeps the journal and the server logs but not the
result JSON, which `bench serving` writes at the end (2026-11-26: four shared-prefix runs on the H100 x4 stopped in
their third pass's concurrency-64 level).

The result names the commit as every benchmark's does (`spruce.bench.common.git_commit`): set SPRUCE_GIT_COMMIT to
the commit the run measured.

Usage (repo root): SPRUCE_GIT_COMMIT=SHA python bench/serving_journal.py OUT_DIR --device NAME
    --shared-prefix-tokens 1024 --prompt-tokens 256 [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path

from spruce.bench.common import write_result

SERVER_LINE = re.compile(r"^== ([^:,]+): spruce serve (.*)$")


def launch_of(log_text: str, common: list[str]) -> list[str]:
    """Each server's `--launch` text (NAME=FLAGS, less the flags every server got) from the bench log's lines."""
    launch = []
    for line in log_text.splitlines():
        match = SERVER_LINE.match(line)
        if match:
            flags = shlex.split(match.group(2))
            launch.append(f"{match.group(1)}={shlex.join(flags[len(common):])}")
    return launch


def common_flags(log_text: str) -> list[str]:
    """The flags every server's line starts with (the run's --server-args)."""
    lines = [shlex.split(m.group(2)) for line in log_text.splitlines() if (m := SERVER_LINE.match(line))]
    if not lines:
        raise SystemExit("no `== NAME: spruce serve FLAGS` line in the bench log")
    n = 0
    while all(len(flags) > n and flags[n] == lines[0][n] for flags in lines):
        n += 1
    return lines[0][:n]


def summary_of(levels: list[dict]) -> dict[str, dict[str, list[float]]]:
    """Per concurrency, each server's output tokens/s in the passes every server completed there, in pass order."""
    by_level: dict[int, dict[str, dict[int, float]]] = {}
    for level in levels:
        by_level.setdefault(level["concurrency"], {}).setdefault(level["server"], {})[level["pass"]] = \
            level["output_throughput_tok_s"]
    servers = {level["server"] for level in levels}
    out = {}
    for concurrency, per in sorted(by_level.items()):
        if set(per) != servers:
            continue
        passes = sorted(set.intersection(*(set(p) for p in per.values())))
        out[str(concurrency)] = {name: [per[name][k] for k in passes] for name in per}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--device", required=True)
    parser.add_argument("--shared-prefix-tokens", type=int, default=0)
    parser.add_argument("--prompt-tokens", type=int, required=True)
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    log_text = (args.run_dir / "bench.log").read_text()
    levels = [json.loads(line) for line in (args.run_dir / "levels.jsonl").read_text().splitlines() if line]
    common = common_flags(log_text)
    config = {"launch": launch_of(log_text, common), "server_args": shlex.join(common),
              "shared_prefix_tokens": args.shared_prefix_tokens, "prompt_tokens": args.prompt_tokens,
              "from_journal": str(args.run_dir)}
    path = write_result("serving", args.device, config, {"summary": {"prefix_cache": summary_of(levels)},
                                                         "levels": levels}, args.out_dir)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
