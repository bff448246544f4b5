"""A served concurrency-1 level without the server: one engine per process, plain or adaptive, requests one at a time
(issue 16).

Served at concurrency 1 with the 1k shared prefix (the serving bar's workload, H200, four servers on a 16-CPU
machine, two CPUs each), an adaptive server trailed the plain servers of its run by ~1% in tokens/s: over 27 run
pairs (2026-11-28) its TPOT mean was 4.6 +- 0.6 us higher, its ITL p50 the same, and its engine loop took 9.4 +- 2.2
us more host time a decode step. This program asks whether the engine itself is slower, away from the server's HTTP
process, pipe and CPU sets: it builds one engine in this process (run it once per kind, in fresh processes, in turn),
sends `--requests` requests one after another (by default each the 1k shared prefix and its own 256-token held-out
prompt, 128 output tokens, greedy), with an idle step and a `--gap` of sleep between them (a client's round trip: the
adaptive policy's parks survive gaps below DETACH_GAP), and times every `Engine.step`, labelled by the adaptive
strategy's state before it: parked (P: plain steps the policy is not told of), a ticket of standing steps (t), or
else (o: decided steps), and whether the step launched a prefill. Per request: the wall time from `add_request` to
its last output (e2e) and to its first token (TTFT).

Kinds: plain (the target alone) and adaptive (the serving bar's adaptive server: EAGLE-3 (5, 4, 16) rounds that may
verify 8 nodes, `speculative_adaptive`, its own policy: on the shared-prefix workload it parks).
Found on the H200 (2026-11-28, three processes of each kind, 64 requests each): e2e 34.60/34.60/34.70 ms plain and
34.47/34.72/34.54 adaptive; parked and ticket steps 256-257 us against plain steps 256-259; the prefill step
~0.1 ms longer (TTFT +0.15 ms): the engine alone is level; the served gap is the server's
(results/adaptive-alone-nvidia-h200-20261128-129f997.json, made by this program's first form, the .py beside it).

Usage (repo root): python bench/adaptive_alone.py KIND --model DIR --draft DIR [--requests 64] [--warm 12]
    [--gap 0.002] [--max-tokens 128] [--shared-prefix-tokens 1024] [--prompt-tokens 256] [--device cuda]
    [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from pathlib import Path

import torch

from spruce import LLM, SamplingParams
from spruce.bench.common import write_result
from spruce.bench.serving import load_prompts

KINDS = ("plain", "adaptive")


def build(kind: str, args) -> LLM:
    """The engine named `kind` (module docstring), page size 16, 64 rows, prefill batching as the bar's servers."""
    kw = dict(page_size=16, max_running_requests=64, device=args.device, scheduler_delay_factor=4.0,
              dtype="bfloat16" if args.device.startswith("cuda") else "float32")
    if kind == "adaptive":
        kw.update(draft_model=args.draft, speculative_num_steps=5, speculative_eagle_topk=4,
                  speculative_num_draft_tokens=16, speculative_adaptive=True, speculative_adaptive_widths=[8])
    return LLM(args.model, **kw)


def state(strategy) -> str:
    """The adaptive strategy's state before a step: P parked, t a ticket of standing steps, o otherwise; plain for a
    plain engine (reads the strategy's private state: a profiler of it)."""
    if not hasattr(strategy, "detached_plain"):
        return "plain"
    return "P" if strategy._park is not None else ("t" if strategy._ticket is not None else "o")


def run_request(llm: LLM, prompt, params: SamplingParams, steps: list | None) -> tuple[float, float]:
    """Add one request and step the engine until it finishes, then once more idle (the engine meets the gap as a
    serving loop does); each step's (label, seconds) appended to `steps`. Returns (e2e, TTFT) in seconds."""
    engine = llm.engine
    rid = engine.add_request(prompt, params)
    added, first = time.perf_counter(), None
    while True:
        label, prefills = state(engine.strategy), engine.counters.prefills
        t0 = time.perf_counter()
        outputs = engine.step()
        t1 = time.perf_counter()
        if steps is not None:
            steps.append((label + ("+prefill" if engine.counters.prefills > prefills else ""), t1 - t0))
        for out in outputs:
            if out.request_id != rid:
                continue
            if first is None and out.token_ids:
                first = t1
            if out.finished:
                engine.step()
                return t1 - added, first - added


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=KINDS)
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--warm", type=int, default=12, help="requests before the timed ones (the policy settles)")
    ap.add_argument("--gap", type=float, default=0.002, help="seconds of sleep between requests")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--shared-prefix-tokens", type=int, default=1024)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out-dir", default="bench/results")
    args = ap.parse_args()
    if min(args.requests, args.max_tokens, args.prompt_tokens) < 1 or min(args.warm, args.gap,
                                                                          args.shared_prefix_tokens) < 0:
        raise SystemExit(f"--requests, --max-tokens and --prompt-tokens must be >= 1 and --warm, --gap and "
                         f"--shared-prefix-tokens >= 0, got {args.requests}, {args.max_tokens}, {args.prompt_tokens}, "
                         f"{args.warm}, {args.gap} and {args.shared_prefix_tokens}")
    llm = build(args.kind, args)
    prompts = load_prompts(Path(args.model) / "heldout_prompts.jsonl", args.prompt_tokens, llm.engine.tokenizer,
                           args.shared_prefix_tokens)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    steps, e2e, ttft = [], [], []
    for i in range(args.warm + args.requests):
        timed = i >= args.warm
        latency = run_request(llm, prompts[i % len(prompts)], params, steps if timed else None)
        if timed:
            e2e.append(latency[0])
            ttft.append(latency[1])
        time.sleep(args.gap)
    by_label = collections.defaultdict(list)
    for label, seconds in steps:
        by_label[label].append(seconds)
    n = args.requests
    figures = {"e2e_ms_mean": 1e3 * statistics.mean(e2e), "ttft_ms_mean": 1e3 * statistics.mean(ttft),
               "steps_per_request": len(steps) / n,
               "steps": {label: {"per_request": len(v) / n, "mean_us": 1e6 * statistics.mean(v),
                                 "p50_us": 1e6 * statistics.median(v), "us_per_request": 1e6 * sum(v) / n}
                         for label, v in sorted(by_label.items())}}
    stats = llm.engine.stats()["adaptive"]  # the adaptive policy's counters (None: a plain engine)
    if stats is not None:
        figures["adaptive"] = {k: v for k, v in stats.items() if isinstance(v, (int, float))}
    config = dict(vars(args))
    path = write_result(f"adaptive-alone-{args.kind}", args.device, config, figures, Path(args.out_dir))
    print(args.kind, {k: round(v, 3) for k, v in figures.items() if isinstance(v, float)},
          {label: round(v["mean_us"], 1) for label, v in figures["steps"].items()})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
