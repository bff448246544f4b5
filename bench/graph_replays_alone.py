"""The bucket-1 decode graph of a plain engine and the adaptive engine's detached plain step (`decode_detached`),
replayed alone back to back on the stream (issue 16): how long a replay takes with no host in the way, and, under
torch.profiler, each kernel's time and the stream's idle before it, per replay, by name.

Both engines live in one process (page size 16, 64 rows, bf16; the adaptive one at S=5 K=4 N=8 with rounds priced
out, so its requests detach), each runs one 64-token request first (real rows in the graphs' static inputs), then
each graph replays 200 times per repetition between two CUDA events. `--order` picks which engine is built first.
On the H100 (2026-11-27, session 53) the build order decided it: plain first, the adaptive engine's graph replayed
244-248.6 us against 241.1-243.5 (the same 113 kernels, the stream idle 4.8 us longer before them, spread over all);
adaptive first, 237.4-241.4 against 238.0-240.3, twice. bench/plain_step_kernels.py and bench/adaptive_hooks.py built
the plain engine first until then and read ~10 us a step and ~5% at concurrency 1 against the adaptive engine.

`--order plain-only` / `adaptive-only`: one engine in the process, as a server holds it (run each in fresh processes,
alternately, to compare the two graphs across processes); then also its steps over a request with a 1k-token prompt
(`Engine.step` in a loop, CUDA events around every graph replay: bench/plain_step_kernels.py's `graph_replays`).

Usage (repo root, CUDA): python bench/graph_replays_alone.py --model DIR --draft DIR [--order adaptive-first]
    [--repeats 3] [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

if str(Path(__file__).resolve().parent) not in sys.path:  # its sibling
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from plain_step_kernels import build, graph_replays  # noqa: E402  (the engines as plain_step_kernels.py builds them)
from spruce import SamplingParams  # noqa: E402
from spruce.bench.common import write_result  # noqa: E402
from spruce.bench.serving import load_prompts  # noqa: E402

REPLAYS = 200  # per timed repetition
PROFILED = 30  # replays under the profiler


def replay_us(graph: torch.cuda.CUDAGraph) -> float:
    """Microseconds a replay of `graph`, REPLAYS of them back to back between two events."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / REPLAYS


def profiled(graph: torch.cuda.CUDAGraph) -> dict:
    """Per replay: its device events, their busy microseconds, the stream's idle before them, and both by name."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED):
            graph.replay()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    busy, idle = collections.Counter(), collections.Counter()
    last = None
    for e in events:
        busy[e.name[:70]] += e.time_range.elapsed_us() / PROFILED
        if last is not None:
            idle[e.name[:70]] += max(e.time_range.start - last, 0) / PROFILED
        last = e.time_range.end
    return {"events_per_replay": len(events) / PROFILED, "busy_us": round(sum(busy.values()), 2),
            "idle_us": round(sum(idle.values()), 2),
            "by_name": {name: {"busy_us": round(busy[name], 2), "idle_us": round(idle[name], 2)} for name in busy}}


def stepping(llm, args, steps: int = 96) -> dict:
    """The engine's own decode steps at one request over a 1k-token prompt (warmed twice: its pages cached), CUDA
    events around every graph replay (`graph_replays`), then the stream's span per step, `args.repeats` times."""
    engine = llm.engine
    prompt = load_prompts(Path(args.model) / "heldout_prompts.jsonl", 256, engine.tokenizer, 1024)[0]
    params = SamplingParams(max_tokens=(args.repeats + 1) * steps + 16, ignore_eos=True, temperature=0.0)
    for _ in range(2):
        llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0))
    rid = engine.add_request(prompt, params)
    for _ in range(4):  # prefill and the first decode steps
        engine.step()
    replays = graph_replays(engine, steps)
    spans = []
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            engine.step()
        end.record()
        end.synchronize()
        spans.append(round(start.elapsed_time(end) * 1e3 / steps, 2))
    engine.abort(rid)
    engine.drain()
    return {**replays, "span_us_per_step": spans}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--order", choices=("plain-first", "adaptive-first", "plain-only", "adaptive-only"),
                    default="plain-first")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out-dir", default="bench/results")
    args = ap.parse_args()
    names = {"plain-first": ("plain", "adaptive"), "adaptive-first": ("adaptive", "plain"),
             "plain-only": ("plain",), "adaptive-only": ("adaptive",)}[args.order]
    llms = {name: build(name == "adaptive", args) for name in names}
    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0)
    for llm in llms.values():
        llm.generate(["def fib(n):\n    " * 20], params)
    phases = {"plain": "decode", "adaptive": "decode_detached"}
    graphs = {name: llm.engine.runner.graphs.graphs[(phases[name], 1)][0] for name, llm in llms.items()}
    times = {name: [] for name in graphs}
    for _ in range(args.repeats):
        for name, graph in graphs.items():
            times[name].append(round(replay_us(graph), 2))
    figures = {"replay_us": times, "profile": {name: profiled(graph) for name, graph in graphs.items()}}
    if len(llms) == 1:
        figures["stepping"] = {name: stepping(llm, args) for name, llm in llms.items()}
        print(f"stepping over a 1k-token prompt: {figures['stepping']}")
    for name in graphs:
        prof = figures["profile"][name]
        print(f"{name}: replay {times[name]} us; per replay {prof['events_per_replay']:.0f} events, busy "
              f"{prof['busy_us']} us, idle before them {prof['idle_us']} us")
    config = {"model": args.model, "draft": args.draft, "order": args.order, "repeats": args.repeats,
              "replays": REPLAYS, "profiled_replays": PROFILED}
    print(f"results: {write_result('graph-replays-alone', 'cuda', config, figures, Path(args.out_dir))}")


if __name__ == "__main__":
    main()
