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
(`Engine.step` in a loop, CUDA events around every graph replay: bench/plain_step_kernels.py's `graph_replays`), and
its graph replayed alone again over that request's row (the long KV of a served request with the shared prefix).
`--max-total-tokens`, `--ballast-graphs`, `--ballast-mb` and `--recapture` change where the process's memory lands
and nothing it computes.

Found with them (session 54, 2026-11-28, H100 x1, four machines; results/graph-replays-one-engine-...-20261128.json):
the step's device time depends on where the process's memory lands, by more than the gap served at concurrency 1
(+1.5 +- 0.5% decode phase, ~4 us a token), and the sign of the difference between the two engines' graphs follows
the machine, not the engine. Over the request's 1.3k positions, on one machine (M2, 8 processes of each, two pool
sizes) the plain graph replayed in 268.9-270.0 us and the adaptive one in 281.8-283.3, every time: the same 113
kernels, busy 253.5-255.6 us in both, the stream idle 34.5-39 us before them against 44.8-50.1, spread over every
kernel (+0.1-0.2 us each, GEMMs, norms and copies alike); over the short KV there the two replayed alike (238.8-242.9
us). On another (M3) the plain graph was the slower one, 289.9 against 286.8, and the same plain engine replayed in
278.5 us after 256 MiB were allocated before it was built, 281.4 after 60 small graphs were captured first; the
adaptive one in 277.4 once its graphs were captured again after the engine was built; with CUDA_MODULE_LOADING=EAGER
291.7 (plain) and 282.1 (adaptive); over the short KV 240-251 us across those variants. On a fourth (M4) the adaptive
graph was the slower over both (291.0 against 286.6 long, 251.7 against 239.9 short). What the kernels compute is the
same; the gaps between them move with placement (a 38 MB model whose weights and KV come near the H100's 50 MB L2;
why the gaps and not the kernels, not shown). A served adaptive process allocates in another order and other sizes
than a plain one (the draft, its pool, the ring, the verify scratch in the target's pool), so its graphs land
elsewhere: on the machines of the eight H100 x4 bar runs, a few microseconds worse.

Usage (repo root, CUDA): python bench/graph_replays_alone.py --model DIR --draft DIR [--order adaptive-first]
    [--repeats 3] [--max-total-tokens N] [--ballast-graphs N] [--ballast-mb N] [--recapture] [--cuda-graph-draws N]
    [--rerolls N] [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

if str(Path(__file__).resolve().parent) not in sys.path:  # its sibling
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from plain_step_kernels import build, capture_dummy_graphs, graph_replays  # noqa: E402  (its engines, its helpers)
from spruce import SamplingParams  # noqa: E402
from spruce.bench.common import write_result  # noqa: E402
from spruce.bench.serving import load_prompts  # noqa: E402
from spruce.runtime.graph_draws import stream_seconds  # noqa: E402

REPLAYS = 200  # per timed repetition
PROFILED = 30  # replays under the profiler


def stream_us(run, count: int) -> float:
    """The stream's microseconds per call of `run`, `count` calls back to back between two events."""
    torch.cuda.synchronize()
    return stream_seconds(run, count, torch.device("cuda")) * 1e6


def replay_us(graph: torch.cuda.CUDAGraph) -> float:
    """Microseconds a replay of `graph`, REPLAYS of them back to back between two events."""
    return stream_us(graph.replay, REPLAYS)


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


def stepping(llm, graph: torch.cuda.CUDAGraph, args, steps: int = 96) -> dict:
    """The engine's own decode steps at one request over a 1k-token prompt (warmed twice: its pages cached), CUDA
    events around every graph replay (`graph_replays`), then the stream's span per step, `args.repeats` times; then,
    the request still holding its row, its graph replayed alone (`replay_us`, `profiled`) over that row: the same
    replays as the first ones over the long KV instead of a short one, without the engine's host work between them.
    (They advance the row's device state past what the host knows and write KV past its reserved pages, where the
    page table points at the dummy page; the request is aborted right after.)"""
    engine = llm.engine
    prompt = load_prompts(Path(args.model) / "heldout_prompts.jsonl", 256, engine.tokenizer, 1024)[0]
    params = SamplingParams(max_tokens=(args.repeats + 1) * steps + 16, ignore_eos=True, temperature=0.0)
    for _ in range(2):
        llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0))
    rid = engine.add_request(prompt, params)
    for _ in range(4):  # prefill and the first decode steps
        engine.step()
    replays = graph_replays(engine, steps)
    spans = [round(stream_us(engine.step, steps), 2) for _ in range(args.repeats)]
    pages = engine.runner.page_table.table[engine.requests[rid].row].tolist()
    pages = pages[:engine.limits.pages_for(engine.requests[rid].committed)]
    alone = [round(replay_us(graph), 2) for _ in range(args.repeats)]
    profile = profiled(graph)
    rerolled = rerolls(llm, rid, args) if args.rerolls else None
    engine.abort(rid)
    engine.drain()
    runs = 1 + sum(b != a + 1 for a, b in zip(pages, pages[1:]))
    return {**replays, "span_us_per_step": spans, "replay_us_alone_long_kv": alone, "profile_alone_long_kv": profile,
            "pages": {"count": len(pages), "first": pages[:4], "last": pages[-4:], "contiguous_runs": runs,
                      "pool_pages": engine.limits.num_pages}, "rerolls_long_kv": rerolled}


def rerolls(llm, rid: str, args) -> dict:
    """The engine's graphs captured `args.rerolls` more times (each capture in a fresh memory pool, every earlier
    graph kept alive, so each lands elsewhere), then every bucket-1 graph so far replayed alone, in turn,
    `args.repeats` rounds: over the dummy row (what a start-up measure could time) and over the held request's row
    from its first 256, 640 and all its positions (the same state each time): whether a capture's replay time is a
    draw of its placement, how far apart the draws lie, and whether the rank of the draws holds across KV lengths."""
    engine = llm.engine
    runner = engine.runner
    capturer = engine.strategy.detached_plain if engine.speculative else engine.strategy
    phase = "decode_detached" if engine.speculative else "decode"
    graphs = [runner.graphs.graphs[(phase, 1)][0]]
    held = []
    for _ in range(args.rerolls):
        held.append(dict(runner.graphs.graphs))
        capturer.capture_graphs(False)
        graphs.append(runner.graphs.graphs[(phase, 1)][0])
    row = engine.requests[rid].row
    row_t = torch.tensor([row], device=runner.device)
    saved = [t.clone() for t in runner.row_state.gather(row_t)]

    lengths = {"dummy": None, "kv_256": 256, "kv_640": 640, "long_kv": int(saved[0].item())}

    def over(graph, length: int | None) -> float:
        capturer.rows[0] = runner.limits.dummy_row if length is None else row
        if length is not None:  # the row's first `length` positions (their KV is there): from the same state
            runner.row_state.set(row_t, torch.full_like(saved[0], length), saved[1])
        return round(replay_us(graph), 2)

    rounds = {kind: [] for kind in lengths}
    for k in range(args.repeats):
        order = list(range(len(graphs)))[k % len(graphs):] + list(range(len(graphs)))[:k % len(graphs)]
        for kind, length in lengths.items():
            times = {i: over(graphs[i], length) for i in order}
            rounds[kind].append([times[i] for i in range(len(graphs))])
    capturer.rows[0] = row
    runner.row_state.set(row_t, *saved)
    capturer._filled_rows = None
    medians = {kind: [statistics.median(r[i] for r in rs) for i in range(len(graphs))] for kind, rs in rounds.items()}
    print(f"rerolls, per capture (median of {args.repeats}), us: {medians}")
    return {"rounds_us": rounds, "median_us": medians}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--order", choices=("plain-first", "adaptive-first", "plain-only", "adaptive-only"),
                    default="plain-first")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-total-tokens", type=int, default=None,
                    help="the KV pool's tokens (default: sized from free memory, as a server's)")
    ap.add_argument("--ballast-graphs", type=int, default=0,
                    help="capture this many small graphs (201 kernels each) before building the engines")
    ap.add_argument("--ballast-mb", type=int, default=0, help="allocate this many MiB before building the engines")
    ap.add_argument("--recapture", action="store_true",
                    help="capture the engines' bucket-1 decode graphs again once they are built (the last graphs "
                         "instantiated in the process)")
    ap.add_argument("--cuda-graph-draws", type=int, default=6,
                    help="the engines' cuda_graph_draws (1: each keeps its first capture of the bucket-1 graph)")
    ap.add_argument("--rerolls", type=int, default=0,
                    help="with plain-only / adaptive-only: capture the graphs this many more times, the earlier ones "
                         "kept, and replay each capture's bucket-1 graph over the long KV (`rerolls`; with "
                         "--cuda-graph-draws 1, else each capture keeps the fastest of its own draws)")
    ap.add_argument("--out-dir", default="bench/results")
    args = ap.parse_args()
    names = {"plain-first": ("plain", "adaptive"), "adaptive-first": ("adaptive", "plain"),
             "plain-only": ("plain",), "adaptive-only": ("adaptive",)}[args.order]
    ballast = [torch.empty(args.ballast_mb << 20, dtype=torch.uint8, device="cuda")] if args.ballast_mb else []
    capture_dummy_graphs(ballast, len(ballast) + args.ballast_graphs)
    llms = {name: build(name == "adaptive", args) for name in names}
    if args.recapture:
        for name, llm in llms.items():
            strategy = llm.engine.strategy
            (strategy.detached_plain if name == "adaptive" else strategy).capture_graphs(False)
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
        figures["stepping"] = {name: stepping(llm, graphs[name], args) for name, llm in llms.items()}
        for name, fig in figures["stepping"].items():
            prof = fig["profile_alone_long_kv"]
            print(f"{name} stepping over a 1k-token prompt: replay (median) {fig['replay_us_median']} us, between "
                  f"{fig['between_replays_us_median']}, span a step {fig['span_us_per_step']}; then alone "
                  f"{fig['replay_us_alone_long_kv']} us, busy {prof['busy_us']}, idle {prof['idle_us']}; "
                  f"pages {fig['pages']}")
    for name in graphs:
        prof = figures["profile"][name]
        print(f"{name}: replay {times[name]} us; per replay {prof['events_per_replay']:.0f} events, busy "
              f"{prof['busy_us']} us, idle before them {prof['idle_us']} us")
    config = {"model": args.model, "draft": args.draft, "order": args.order, "repeats": args.repeats,
              "max_total_tokens": args.max_total_tokens, "ballast_graphs": args.ballast_graphs,
              "ballast_mb": args.ballast_mb, "recapture": args.recapture, "rerolls": args.rerolls,
              "cuda_graph_draws": args.cuda_graph_draws,
              "replays": REPLAYS, "profiled_replays": PROFILED}
    print(f"results: {write_result('graph-replays-alone', 'cuda', config, figures, Path(args.out_dir))}")


if __name__ == "__main__":
    main()
