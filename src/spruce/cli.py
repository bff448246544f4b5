"""The `spruce` command line: generate, serve, bench, train-draft. Flag names follow SGLang's."""

from __future__ import annotations

import argparse
import sys
import time


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags shared by every subcommand that loads a model (SGLang's names)."""
    p.add_argument("--model", "--model-path", dest="model", default=None,
                   help="HF model directory (default: the bundled pycode-6m demo model)")
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--attention-backend", default=None, choices=["torch", "triton"])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-running-requests", type=int, default=16)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    p.add_argument("--chunked-prefill-size", type=int, default=2048)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None)
    p.add_argument("--speculative-algorithm", default=None, choices=["EAGLE", "EAGLE3"])
    p.add_argument("--speculative-draft-model-path", default=None)
    p.add_argument("--speculative-num-steps", type=int, default=None)
    p.add_argument("--speculative-eagle-topk", type=int, default=None)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    p.add_argument("--disable-speculative", action="store_true",
                   help="run the bundled demo model without its bundled draft head")
    p.add_argument("--random-seed", type=int, default=0)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """LLM(...) keyword arguments from parsed engine flags."""
    import torch

    from spruce.config import builtin_draft_path

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    draft = args.speculative_draft_model_path
    if draft is None and args.model is None and not args.disable_speculative and builtin_draft_path().exists():
        draft = str(builtin_draft_path())
    if args.disable_speculative:
        draft = None
    return dict(
        model=args.model, tokenizer=args.tokenizer_path, device=device, dtype=dtype,
        attention_backend=args.attention_backend, page_size=args.page_size,
        max_running_requests=args.max_running_requests, context_length=args.context_length,
        max_total_tokens=args.max_total_tokens, mem_fraction_static=args.mem_fraction_static,
        chunked_prefill_size=args.chunked_prefill_size,
        cuda_graph=False if args.disable_cuda_graph else None, cuda_graph_max_bs=args.cuda_graph_max_bs,
        draft_model=draft, speculative_algorithm=args.speculative_algorithm if draft else None,
        speculative_num_steps=args.speculative_num_steps if draft else None,
        speculative_eagle_topk=args.speculative_eagle_topk if draft else None,
        speculative_num_draft_tokens=args.speculative_num_draft_tokens if draft else None,
        seed=args.random_seed, show_progress=True,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from spruce import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args))
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
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spruce", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt")
    add_engine_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append")
    g.set_defaults(func=cmd_generate)

    for name, module in (("serve", "spruce.server.cli"), ("bench", "spruce.bench.cli"),
                         ("train-draft", "spruce.train.cli")):
        _add_lazy(sub, name, module)
    return parser


def _add_lazy(sub, name: str, module: str) -> None:
    """Subcommands living in their own packages register their flags through `add_parser(sub)`."""
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError:
        return
    mod.add_parser(sub, add_engine_args)


def main(argv: list[str] | None = None) -> int:
    from spruce.errors import SpruceError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpruceError as e:
        print(f"spruce: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
