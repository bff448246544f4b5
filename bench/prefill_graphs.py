"""Prefill CUDA graphs against eager prefills, per engine kind (DESIGN §4): time to the first token and per request.

Each engine is built twice, with prefill graphs (`cuda_graph_max_prefill_tokens`, default 256) and without (0):
- plain: the target alone; fixed: EAGLE-3 (5, 4, 8), whose prefill also runs the draft's extend; adaptive: the
  same with `speculative_adaptive`.
Three figures per engine, each the median over `--repeats` passes of 40 requests, one request at a time
(`generate`, synchronised before and after):
- first_token_cached_prefix_ms: a 1024-token shared prefix + a 256-token held-out prompt whose pages the prefix
  cache holds (each prompt was sent once before), max_tokens 1: the prefill of its last partial page's ~15 tokens;
- first_token_128_new_ms: 128 new tokens (a first token of each pass's own, so no prefix-cache hit), max_tokens 1;
- request_128_ms: the cached-prefix prompt, 128 output tokens (ignore_eos): the whole request at concurrency 1.
The physical floor beside them (`hbm_floor_us`): the target's weights and the prompt's cached KV read once at the
measured copy bandwidth, what one forward over the prompt must read: the prefill of ~15 tokens is launch-bound far
above it, which graphs remove.

Usage (repo root, GPU): python bench/prefill_graphs.py --model DIR --draft DIR [--repeats 3] [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from spruce import LLM, SamplingParams
from spruce.bench.common import measure_copy_bandwidth, write_result
from spruce.bench.serving import load_prompts

SHARED_PREFIX_TOKENS = 1024
PROMPT_TOKENS = 256
NEW_TOKENS = 128
REQUESTS = 40


def timed(llm: LLM, prompt: list[int], max_tokens: int) -> float:
    """Seconds of one request alone, the device synchronised before and after."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(llm: LLM, cached: list[list[int]], texts: list[str], repeats: int) -> dict:
    tokenizer = llm.engine.tokenizer
    for prompt in cached:  # the prefix cache holds every prompt's full pages from here on
        timed(llm, prompt, 1)
    first, new, whole = [], [], []
    for rep in range(repeats):
        new += [timed(llm, [100 + rep] + tokenizer.encode(t)[:NEW_TOKENS - 1], 1) for t in texts[:REQUESTS]]
        first += [timed(llm, p, 1) for p in cached]
        whole += [timed(llm, p, 128) for p in cached[:REQUESTS // 2]]
    return {"first_token_cached_prefix_ms": round(statistics.median(first) * 1e3, 3),
            "first_token_128_new_ms": round(statistics.median(new) * 1e3, 3),
            "request_128_ms": round(statistics.median(whole) * 1e3, 3),
            "samples": [len(first), len(new), len(whole)], "engine": llm.engine.info()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out-dir", default="bench/results")
    args = ap.parse_args()
    spec = dict(draft_model=args.draft, speculative_algorithm="EAGLE3", speculative_num_steps=5,
                speculative_eagle_topk=4, speculative_num_draft_tokens=8)
    kinds = {"plain": {}, "fixed": spec, "adaptive": dict(spec, speculative_adaptive=True)}
    texts = [json.loads(line)["text"] for line in (Path(args.model) / "heldout_prompts.jsonl").read_text().splitlines()
             if line.strip()]
    figures, cached = {}, None
    bandwidth = measure_copy_bandwidth("cuda")
    for kind, kw in kinds.items():
        for graphs in (True, False):
            llm = LLM(args.model, device="cuda", dtype="bfloat16", max_running_requests=64,
                      cuda_graph_max_prefill_tokens=256 if graphs else 0, **kw)
            if cached is None:
                cached = load_prompts(Path(args.model) / "heldout_prompts.jsonl", PROMPT_TOKENS, llm.engine.tokenizer,
                                      SHARED_PREFIX_TOKENS)[:REQUESTS]
            name = f"{kind}-{'graphs' if graphs else 'eager'}"
            figures[name] = measure(llm, cached, texts, args.repeats)
            read = llm.engine.decode_read_bytes(1, SHARED_PREFIX_TOKENS + PROMPT_TOKENS)  # weights + cached KV
            figures[name]["hbm_floor_us"] = round(read / bandwidth * 1e6, 2)
            print(name, {k: v for k, v in figures[name].items() if k != "engine"}, flush=True)
            del llm
            torch.cuda.empty_cache()
    for kind in kinds:
        graphed, eager = figures[f"{kind}-graphs"], figures[f"{kind}-eager"]
        figures[f"{kind}-ratio"] = {k: round(graphed[k] / eager[k], 3) for k in
                                    ("first_token_cached_prefix_ms", "first_token_128_new_ms", "request_128_ms")}
        print(kind, "graphs / eager:", figures[f"{kind}-ratio"], flush=True)
    config = vars(args) | {"copy_bandwidth_gb_s": round(bandwidth / 1e9, 1), "shared_prefix_tokens": SHARED_PREFIX_TOKENS, "prompt_tokens": PROMPT_TOKENS,
                           "new_tokens": NEW_TOKENS, "requests": REQUESTS, "dtype": "bfloat16"}
    path = write_result("prefill-graphs", "cuda", config, figures, Path(args.out_dir))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
