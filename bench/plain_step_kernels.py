"""The device time of a plain decode step, plain engine against adaptive engine, kernel by kernel (issue 16).

Served with the 1k shared prefix at concurrency 1 (H200, 2026-11-23), an adaptive server that ran no round in a pass
still took ~11 us more per token than a plain server, and the difference sat in the time its host waited on the
device. This profiles both engines' decode steps at one request over the shared-prefix prompt (torch.profiler, CUDA
graphs replayed as in serving) and sums the device time of every kernel per decode step, by kernel name.

The host side of the same steps is also taken: the median wall time of `Engine.step` and, from a profile with CPU
activity, each CPU op's and CUDA runtime call's count and self time per step (synchronising calls included; the
profiler inflates `cudaGraphLaunch`, 2.7 us a replay unprofiled). The engines run one after the other, so the spans
carry the machine's drift between them: built side by side and alternated (2026-11-25, H200) the two spans were equal
(DESIGN §16, session 20), and on the H100 at e3014e6 (2026-11-25) the steps took 270.3 and 269.7 us; at c0d4c6f
(2026-11-26, below) 10 us apart (five runs of the adaptive engine, 268-270 us; plain 259-264).

Where the device time goes between kernels: the stream's idle time before each kernel (or copy), summed by name, and
one step's device events in order (name, microseconds, idle before) from the profile; and, unprofiled, CUDA events
recorded right before and after every graph replay: a replay's device span (its kernels and the gaps between them,
which the profiler's kernel sum leaves out) and the stream between replays (the result copy, and any wait for the
host's next launch). On the H100 (2026-11-26, c0d4c6f; results/plain-step-kernels-...-20261126-c0d4c6f.json) the
kernels summed to 253 and 249 us a step, the replays spanned 260 and 270 us, and 6.8 and 7.1 us passed between
them: the adaptive step's extra ~10 us sit inside its graph, between kernels, not in a late launch (its host works
while the previous step runs). Not the 41 more graphs it holds (`--extra-graphs`: a plain engine's replay spanned
263.7, 263.4 and 263.9 us with 0, 100 and 400 more graphs in the process), not the kind of copy that ends the graph
(a D2D memcpy node where an engine built beside another had one; a kernel when built alone; either way the same
span), and not the feature ring (without it the target writes its aux features out: 7 us more kernels and 279 us).

The build order was it (session 53, H100, bench/graph_replays_alone.py, results graph-replays-alone-...): both
engines in one process, their bucket-1 decode graphs replayed alone back to back read the adaptive engine's detached
step 244-248.6 us against the plain engine's 241.1-243.5 when the plain engine was built first (the stream idle 4.8
us longer before its kernels, spread over all 113), and 237.4-241.4 against 238.0-240.3 when the adaptive engine was
built first (twice). This script built the plain engine first until then; it builds the adaptive one first now. A
served adaptive process holds no plain engine.

`--extra-graphs N ...`: then a fresh plain engine's replays, beside its own graphs and after N more (graphs of 201
small kernels) were captured in the process, for each N.

Usage (repo root): python bench/plain_step_kernels.py OUT_JSON --model DIR --draft DIR [--steps 128]
    [--extra-graphs 100 400]
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
    kw = dict(page_size=16, max_running_requests=64, device="cuda", dtype="bfloat16",
              max_total_tokens=getattr(args, "max_total_tokens", None),
              cuda_graph_draws=getattr(args, "cuda_graph_draws", 6))
    if adaptive:
        kw.update(draft_model=args.draft, speculative_num_steps=5, speculative_eagle_topk=4,
                  speculative_num_draft_tokens=8, speculative_adaptive=True)
    llm = LLM(args.model, **kw)
    if adaptive:  # plain steps only: rounds priced out, as the shared-prefix workload prices them
        price_out(llm, SPECULATIVE)
    return llm


def kernels_per_step(llm: LLM, prompt, steps: int) -> tuple[dict, float, float, float, dict, dict, list, dict]:
    engine = llm.engine
    params = SamplingParams(max_tokens=3 * steps + 16, ignore_eos=True, temperature=0.0)
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
    replays = graph_replays(engine, steps)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    engine.abort(rid)
    engine.drain()
    per, idle = collections.Counter(), collections.Counter()
    device_events = sorted((evt for evt in prof.events() if evt.device_type == torch.autograd.DeviceType.CUDA),
                           key=lambda evt: evt.time_range.start)
    previous_end = None
    for evt in device_events:
        per[evt.name[:90]] += evt.device_time_total
        if previous_end is not None:  # the stream's idle time before this kernel (or copy), by its name
            idle[evt.name[:90]] += max(evt.time_range.start - previous_end, 0)
        previous_end = max(previous_end or 0, evt.time_range.end)
    total = sum(per.values()) / steps
    host_ops = {}
    for avg in prof.key_averages():
        if avg.device_type == torch.autograd.DeviceType.CPU and avg.self_cpu_time_total > 0:
            host_ops[avg.key[:90]] = (round(avg.count / steps, 2), round(avg.self_cpu_time_total / steps, 2))
    host_ops = dict(sorted(host_ops.items(), key=lambda kv: -kv[1][1])[:60])
    idle_per_step = {k: v / steps for k, v in idle.most_common()}
    one = len(device_events) // steps  # one step's kernels in order (from the middle): name, us, idle us before
    middle = device_events[(steps // 2) * one:(steps // 2 + 1) * one + 1]
    sequence = [(a.name[:60], round(a.device_time_total, 2), round(a.time_range.start - b.time_range.end, 2))
                for b, a in zip(middle, middle[1:])]
    return {k: v / steps for k, v in per.most_common()}, total, span, statistics.median(walls) * 1e6, host_ops, \
        idle_per_step, sequence, replays


def graph_replays(engine, steps: int) -> dict:
    """Unprofiled, from CUDA events recorded right before and after every graph replay of `steps` steps: the
    median device microseconds of a replay (its kernels and the gaps between them) and of the stream between one
    replay's end and the next one's start (the step's result copy, and any wait for the host's next launch)."""
    marks = []
    replay = torch.cuda.CUDAGraph.replay

    def timed(graph):
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        replay(graph)
        after.record()
        marks.append((before, after))

    torch.cuda.CUDAGraph.replay = timed
    try:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    finally:
        torch.cuda.CUDAGraph.replay = replay
    inside = [b.elapsed_time(a) * 1e3 for b, a in marks]
    between = [a.elapsed_time(b) * 1e3 for (_, a), (b, _) in zip(marks, marks[1:])]
    return {"replays_per_step": len(marks) / steps, "replay_us_median": round(statistics.median(inside), 2),
            "between_replays_us_median": round(statistics.median(between), 2)}


def capture_dummy_graphs(held: list, total: int) -> None:
    """Capture graphs of 201 small elementwise kernels each until `held` (kept alive) holds `total` of them."""
    x = torch.zeros(1024, device="cuda")

    def work():
        y = x + 1
        for _ in range(100):
            y = y * 1.0001 + 0.5
        return y

    side = torch.cuda.Stream()
    while len(held) < total:
        with torch.cuda.stream(side):
            work()  # warm-up off the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = work()
        graph.replay()
        held.append((graph, out))
    torch.cuda.synchronize()


def with_extra_graphs(args) -> dict:
    """The plain engine's decode replay (`graph_replays`) beside its own graphs, then after each of
    `args.extra_graphs` more graphs were captured in the process: does the number of graphs a process holds
    lengthen every replay?"""
    llm = build(False, args)
    prompt = load_prompts(Path(args.model) / "heldout_prompts.jsonl", 256, llm.engine.tokenizer, 1024)[0]
    held: list = []
    out = {}
    for extra in [0, *args.extra_graphs]:
        capture_dummy_graphs(held, extra)
        *_, replays = kernels_per_step(llm, prompt, args.steps)
        out[str(extra)] = replays
        print(f"plain engine ({llm.engine.info()['cuda_graphs_captured']} graphs) + {extra} more graphs: {replays}",
              flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--extra-graphs", type=int, nargs="*", default=[],
                    help="then the plain engine's replays after this many more graphs were captured (each count)")
    args = ap.parse_args()
    figures = {}
    for name in ("adaptive", "plain"):  # the adaptive engine first: built after a plain one in the same process, its
        llm = build(name == "adaptive", args)  # detached step's graph replayed ~4 us slower (graph_replays_alone.py)
        prompt = load_prompts(Path(args.model) / "heldout_prompts.jsonl", 256, llm.engine.tokenizer, 1024)[0]
        per, total, span, host, host_ops, idle, sequence, replays = kernels_per_step(llm, prompt, args.steps)
        figures[name] = {"cuda_graphs": int(llm.engine.info()["cuda_graphs_captured"]),
                         "device_us_per_step": round(total, 2), "stream_span_us_per_step": round(span, 2),
                         "engine_step_wall_us_median": round(host, 2),
                         "kernels_us_per_step": {k: round(v, 2) for k, v in per.items()},
                         "idle_us_before_kernel_per_step": {k: round(v, 2) for k, v in idle.items()},
                         "one_step_device_events": sequence, "graph_replays": replays,
                         "host_ops_per_step": {k: {"count": c, "self_us": t} for k, (c, t) in host_ops.items()}}
        print(name, f"({figures[name]['cuda_graphs']} graphs)", "kernel us per decode step", round(total, 2),
              "stream span us per step", round(span, 2), "Engine.step wall us (median)", round(host, 2),
              "graph replays (unprofiled)", replays, flush=True)
        del llm
        torch.cuda.empty_cache()
    a, p = figures["adaptive"]["kernels_us_per_step"], figures["plain"]["kernels_us_per_step"]
    diff = {k: round(a.get(k, 0.0) - p.get(k, 0.0), 2) for k in set(a) | set(p)}
    figures["adaptive_minus_plain_us"] = dict(sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:25])
    for k, v in list(figures["adaptive_minus_plain_us"].items())[:12]:
        print(f"{v:+8.2f} us  {k}")
    a, p = figures["adaptive"]["idle_us_before_kernel_per_step"], figures["plain"]["idle_us_before_kernel_per_step"]
    idle_diff = {k: round(a.get(k, 0.0) - p.get(k, 0.0), 2) for k in set(a) | set(p)}
    figures["idle_adaptive_minus_plain_us"] = dict(sorted(idle_diff.items(), key=lambda kv: -abs(kv[1]))[:25])
    print("stream idle us per step before each kernel: plain", round(sum(p.values()), 2), "adaptive",
          round(sum(a.values()), 2))
    for k, v in list(figures["idle_adaptive_minus_plain_us"].items())[:12]:
        print(f"idle {v:+8.2f} us  {k}")
    a, p = figures["adaptive"]["host_ops_per_step"], figures["plain"]["host_ops_per_step"]
    zero = {"count": 0.0, "self_us": 0.0}
    host_diff = {k: {f: round(a.get(k, zero)[f] - p.get(k, zero)[f], 2) for f in zero} for k in set(a) | set(p)}
    figures["host_adaptive_minus_plain"] = dict(sorted(host_diff.items(), key=lambda kv: -abs(kv[1]["self_us"]))[:30])
    for k, v in list(figures["host_adaptive_minus_plain"].items())[:20]:
        print(f"host {v['self_us']:+8.2f} us {v['count']:+6.2f} calls  {k}")
    if args.extra_graphs:
        figures["plain_with_extra_graphs"] = with_extra_graphs(args)
    Path(args.out).write_text(json.dumps({"device": device_name("cuda"), "git_commit": git_commit(),
                                          "config": vars(args), "figures": figures}, indent=1))


if __name__ == "__main__":
    main()
