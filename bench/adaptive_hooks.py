"""Where an adaptive engine's own host time goes while every request is detached (issue 16), beside a plain engine's,
in one process: the serving bar's prefix workload (a 1024-token shared prefix + each request's 256-token held-out
prompt, 128 output tokens, greedy) in bench/adaptive_inprocess.py's closed loop (`concurrency` requests in flight, the
next added as one ends), with the servers' prefill batching (--scheduler-delay-factor 4).

Served on the H100 x4 (eleven bar runs at 4037e6d and 10ffd04, 2026-11-27) the adaptive server, every request
detached in its later passes, trailed the plain one by 0.8/4.5/1.9/1.4% at concurrency 1/8/32/64 while the engines
are host-bound from 8 up (~0.2-0.8 ms of host work a decode step): a few microseconds of the adaptive engine's own
work a step would account for it. Here each of the adaptive strategy's hooks that the engine calls (choose,
resolved, prefill, joins_without_draft, stats, idle) and the policy's calls inside them are timed around the call
(perf_counter, ~0.3 us a call of wrapper on a server's host: the plain engine's choose and resolved are wrapped
alike), and both engines' own step counters (launch, resolve, outputs: host seconds) give the whole difference a
decode step that the hooks should explain.

The adaptive engine is `forced` (bench.common.price_out: rounds priced out at start-up, so every request joins
detached, as in the bar's later passes). The engines alternate per repetition, order rotated.

Usage (repo root): python bench/adaptive_hooks.py --model DIR --draft DIR [--concurrency 8 32] [--repeats 3]
    [--requests 256] [--device cuda|cpu] [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

import adaptive_inprocess as inprocess
from adaptive_prefill_parts import PartTimer
from spruce.bench.common import write_result
from spruce.bench.serving import load_prompts

STRATEGY_HOOKS = ("choose", "resolved", "prefill", "joins_without_draft", "stats", "idle")
POLICY_CALLS = ("decide", "repeat", "stood", "steady_choice", "detach_blocker", "break_chain", "snapshot", "waited",
                "drafted_prompts", "idle")
ENGINE_PARTS = ("launch", "resolve", "outputs")


def instrument(llm, clock: PartTimer) -> None:
    """Wrap the engine's strategy hooks (both engines') and, for an adaptive engine, its policy's calls. The
    scheduler holds its own reference to joins_without_draft (Engine.__init__): it is pointed at the wrapper."""
    engine = llm.engine
    strategy = engine.strategy
    for name in STRATEGY_HOOKS:
        clock.wrap(strategy, name, name)
    engine.scheduler.joins_without_draft = strategy.joins_without_draft
    policy = getattr(strategy, "policy", None)
    if policy is not None:
        for name in POLICY_CALLS:
            clock.wrap(policy, name, "policy." + name)


def run_once(llm, clock: PartTimer, prompts: list, first: int, concurrency: int, num_requests: int) -> dict:
    """One closed-loop run: its figures, each hook's microseconds a decode step and a call, and the engine's host
    parts per decode step."""
    before = llm.engine.stats()["steps"]["seconds"]
    clock.clear()
    figures = inprocess.closed_loop(llm, prompts, first, concurrency, num_requests)
    after = llm.engine.stats()["steps"]["seconds"]
    decodes = figures["steps"]["decodes"]
    return {
        "tokens_per_s": figures["tokens_per_s"],
        "decodes": decodes,
        "prefills": figures["steps"]["prefills"],
        "engine_us_per_decode": {part: 1e6 * (after[part] - before[part]) / decodes for part in ENGINE_PARTS},
        "hooks": {name: {"calls": clock.calls[name], "us_per_call": 1e6 * clock.seconds[name] / clock.calls[name],
                         "us_per_decode": 1e6 * clock.seconds[name] / decodes}
                  for name in sorted(clock.calls)},
        "adaptive": figures["adaptive_total"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=256, help="requests a run (at least 8 per request in flight)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out-dir", default="bench/results")
    args = ap.parse_args()
    build_args = argparse.Namespace(device=args.device, scheduler_delay_factor=4.0, model=args.model, draft=args.draft,
                                    shapes=[])
    # the adaptive engine first: built after a plain engine in one process, its detached plain step's graph replayed
    # ~4 us (1.5%) slower alone at one request, built before it level with it (bench/graph_replays_alone.py)
    llms = {kind: inprocess.build(kind, build_args) for kind in ("forced", "plain")}
    clocks = {kind: PartTimer() for kind in llms}
    for kind, llm in llms.items():
        instrument(llm, clocks[kind])
    prompts = load_prompts(Path(args.model) / "heldout_prompts.jsonl", 256, llms["plain"].engine.tokenizer, 1024)
    for llm in llms.values():  # every prompt twice: the prefix cache holds them, as in a serving run's later passes
        inprocess.closed_loop(llm, prompts, 0, 1, len(prompts))
        inprocess.closed_loop(llm, prompts, 0, 8, len(prompts))
    runs, summary = {}, {}
    for concurrency in args.concurrency:
        num_requests = max(args.requests, 8 * concurrency)
        per_kind = {kind: [] for kind in llms}
        kinds = list(llms)
        for rep in range(args.repeats):
            for kind in kinds[rep % 2:] + kinds[:rep % 2]:
                result = run_once(llms[kind], clocks[kind], prompts, rep * num_requests, concurrency, num_requests)
                per_kind[kind].append(result)
                print(f"concurrency {concurrency} rep {rep} {kind}: {result['tokens_per_s']} tok/s, engine "
                      f"{ {p: round(v, 1) for p, v in result['engine_us_per_decode'].items()} } us a decode step",
                      flush=True)
        runs[str(concurrency)] = per_kind
        summary[str(concurrency)] = _summary(per_kind)
        print(f"concurrency {concurrency}: {summary[str(concurrency)]}", flush=True)
    config = vars(args) | {"workload": "prefix", "shared_prefix_tokens": 1024, "prompt_tokens": 256,
                           "max_tokens": inprocess.MAX_TOKENS, "scheduler_delay_factor": 4.0,
                           "speculative": {kind: llm.engine.info()["speculative"] for kind, llm in llms.items()}}
    path = write_result("adaptive-hooks", args.device, config, {"summary": summary, "runs": runs},
                        Path(args.out_dir))
    print(f"results: {path}")


def _summary(per_kind: dict[str, list[dict]]) -> dict:
    """Medians over repetitions: tokens/s (and the adaptive engine's ratio to plain), the engine's host parts per
    decode step (and the adaptive engine's excess over plain), each hook's microseconds a decode step, and the
    adaptive hooks' sum beyond the plain engine's choose and resolved."""
    med = {kind: {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
                  "engine_us_per_decode": {p: statistics.median(r["engine_us_per_decode"][p] for r in rows)
                                           for p in ENGINE_PARTS},
                  "hooks_us_per_decode": {h: statistics.median(r["hooks"].get(h, {}).get("us_per_decode", 0.0)
                                                               for r in rows)
                                          for h in sorted({h for r in rows for h in r["hooks"]})}}
           for kind, rows in per_kind.items()}
    plain, adaptive = med["plain"], med["forced"]
    strategy_sum = {kind: sum(v for h, v in m["hooks_us_per_decode"].items() if h in STRATEGY_HOOKS and h != "prefill")
                    for kind, m in med.items()}
    return med | {
        "adaptive_vs_plain": round(adaptive["tokens_per_s"] / plain["tokens_per_s"] - 1, 4),
        "engine_excess_us_per_decode": {p: adaptive["engine_us_per_decode"][p] - plain["engine_us_per_decode"][p]
                                        for p in ENGINE_PARTS},
        "hooks_excess_us_per_decode": strategy_sum["forced"] - strategy_sum["plain"],  # (prefill: its forward too)
    }


if __name__ == "__main__":
    main()
