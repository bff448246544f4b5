"""One engine a process (plain, or adaptive with rounds priced out), steady decode of one request over the 1k shared
prefix: per step, the host time of Engine.step's parts and of the launch's pieces (timed by wrappers)."""
import json, statistics, sys, time, types
from pathlib import Path
import torch
sys.path.insert(0, "bench")
from spruce import LLM
from spruce.bench.common import price_out
from spruce.speculative.adaptive_policy import SPECULATIVE
from spruce import SamplingParams
from spruce.bench.serving import load_prompts

kind, model, draft, out = sys.argv[1:5]
args = types.SimpleNamespace(model=model, draft=draft, max_total_tokens=None, cuda_graph_draws=6)
t_build = time.perf_counter()
dev = "cuda" if torch.cuda.is_available() else "cpu"
kw = dict(page_size=16, max_running_requests=64, device=dev, dtype="bfloat16" if dev == "cuda" else "float32")
if kind == "adaptive":
    kw.update(draft_model=draft, speculative_num_steps=5, speculative_eagle_topk=4, speculative_num_draft_tokens=8,
              speculative_adaptive=True)
llm = LLM(model, **kw)
if kind == "adaptive":
    price_out(llm, SPECULATIVE)
t_build = time.perf_counter() - t_build
engine = llm.engine
prompt = load_prompts(Path(model) / "heldout_prompts.jsonl", 256, engine.tokenizer, 1024)[0]
for _ in range(2):
    llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0))
timers = {}

def wrap(owner, name, label):
    fn = getattr(owner, name)
    acc = timers.setdefault(label, [0.0, 0])
    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[0] += time.perf_counter() - t
            acc[1] += 1
    setattr(owner, name, timed)

wrap(torch.cuda.CUDAGraph, "replay", "graph_replay")
wrap(engine, "_launch_decode", "launch_decode")
wrap(engine, "_launched", "launched")
wrap(engine.scheduler, "reserve_decode", "reserve_decode")
wrap(engine.scheduler, "admit", "admit")
wrap(engine.scheduler, "next_step", "next_step")
wrap(engine.runner.page_table, "check_covers_rows", "check_covers_rows")
strategy = engine.strategy
if hasattr(strategy, "detached_plain"):
    wrap(strategy, "choose", "choose")
    wrap(strategy.detached_plain, "decode", "strategy_decode")
    wrap(strategy, "resolved", "resolved")
else:
    wrap(strategy, "decode", "strategy_decode")
rid = engine.add_request(prompt, SamplingParams(max_tokens=1400, ignore_eos=True, temperature=0.0))
for _ in range(8):
    engine.step()
res = []
for rep in range(5):
    for v in timers.values():
        v[0] = 0.0; v[1] = 0
    c0 = dict(engine.counters.seconds); s0 = engine.counters.steps["decode"] if hasattr(engine.counters, "steps") else None
    (torch.cuda.synchronize() if dev == 'cuda' else None)
    t0 = time.perf_counter()
    n = int(sys.argv[5]) if len(sys.argv) > 5 else 200
    for _ in range(n):
        engine.step()
    (torch.cuda.synchronize() if dev == 'cuda' else None)
    wall = (time.perf_counter() - t0) / n
    parts = {k: round(1e6 * (engine.counters.seconds[k] - c0[k]) / n, 2) for k in c0}
    res.append({"wall_us": round(1e6 * wall, 2), "parts": parts,
                "wrapped": {k: (round(1e6 * v[0] / n, 2), v[1]) for k, v in timers.items()}})
engine.abort(rid); engine.drain()
summary = {"kind": kind, "build_s": round(t_build, 1), "reps": res,
           "median": {"wall_us": statistics.median(r["wall_us"] for r in res),
                      **{k: statistics.median(r["parts"][k] for r in res) for k in res[0]["parts"]},
                      **{"w_" + k: statistics.median(r["wrapped"][k][0] for r in res) for k in res[0]["wrapped"]}},
           "draws": {str(k): v for k, v in engine.runner.graphs.draws.items()}}
print(kind, json.dumps(summary["median"]))
with open(out, "w") as f:
    json.dump(summary, f)
