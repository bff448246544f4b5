"""The `spruce` command line (also `python -m spruce`): generate, serve, bench, train-draft. Flag names follow
SGLang's, with vLLM's beside them."""

from __future__ import annotations

import argparse
import sys
import time

from spruce.cli_args import ArgumentParser, add_engine_args, engine_kwargs


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate for one prompt; print the text, then a speed / acceptance summary on stderr."""
    from spruce import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args))
    if args.tp_size > 1:
        from spruce.runtime.launch import exit_on_worker_failure

        exit_on_worker_failure(llm.engine)  # a dead worker ends the command with its error, whatever it waits on
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ()))
    t0 = time.perf_counter()
    out = llm.generate(args.prompt, params)[0]
    dt = time.perf_counter() - t0
    print(args.prompt + out.text)
    n = len(out.token_ids)
    summary = f"[spruce] {n} tokens in {dt:.2f} s ({n / dt:.1f} tokens/s), finish_reason={out.finish_reason}"
    if out.spec_stats:
        s = out.spec_stats
        rates = ", ".join(f"{r:.2f}" for r in s["accept_rate_per_depth"])
        summary += (f"; speculative: {s['rounds']} rounds, mean accept length {s['mean_accept_length']:.2f}, "
                    f"accept rate per depth [{rates}]")
    print(summary, file=sys.stderr)
    llm.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The whole `spruce` parser. Building it imports no torch: `--help` and `--version` answer at once."""
    import spruce

    parser = ArgumentParser(prog="spruce", description=__doc__)  # its subcommands' parsers are ArgumentParsers too
    parser.add_argument("--version", action="version", version=f"spruce {spruce.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt")
    add_engine_args(g, engine_seed_alias=False)  # --seed: this request's sampling seed
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append")
    g.set_defaults(func=cmd_generate)

    from spruce.bench import cli as bench_cli
    from spruce.server import cli as server_cli
    from spruce.train import cli as train_cli

    for module in (server_cli, bench_cli, train_cli):  # each registers its flags through add_parser(sub, ...)
        module.add_parser(sub, add_engine_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one `spruce` command; spruce's own errors print as one line and exit 2."""
    from spruce.errors import SpruceError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpruceError as e:
        print(f"spruce: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
