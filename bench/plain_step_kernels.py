"""The device time of a plain decode step, plain engine against adaptive engine, kernel by kernel (issue 16).

Served with the 1k shared prefix at concurrency 1 (H200, 2026-11-23), an adaptive server that ran no round in a pass
still took ~11 us more per token than a plain server, and the difference sat in the time its host waited on the
device. This profiles both engines' decode steps at one request over the shared-prefix prompt (torch.profiler, CUDA
graphs replayed as in serving) and sums the device time of every kernel per decode step, by kernel name.

The host side of the same steps is also taken: the median wall time of `Engine.step` and, from a profile with CPU
activity, each CPU op's and CUDA runtime call's count and self time per step (synchronising calls included; the
profiler inflates `cudaGraphLaunch`, 2.7 us a replay unprofiled). The engines run one after the other, so the spans
carry the machine's drift between them: built side by side and alternated (2026-11-25, H200) the two spans were equal
(DESIGN §16, session 20).

Usage (repo root): python bench/plain_step_kernels.py OUT_JSON --model DIR --draft DIR [--steps 128]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from spruce import LLM, SamplingParams
from spruce.bench.common import device_name, git_commit, price_out
from spruce.bench.serving import load_prompts
from spruce.speculative.adaptive_policy import SPECULATIVE


def build(adaptive: bool, args) -> LLM:
    kw = dict(page_size=16, max_running_requests=64, device="cuda", dtype="bfloat16")
    if adaptive:
        kw.update(draft_model=args.draft, speculative_num_steps=5, speculative_eagle_topk=4,
                  speculative_num_draft_tokens=8, speculative_adaptive=True)
    llm = LLM(args.model, **kw)
    if adaptive:  # plain steps only: rounds priced out, as the shared-prefix workload prices them
        price_out(llm, SPECULATIVE)
    return llm


def kernels_per_step(llm: LLM, prompt, steps: int) -> tuple[dict, float, float, float, dict]:
    engine = llm.engine
    params = SamplingParams(max_tokens=2 * steps + 16, ignore_eos=True, temperature=0.0)
    for _ in range(2):
        llm.generate([prompt], params)  # warm: the prompt's pages cached, graphs replayed
    rid = engine.add_request(prompt, params)
    for _ in range(4):  # prefill and the first decode steps
        engine.step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    walls = []
    start.record()
    for _ in range(steps):  # unprofiled: the stream's span per step (device-bound at one request)
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
    end.record()
    torch.cuda.synchronize()
    span = start.elapsed_time(end) * 1e3 / steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    engine.abort(rid)
    engine.drain()
    per = collections.Counter()
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            per[evt.name[:90]] += evt.device_time_total
    total = sum(per.values()) / steps
    host_ops = {}
    for avg in prof.key_averages():
        if avg.device_type == torch.autograd.DeviceType.CPU and avg.self_cpu_time_total > 0:
            host_ops[avg.key[:90]] = (round(avg.count / steps, 2), round(avg.self_cpu_time_total / steps, 2))
    host_ops = dict(sorted(host_ops.items(), key=lambda kv: -kv[1][1])[:60])
    return {k: v / steps for k, v in per.most_common()}, total, span, statistics.median(walls) * 1e6, host_ops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--steps", type=int, default=96)
    args = ap.parse_args()
    figures = {}
    for name in ("plain", "adaptive"):
        llm = build(name == "adaptive", args)
        prompt = load_prompts(Path(args.model) / "heldout_prompts.jsonl", 256, llm.engine.tokenizer, 1024)[0]
        per, total, span, host, host_ops = kernels_per_step(llm, prompt, args.steps)
        figures[name] = {"device_us_per_step": round(total, 2), "stream_span_us_per_step": round(span, 2),
                         "engine_step_wall_us_median": round(host, 2),
                         "kernels_us_per_step": {k: round(v, 2) for k, v in per.items()},
                         "host_ops_per_step": {k: {"count": c, "self_us": t} for k, (c, t) in host_ops.items()}}
        print(name, "kernel us per decode step", round(total, 2), "stream span us per step", round(span, 2),
              "Engine.step wall us (median)", round(host, 2), flush=True)
        del llm
        torch.cuda.empty_cache()
    a, p = figures["adaptive"]["kernels_us_per_step"], figures["plain"]["kernels_us_per_step"]
    diff = {k: round(a.get(k, 0.0) - p.get(k, 0.0), 2) for k in set(a) | set(p)}
    figures["adaptive_minus_plain_us"] = dict(sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:25])
    for k, v in list(figures["adaptive_minus_plain_us"].items())[:12]:
        print(f"{v:+8.2f} us  {k}")
    a, p = figures["adaptive"]["host_ops_per_step"], figures["plain"]["host_ops_per_step"]
    zero = {"count": 0.0, "self_us": 0.0}
    host_diff = {k: {f: round(a.get(k, zero)[f] - p.get(k, zero)[f], 2) for f in zero} for k in set(a) | set(p)}
    figures["host_adaptive_minus_plain"] = dict(sorted(host_diff.items(), key=lambda kv: -abs(kv[1]["self_us"]))[:30])
    for k, v in list(figures["host_adaptive_minus_plain"].items())[:20]:
        print(f"host {v['self_us']:+8.2f} us {v['count']:+6.2f} calls  {k}")
    Path(args.out).write_text(json.dumps({"device": device_name("cuda"), "git_commit": git_commit(),
                                          "config": vars(args), "figures": figures}, indent=1))


if __name__ == "__main__":
    main()
