"""Profile one speculative round at a named shape (random weights): GPU kernel time and count per phase.

Usage: python bench/profile_round.py [shape] [S,K,N]  -> prints a table; writes profile JSON to $OUT if set.
"""

import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from spruce import LLM, SamplingParams
from spruce.bench.shapes import write_shape_dirs

shape = sys.argv[1] if len(sys.argv) > 1 else "llama-3.1-8b"
s, k, n = (int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "6,8,32").split(","))
tmp = tempfile.mkdtemp()
tdir, ddir = write_shape_dirs(shape, Path(tmp))
llm = LLM(str(tdir), device="cuda", dtype="bfloat16", draft_model=str(ddir), speculative_num_steps=s,
          speculative_eagle_topk=k, speculative_num_draft_tokens=n, max_running_requests=1, cuda_graph=False,
          context_length=512, max_total_tokens=1024, load_format="dummy")
w = llm.engine.worker
for name in ("_draft_phase", "_verify_phase", "_extend_phase"):
    fn = getattr(w, name)

    def wrapped(*a, _fn=fn, _name=name):
        with record_function(_name):
            return _fn(*a)

    setattr(w, name, wrapped)
prompt = list(range(100, 228))
llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))
events = prof.events()


def launches(e) -> int:
    own = 1 if ("LaunchKernel" in e.name or "cuLaunch" in e.name) else 0
    return own + sum(launches(c) for c in e.cpu_children)


summary = defaultdict(lambda: {"device_ms": 0.0, "launches": 0, "calls": 0})
for e in events:
    if e.name in ("_draft_phase", "_verify_phase", "_extend_phase"):
        summary[e.name]["device_ms"] += getattr(e, "device_time_total", 0.0) / 1e3
        summary[e.name]["launches"] += launches(e)
        summary[e.name]["calls"] += 1
rounds = llm.engine.spec_stats.rounds
for name, v in summary.items():
    print(f"{name:14s} calls {v['calls']:3d}  device {v['device_ms'] / v['calls']:.3f} ms/call  "
          f"launches {v['launches'] / v['calls']:.0f}/call")
table = prof.key_averages().table(sort_by="device_time_total", row_limit=30)
print(table)
if os.environ.get("OUT"):
    Path(os.environ["OUT"], "profile_round.txt").write_text(json.dumps(summary, indent=1) + "\n" + table)
