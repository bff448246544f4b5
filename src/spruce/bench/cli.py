"""`spruce bench {latency,serving}`."""

from __future__ import annotations


def add_parser(sub, add_engine_args) -> None:
    from spruce.bench.latency import add_latency_parser

    p = sub.add_parser("bench", help="benchmarks (results go to bench/results/)")
    bench_sub = p.add_subparsers(dest="bench", required=True)
    add_latency_parser(bench_sub)
    try:
        from spruce.bench.serving import add_serving_parser
    except ImportError:
        return
    add_serving_parser(bench_sub)
