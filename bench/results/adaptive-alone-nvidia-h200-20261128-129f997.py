"""One engine a process (plain, or the bar's adaptive (5,4,16)/widths 8 with its own policy), requests one at a time
over the 1k shared prefix with a 2 ms idle gap between them (as a served concurrency-1 level): every Engine.step's
wall time, labelled by the adaptive strategy's state before it (P parked, t ticket, o other) and by a prefill."""
import json, statistics, sys, time, collections
from pathlib import Path
import torch
from spruce import LLM, SamplingParams
from spruce.bench.serving import load_prompts

kind, model, draft, out = sys.argv[1:5]
nreq = int(sys.argv[5]) if len(sys.argv) > 5 else 32
dev = "cuda" if torch.cuda.is_available() else "cpu"
kw = dict(page_size=16, max_running_requests=64, device=dev, dtype="bfloat16" if dev == "cuda" else "float32",
          scheduler_delay_factor=4.0)
if kind == "adaptive":
    kw.update(draft_model=draft, speculative_num_steps=5, speculative_eagle_topk=4, speculative_num_draft_tokens=16,
              speculative_adaptive=True, speculative_adaptive_widths=[8])
llm = LLM(model, **kw)
engine = llm.engine
st = engine.strategy
prompts = load_prompts(Path(model) / "heldout_prompts.jsonl", 256, engine.tokenizer, 1024)
sp = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0.0)

def label() -> str:
    if not hasattr(st, "_park"):
        return "plain"
    return "P" if st._park is not None else ("t" if st._ticket is not None else "o")

def run(prompt, rec):
    rid = engine.add_request(prompt, sp)
    t_add = time.perf_counter(); first = None
    while True:
        lab = label(); p0 = engine.counters.prefills if hasattr(engine.counters, "prefills") else 0
        t0 = time.perf_counter()
        outs = engine.step()
        t1 = time.perf_counter()
        p1 = engine.counters.prefills if hasattr(engine.counters, "prefills") else 0
        if rec is not None:
            rec["steps"].append((lab + ("+prefill" if p1 > p0 else ""), t1 - t0))
        for o in outs:
            if o.request_id == rid and first is None and len(o.token_ids) > 0:
                first = t1
            if o.request_id == rid and o.finished:
                engine.step()  # idle: the engine meets the gap
                if rec is not None:
                    rec["e2e"].append(t1 - t_add); rec["ttft"].append((first or t1) - t_add)
                return

for p in prompts[:12]:
    run(p, None); time.sleep(0.002)
rec = {"steps": [], "e2e": [], "ttft": []}
for i in range(nreq):
    run(prompts[(12 + i) % len(prompts)], rec); time.sleep(0.002)
by = collections.defaultdict(list)
for lab, s in rec["steps"]:
    by[lab].append(s)
summary = {"kind": kind, "requests": nreq, "e2e_ms_mean": 1e3 * statistics.mean(rec["e2e"]),
           "ttft_ms_mean": 1e3 * statistics.mean(rec["ttft"]), "steps_per_request": len(rec["steps"]) / nreq,
           "by_label": {k: {"n_per_req": len(v) / nreq, "mean_us": 1e6 * statistics.mean(v),
                            "p50_us": 1e6 * statistics.median(v), "sum_us_per_req": 1e6 * sum(v) / nreq}
                        for k, v in sorted(by.items())},
           "stats": {k: v for k, v in (st.stats() or {}).items() if isinstance(v, (int, float))} if hasattr(st, "stats") else None}
print(kind, json.dumps({k: summary[k] for k in ("e2e_ms_mean", "ttft_ms_mean", "steps_per_request")}),
      json.dumps({k: {kk: round(vv, 1) for kk, vv in v.items()} for k, v in summary["by_label"].items()}))
json.dump({"summary": summary, "steps": rec["steps"]}, open(out, "w"))
