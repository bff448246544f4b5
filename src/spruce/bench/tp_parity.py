"""`spruce bench tp-parity`: tp_size=N vs tp_size=1 greedy on the same prompts; is every divergence a near-tie?

A tensor-parallel rank sums its row-parallel partials in another order than one GPU does (and its GEMMs have
other shapes), so in bf16 the logits differ in their last bits and greedy text can part where two logits are
nearly tied. For every prompt whose tokens differ this reports the first divergent position d, both tokens and
the top-2 gap there as each engine sees it: teacher-forced logits (`next_token_logits`) along both runs, from
the tp=1 engine and from the tp=N engine (kept up until they are read). A divergence is a near-tie when every
token each run emitted is within `threshold` logits of the top (the rule of `bench parity`); a tp=N token far
below the top logit would be a bug. The match rate counts identical prompts and tokens before the first
divergence.
"""

from __future__ import annotations

from pathlib import Path

import torch

from spruce.bench.common import RESULTS_DIR, device_name, write_result
from spruce.bench.parity import (DEFAULT_THRESHOLD, divergence_record, first_divergence, free_device_memory, greedy,
                                 load_prompts, model_tokenizer, target_logits, verdict)


def make_llm(args, prompts: list[list[int]], tp_size: int):
    from spruce import LLM

    longest = max(len(p) for p in prompts)
    return LLM(model=args.model, device=args.device, dtype=args.dtype, page_size=args.page_size,
               attention_backend=args.attention_backend, cuda_graph=args.cuda_graph, max_running_requests=len(prompts),
               max_total_tokens=len(prompts) * (longest + args.max_tokens + 256 + args.page_size), tp_size=tp_size)


def _renamed(record: dict, tp: int) -> dict:
    """divergence_record names its sides plain / spec: here they are tp=1 / tp=N."""
    names = {"plain": "tp1", "spec": f"tp{tp}"}
    out = {}
    for key, value in record.items():
        for old, new in names.items():
            key = key.replace(f"{old}_", f"{new}_")
        out[key] = _renamed(value, tp) if isinstance(value, dict) else value
    return out


def divergence_entry(base, tp_llm, prompt: list[int], a: list[int], b: list[int], threshold: float, tp: int) -> dict:
    """One divergent prompt (tp=1 output `a`, tp=N output `b`), as the tp=1 engine `base` and the tp=N engine
    each see it along both runs; a near-tie only if it is one in both views."""
    seen_by_tp1 = divergence_record(a, b, target_logits(base, prompt, a), target_logits(base, prompt, b), threshold)
    seen_by_tp = divergence_record(a, b, target_logits(tp_llm, prompt, a), target_logits(tp_llm, prompt, b),
                                   threshold)
    return {"prompt_tokens": len(prompt), "position": seen_by_tp1["position"],
            "tp1_token": seen_by_tp1["plain_token"], f"tp{tp}_token": seen_by_tp1["spec_token"],
            "near_tie": seen_by_tp1["near_tie"] and seen_by_tp["near_tie"],
            "seen_by_tp1": _renamed(seen_by_tp1, tp), f"seen_by_tp{tp}": _renamed(seen_by_tp, tp)}


def describe(d: dict, tp: int) -> str:
    """One line per divergence: the top-2 gaps at it along both runs, as each engine sees them."""
    gaps = " / ".join(f"{v['tp1_run']['top2_gap']:.3f}, {v[f'tp{tp}_run']['top2_gap']:.3f}"
                      for v in (d["seen_by_tp1"], d[f"seen_by_tp{tp}"]))
    return (f"  prompt {d['prompt_index']} pos {d['position']}: tp1 {d['tp1_token']} tp{tp} {d[f'tp{tp}_token']}; "
            f"top-2 gaps (tp1 run, tp{tp} run) seen by tp1 / tp{tp}: {gaps} "
            f"{'near-tie' if d['near_tie'] else 'NOT A NEAR-TIE'}")


def run_tp_parity(args) -> dict:
    prompts = load_prompts(args.prompts, model_tokenizer(args.model), args.num_prompts, args.prompt_tokens)
    base = make_llm(args, prompts, 1)
    base_outs = greedy(base, prompts, args.max_tokens)
    tp_llm = make_llm(args, prompts, args.tp_size)
    try:
        tp_outs = greedy(tp_llm, prompts, args.max_tokens)
        firsts = [first_divergence(a, b) for a, b in zip(base_outs, tp_outs)]
        divergences = [{"prompt_index": i, **divergence_entry(base, tp_llm, prompt, a, b, args.threshold, args.tp_size)}
                       for i, (prompt, a, b, d) in enumerate(zip(prompts, base_outs, tp_outs, firsts)) if d is not None]
    finally:
        tp_llm.shutdown()
    del base, tp_llm
    free_device_memory()
    tokens = sum(len(a) for a in base_outs)
    same_tokens = sum(len(a) if d is None else d for a, d in zip(base_outs, firsts))
    return {"tp_size": args.tp_size, "threshold": args.threshold, "threshold_units": f"logits ({args.dtype})",
            "num_prompts": len(prompts), "matched_prompts": len(prompts) - len(divergences),
            "prompt_match_rate": (len(prompts) - len(divergences)) / len(prompts),
            "tokens": tokens, "tokens_before_first_divergence": same_tokens,
            "token_match_rate": same_tokens / tokens if tokens else 1.0,
            "divergences": divergences, "verdict": verdict(divergences)}


def add_tp_parity_parser(sub) -> None:
    import argparse

    p = sub.add_parser("tp-parity", help="tensor-parallel vs one-GPU greedy on the same prompts; divergences vs "
                                          "near-ties")
    p.add_argument("--model", default=None, help="HF model dir (default: the bundled demo model)")
    p.add_argument("--prompts", required=True, help='JSONL of {"text": ...} prompts')
    p.add_argument("--tp-size", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--prompt-tokens", type=int, default=128, help="cut every prompt to this many tokens (0: whole)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None, help="default: on for cuda")
    p.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                   help="a divergence is a near-tie when every emitted token is within this many logits of the top")
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    p.set_defaults(func=run_tp_parity_bench)


def run_tp_parity_bench(args) -> int:
    """Run, print, write bench/results/tp-parity-<device>-<time>.json; exit 1 when a divergence is not a
    near-tie."""
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    figures = run_tp_parity(args)
    for d in figures["divergences"]:
        print(describe(d, args.tp_size))
    config = {k: v for k, v in vars(args).items() if k != "func"}
    path = write_result("tp-parity", args.device, config, figures, Path(args.out_dir))
    print(f"tp={args.tp_size} vs tp=1: {figures['matched_prompts']}/{figures['num_prompts']} prompts identical, "
          f"token match {figures['token_match_rate']:.4f}; {figures['verdict']}; wrote {path}  "
          f"[{device_name(args.device)}]")
    return 0 if figures["verdict"] != "NOT near-tie: bug" else 1
