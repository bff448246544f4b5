"""Per request, what an adaptive engine costs beside a plain one on the shared-prefix workload, offline (issue 16).

Served on the H100 with a 1k-token shared prefix at concurrency 1, an adaptive server that decoded plainly for 99% of
its steps trailed a plain server by 5-8% (TTFT +1.5-2 ms, and more host time per launch). This program takes the
HTTP server, the engine process's pipe and the client out: engines in one process, the same prompts (the bench's
shared-prefix prompts, `spruce.bench.serving.load_prompts`), one request at a time, engines alternating by block.

Per request (medians over the timed requests, milliseconds):
- `ttft`: `add_request` until the `Engine.step` that returns its first token has returned (under overlap, two
  steps: the prefill's launch, then the first decode's launch with the prefill's resolve);
- `prefill_step` / `first_decode_step`: those two steps' wall times;
- `decode_step`: the mean wall time of its later steps; `e2e`: until its last output;
- `steps`, `rounds`: its decode launches and how many were speculative rounds (adaptive's probes).
On a GPU the engine is device-bound offline at concurrency 1 (a plain step's graph outlasts its host work), so
host costs that a served engine pays show up here only where they sit in TTFT's two steps; `host_per_launch_ms`
(Engine.stats' launch + resolve + outputs per launch, the host's own work, waits excluded) shows them all, and
`launch_per_launch` its launch part alone (what the served engines differ by most).

`plain_alone`: the plain engine's requests timed before the adaptive engine is built, so before its draft, its
CUDA graphs and its memory are in the process: beside `plain` (timed with the adaptive engine alive, alternating
with it), whether a process that holds an adaptive engine runs a plain engine's host work slower.

Usage (repo root): python bench/adaptive_request_latency.py OUT_JSON [--model DIR] [--draft DIR] [--device cuda]
    [--requests 48] [--block 8] [--max-tokens 128] [--shared-prefix-tokens 1024] [--prompt-tokens 256]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from spruce import LLM, SamplingParams
from spruce.bench.common import device_name, git_commit
from spruce.bench.serving import load_prompts
from spruce.config import builtin_model_path

ENGINES = ("plain", "adaptive")


def build(name: str, args) -> LLM:
    kw = dict(page_size=16, max_running_requests=8, device=args.device, context_length=2048)
    if args.device == "cuda":
        kw.update(dtype="bfloat16")
    if name == "adaptive":
        kw.update(draft_model=args.draft, speculative_num_steps=5, speculative_eagle_topk=4,
                  speculative_num_draft_tokens=8, speculative_adaptive=True)
    return LLM(args.model, **kw)


def serve_one(engine, prompt, params: SamplingParams) -> dict:
    """Run one request alone to its end; its timings (seconds) and step counts."""
    before = engine.stats()["steps"]
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, params)
    step_ends, first, done = [], None, None
    while done is None:
        outputs = engine.step()
        now = time.perf_counter()
        step_ends.append(now)
        for out in outputs:
            if out.request_id != rid:
                continue
            if first is None and out.token_ids:
                first = len(step_ends)
            if out.finished:
                done = len(step_ends)
    engine.drain()
    after = engine.stats()["steps"]
    walls = [b - a for a, b in zip([t0] + step_ends, step_ends)]
    later = walls[first:done]
    host = sum(after["seconds"][k] - before["seconds"][k] for k in ("launch", "resolve", "outputs"))
    launch = after["seconds"]["launch"] - before["seconds"]["launch"]
    launches = after["decodes"] + after["prefills"] - before["decodes"] - before["prefills"]
    return {"ttft": step_ends[first - 1] - t0, "prefill_step": walls[0],
            "first_decode_step": walls[1] if len(walls) > 1 else 0.0,
            "decode_step": statistics.fmean(later) if later else 0.0, "e2e": step_ends[done - 1] - t0,
            "steps": after["decodes"] - before["decodes"], "rounds": after["rounds"] - before["rounds"],
            "host_per_launch": host / max(launches, 1), "launch_per_launch": launch / max(launches, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default=str(builtin_model_path()))
    ap.add_argument("--draft", default="bench/assets/pycode-19m-eagle3")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=48, help="timed requests per engine")
    ap.add_argument("--block", type=int, default=8, help="requests per engine before the other engine's turn")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--shared-prefix-tokens", type=int, default=1024)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    args = ap.parse_args()
    plain = build("plain", args)
    prompts = load_prompts(Path(args.model) / "heldout_prompts.jsonl", args.prompt_tokens, plain.engine.tokenizer,
                           args.shared_prefix_tokens)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)

    def warm(llm: LLM) -> None:  # every prompt seen twice: its pages are in the prefix cache (adaptive: a lazy
        for _ in range(2):  # prompt enters it the second time), as in a serving run's later passes
            for p in prompts[: args.requests]:
                serve_one(llm.engine, p, params)

    warm(plain)
    samples = {"plain_alone": [serve_one(plain.engine, prompts[i % len(prompts)], params)
                               for i in range(args.requests)]}
    llms = {"plain": plain, "adaptive": build("adaptive", args)}
    warm(llms["adaptive"])
    samples |= {name: [] for name in ENGINES}
    for start in range(0, args.requests, args.block):
        for name, llm in llms.items():
            for i in range(start, min(start + args.block, args.requests)):
                samples[name].append(serve_one(llm.engine, prompts[i % len(prompts)], params))
    figures = {}
    for name, rows in samples.items():
        figures[name] = {k: round(statistics.median(r[k] for r in rows) * (1e3 if k not in ("steps", "rounds") else 1),
                                  4) for k in rows[0]}
        figures[name]["rounds_total"] = sum(r["rounds"] for r in rows)
        print(name, json.dumps(figures[name]), flush=True)
    keys = ("ttft", "prefill_step", "first_decode_step", "decode_step", "e2e", "host_per_launch", "launch_per_launch")
    for a, b in (("adaptive", "plain"), ("plain", "plain_alone")):
        figures[f"{a}_minus_{b}_ms"] = diff = {k: round(figures[a][k] - figures[b][k], 4) for k in keys}
        print(f"{a} - {b} (ms):", json.dumps(diff))
    Path(args.out).write_text(json.dumps({"device": device_name(args.device), "git_commit": git_commit(),
                                          "config": vars(args), "unit": "milliseconds (medians over requests)",
                                          "figures": figures}, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
