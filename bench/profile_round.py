"""Profile one speculative round under CUDA graphs at a named shape (random weights), phase by phase.

Each phase's captured graph (bucket 1) is replayed on its own, many times: its GPU time comes from CUDA
events and its kernels (name, count and time per replay) from the torch profiler. The plain decode graph of
a non-speculative engine is timed the same way, so the round/decode ratio here is graph replay vs graph replay.

Usage: python bench/profile_round.py [shape] [S,K,N]  -> prints tables; writes profile_round.json to $OUT if set.
"""

import gc
import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from spruce import LLM, SamplingParams
from spruce.bench.shapes import write_shape_dirs

REPLAYS = 50


def time_graph(graph: torch.cuda.CUDAGraph, replays: int = REPLAYS) -> float:
    """Mean ms of one replay."""
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def kernels_of(graph: torch.cuda.CUDAGraph, replays: int = 10) -> list[dict]:
    """Kernels one replay runs: name, launches and mean microseconds per replay, largest first."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    rows = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type.name == "CUDA":
            rows[e.name][0] += 1
            rows[e.name][1] += e.device_time_total
    out = [{"kernel": k[:90], "per_replay": c / replays, "us_per_replay": t / replays} for k, (c, t) in rows.items()]
    return sorted(out, key=lambda r: -r["us_per_replay"])


def engine(tdir: Path, ddir: Path | None, spec: tuple[int, int, int]) -> LLM:
    kw = dict(device="cuda", dtype="bfloat16", max_running_requests=1, cuda_graph=True, cuda_graph_max_bs=1,
              context_length=512, max_total_tokens=1024, load_format="dummy")
    if ddir is not None:
        s, k, n = spec
        kw.update(draft_model=str(ddir), speculative_num_steps=s, speculative_eagle_topk=k,
                  speculative_num_draft_tokens=n)
    llm = LLM(str(tdir), **kw)
    llm.generate([list(range(100, 228))], SamplingParams(max_tokens=24, ignore_eos=True))  # warm state
    return llm


def main() -> None:
    shape = sys.argv[1] if len(sys.argv) > 1 else "llama-3.1-8b"
    spec = tuple(int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "6,8,32").split(","))
    tdir, ddir = write_shape_dirs(shape, Path(tempfile.mkdtemp()))
    report: dict = {"shape": shape, "spec_S_K_N": spec, "device": torch.cuda.get_device_name()}
    plain = engine(tdir, None, spec)
    graph = plain.engine.runner.graphs.graphs[("decode", 1)][0]
    report["decode_ms"] = time_graph(graph)
    report["decode_kernels"] = kernels_of(graph)
    del plain, graph
    gc.collect()
    torch.cuda.empty_cache()
    llm = engine(tdir, ddir, spec)
    graphs = llm.engine.runner.graphs.graphs
    report["phases"] = {}
    for name in ("draft", "verify", "extend"):
        graph = graphs[(name, 1)][0]
        report["phases"][name] = {"ms": time_graph(graph), "kernels": kernels_of(graph)}
    graph_ms = sum(p["ms"] for p in report["phases"].values())
    report["graphs_ms"] = graph_ms
    report["graphs_over_decode"] = graph_ms / report["decode_ms"]
    print(f"decode graph {report['decode_ms']:.3f} ms; round graphs {graph_ms:.3f} ms "
          f"({report['graphs_over_decode']:.3f}x); " +
          ", ".join(f"{k} {v['ms']:.3f}" for k, v in report["phases"].items()))
    for name, ph in [("decode", {"kernels": report["decode_kernels"]}), *report["phases"].items()]:
        ks = ph["kernels"]
        print(f"--- {name}: {sum(k['per_replay'] for k in ks):.0f} kernels, "
              f"{sum(k['us_per_replay'] for k in ks):.1f} us of kernel time")
        for k in ks[:14]:
            print(f"  {k['us_per_replay']:8.1f} us  x{k['per_replay']:5.1f}  {k['kernel']}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "profile_round.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
