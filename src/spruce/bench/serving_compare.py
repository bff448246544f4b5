"""`spruce bench serving-compare A.json B.json ...`: runs of `spruce bench serving` (e.g. speculative and plain,
overlap on and off) on the same axes: one PNG of latency percentiles and throughput vs concurrency, and a table."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from spruce.bench.serving import last_pass, plot


def add_serving_compare_parser(sub) -> None:
    p = sub.add_parser("serving-compare", help="plot several `bench serving` results on the same axes")
    p.add_argument("results", nargs="+", help="serving-*.json files written by `spruce bench serving`")
    p.add_argument("--labels", nargs="+", default=None,
                   help="one label per result (default: the server's speculation and overlap settings)")
    p.add_argument("--out", required=True, help="PNG to write")
    p.set_defaults(func=run_serving_compare)


def run_label(result: dict) -> str:
    """What distinguishes a run: the serving server's speculation and overlap settings (from its /metrics)."""
    server = result.get("config", {}).get("server", {})
    spec = server.get("speculative", "?")
    spec = "plain" if spec == "off" else spec
    overlap = server.get("overlap_schedule")
    return spec if overlap is None else f"{spec}, overlap {overlap}"


def run_serving_compare(args: argparse.Namespace) -> int:
    results = [json.loads(Path(f).read_text()) for f in args.results]
    labels = args.labels or [run_label(r) for r in results]
    if len(labels) != len(results):
        print(f"spruce bench serving-compare: {len(labels)} labels for {len(results)} results; give one per result",
              file=sys.stderr)
        return 2
    if len(set(labels)) != len(labels):
        labels = [f"{label} ({Path(f).stem})" for label, f in zip(labels, args.results)]
    series = {label: last_pass(r["figures"]["levels"]) for label, r in zip(labels, results)}
    for label, levels in series.items():
        cells = ", ".join(f"c{lv['concurrency']}: {lv['output_throughput_tok_s']:.0f} tok/s" for lv in levels)
        print(f"{label}: {cells}")
    png = plot(series, Path(args.out))
    if png is None:
        print("spruce bench serving-compare needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 2
    print(f"plot: {png}")
    return 0
