"""Where an engine's time goes when requests keep arriving (issue 16): on the H100 with the engine in its own
process, a fixed EAGLE-3 server at concurrency 8 committed ~10k tokens/s while its decode rounds alone (launch to
launch, 0.86 ms for 33 tokens) would commit ~38k; a plain server lost far less to whatever lies between its decode
steps. This runs the offline engine the way a server at concurrency C runs it (C requests at once, a new one as
each finishes: `max_running_requests` C, N requests in all), with the phase timer on, and reports per engine its
wall time and each phase's device-side total (CUDA events around the phase: for host-bound launches, their span),
so the prefill's share (target prefill + the draft's extend) is measured, not inferred.

Usage (repo root): python bench/prefill_share.py OUT_JSON --model DIR --prompts FILE [--draft DIR]
    [--concurrency 8] [--num-requests 512] [--max-tokens 128] [--prompt-tokens 128] [--device cuda]
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


def run(name: str, llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:16], params)  # warm-up: compiles, graphs in use
    timer = llm.engine.phase_timer
    timer.reset()
    timer.enabled = True
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    phases = timer.collect()
    timer.enabled = False
    tokens = sum(len(o.token_ids) for o in outs)
    print(f"{name}: {tokens / wall:.0f} tok/s, wall {wall:.2f} s; " + ", ".join(
        f"{k} {v['total_ms'] / 1e3:.2f} s/{v['count']}" for k, v in sorted(phases.items())))
    return {"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall, "phases": phases}


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
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    common = dict(device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32",
                  max_running_requests=args.concurrency)
    spec = dict(draft_model=args.draft, speculative_algorithm="EAGLE3", speculative_num_steps=5,
                speculative_eagle_topk=4, speculative_num_draft_tokens=8)
    runs = {}
    for name, kw in (("plain", {}), ("fixed", spec)):
        if name == "fixed" and not args.draft:
            continue
        llm = LLM(args.model, **common, **kw)
        prompts = prompts_from(args.prompts, llm.engine.tokenizer, args.num_requests, args.prompt_tokens)
        runs[name] = run(name, llm, prompts, args.max_tokens)
        del llm
    result = {"benchmark": "prefill-share", "device": device_name(args.device), "git_commit": git_commit(),
              "config": vars(args), "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
