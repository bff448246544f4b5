"""Where an engine's time goes when requests keep arriving (issue 16): on the H100 with the engine in its own
process, a fixed EAGLE-3 server at concurrency 8 committed ~10k tokens/s while its decode rounds alone (launch to
launch, 0.86 ms for 33 tokens) would commit ~38k; a plain server lost far less to whatever lies between its decode
steps. This runs the offline engine the way a server at concurrency C runs it (C requests at once, the next one
added as each finishes, so the queue is empty between arrivals as a server's is; `max_running_requests` as the
server's), with the phase timer on, and reports per engine its wall time, each phase's device-side total (CUDA
events around the phase: for host-bound launches, their span), prefill launches per request and the admission
rounds prefill batching held back (`--scheduler-delay-factor`), so the prefill's share (target prefill + the
draft's extend) is measured, not inferred. Engines: plain, fixed EAGLE-3 (5, 4, 8) and, with --adaptive, adaptive
over the same (5, 4, 8) (its step choices recorded too).

Usage (repo root): python bench/prefill_share.py OUT_JSON --model DIR --prompts FILE [--draft DIR] [--adaptive]
    [--concurrency 8] [--num-requests 512] [--max-tokens 128] [--prompt-tokens 128] [--max-running-requests 64]
    [--scheduler-delay-factor 0] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from spruce import LLM, SamplingParams
from spruce.bench.common import device_name, git_commit


def prompts_from(path: str, tokenizer, count: int, tokens: int) -> list[list[int]]:
    """`count` prompts of `tokens` tokens each from a JSONL file of {"text": ...} (cycled)."""
    texts = [json.loads(line)["text"] for line in Path(path).read_text().splitlines() if line.strip()]
    ids = [tokenizer.encode(t) for t in texts]
    ids = [(i * (tokens // max(len(i), 1) + 1))[:tokens] for i in ids if i]
    return [ids[k % len(ids)] for k in range(count)]


def serve(engine, prompts: list[list[int]], concurrency: int, max_tokens: int) -> int:
    """Keep `concurrency` requests in the engine, adding the next prompt as one finishes; the tokens generated."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    queue, live, tokens = list(prompts), 0, 0
    while queue or live:
        while queue and live < concurrency:
            engine.add_request(queue.pop(0), params)
            live += 1
        for out in engine.step(finished_only=True):
            live -= 1
            tokens += len(out.token_ids)
    return tokens


def run(name: str, llm: LLM, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    engine = llm.engine
    serve(engine, prompts[:16], concurrency, max_tokens)  # warm-up: compiles, graphs in use
    timer = engine.phase_timer
    timer.reset()
    timer.enabled = True
    before = engine.stats()
    t0 = time.perf_counter()
    tokens = serve(engine, prompts, concurrency, max_tokens)
    wall = time.perf_counter() - t0
    phases = timer.collect()
    timer.enabled = False
    after = engine.stats()
    prefills = phases.get("prefill", {}).get("count", 0)
    result = {"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall, "phases": phases,
              "prefill_launches_per_request": prefills / len(prompts),
              "prefill_holds": after["prefill_holds"] - before["prefill_holds"]}
    if after.get("adaptive") is not None:
        result["adaptive_steps"] = {c: n - before["adaptive"]["chosen"][c]
                                    for c, n in after["adaptive"]["chosen"].items()}
        result["adaptive_realized_ratio"] = after["adaptive"]["realized_ratio"]
    print(f"{name}: {tokens / wall:.0f} tok/s, wall {wall:.2f} s, {result['prefill_launches_per_request']:.2f} "
          f"prefills/request, {result['prefill_holds']} holds; " + ", ".join(
              f"{k} {v['total_ms'] / 1e3:.2f} s/{v['count']}" for k, v in sorted(phases.items())))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-running-requests", type=int, default=64, help="the engine's, as the server's")
    ap.add_argument("--scheduler-delay-factor", type=float, default=0.0, help="prefill batching, every engine")
    ap.add_argument("--adaptive", action="store_true", help="also run adaptive speculation (needs --draft)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    if args.concurrency > args.max_running_requests:
        ap.error(f"--concurrency {args.concurrency} exceeds --max-running-requests {args.max_running_requests}")
    if args.adaptive and not args.draft:
        ap.error("--adaptive needs --draft")
    common = dict(device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32",
                  max_running_requests=args.max_running_requests, scheduler_delay_factor=args.scheduler_delay_factor)
    spec = dict(draft_model=args.draft, speculative_algorithm="EAGLE3", speculative_num_steps=5,
                speculative_eagle_topk=4, speculative_num_draft_tokens=8)
    engines = [("plain", {})] + ([("fixed", spec)] if args.draft else []) + (
        [("adaptive", dict(spec, speculative_adaptive=True))] if args.adaptive else [])
    runs = {}
    for name, kw in engines:
        llm = LLM(args.model, **common, **kw)
        prompts = prompts_from(args.prompts, llm.engine.tokenizer, args.num_requests, args.prompt_tokens)
        runs[name] = run(name, llm, prompts, args.concurrency, args.max_tokens)
        del llm
    result = {"benchmark": "prefill-share", "device": device_name(args.device), "git_commit": git_commit(),
              "config": vars(args), "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
