"""Where do CUDA-graph rounds and eager rounds part? (device diagnostic for accept-length differences)

For each speculative config: (1) mean accept length with graphs off and on, same prompts; (2) with graphs
on, every phase of every round is also run eagerly twice on the same state, once as eager runs it (real
batch, real kv bound) and once shaped like the graph (bucket, captured kv bound), before the replay. The
phases are idempotent (they overwrite scratch, pages and draft state with the same values), so the three
outputs must agree; the report counts the rounds where draft trees / verify argmaxes / next step-0 top-K
differ between eager, eager-graph-shaped and replayed, and the largest logit differences.

Usage: python bench/graph_vs_eager.py MODEL DRAFT [S,K,N ...]  (JSON to $OUT/graph_vs_eager.json if set)
"""

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch

from spruce import LLM, SamplingParams


def prompts(model: str, n: int) -> list[str]:
    lines = Path(model, "heldout_prompts.jsonl").read_text().splitlines()
    return [json.loads(x)["text"][:600] for x in lines if x.strip()][:n]


def snapshot(worker, name: str, out, bs: int) -> dict:
    """Host copies of what a phase produced for the first bs requests."""
    if name == "draft":
        return {"tokens": out.tokens[:bs].cpu(), "parents": out.parents[:bs].cpu()}
    if name == "verify":
        logits = out.logits[: bs * worker.N].float().cpu()
        return {"logits": logits, "argmax": logits.argmax(-1)}
    rows = worker.rows[:bs]
    return {"next": out[:bs].cpu(), "topk_ids": worker.topk_ids[rows].cpu(), "topk_p": worker.topk_p[rows].cpu(),
            "hidden": worker.hidden[rows].float().cpu()}


def differs(a: dict, b: dict) -> tuple[bool, float]:
    """(any exact-valued field differs, largest float difference)."""
    exact = any(not torch.equal(a[k], b[k]) for k in a if a[k].dtype in (torch.int64, torch.int32))
    diff = max((float((a[k] - b[k]).abs().max()) for k in a if a[k].is_floating_point()), default=0.0)
    return exact, diff


def compare_run(model: str, draft: str, spec, bs: int, texts: list[str]) -> dict:
    s, k, n = spec
    kw = dict(device="cuda", dtype="bfloat16", page_size=16, max_running_requests=bs, cuda_graph_max_bs=bs,
              context_length=1024, draft_model=draft, speculative_num_steps=s, speculative_eagle_topk=k,
              speculative_num_draft_tokens=n)
    params = SamplingParams(max_tokens=96, ignore_eos=True)
    res: dict = {"spec": spec, "bs": bs}
    outs = {}
    for graphs in (False, True):
        llm = LLM(model, cuda_graph=graphs, **kw)
        got = llm.generate(texts[:bs], params)
        outs[graphs] = [o.token_ids for o in got]
        res[f"accept_len_graphs_{'on' if graphs else 'off'}"] = llm.engine.spec_stats.mean_accept_length
        if graphs:
            stats = instrument(llm)
            llm.engine.spec_stats.__init__()
            again = llm.generate(texts[:bs], params)
            res["accept_len_graphs_on_instrumented"] = llm.engine.spec_stats.mean_accept_length
            res["instrumented_same_tokens"] = [o.token_ids for o in again] == outs[True]
            res["phases"] = stats
        del llm
        torch.cuda.empty_cache()
    res["graphs_on_equals_off_tokens"] = outs[True] == outs[False]
    return res


def instrument(llm) -> dict:
    """Wrap BucketGraphs.run: eager, eager graph-shaped, then replay; count disagreements per phase."""
    graphs, worker = llm.engine.runner.graphs, llm.engine.strategy
    replay = graphs.run
    stats = defaultdict(lambda: defaultdict(float))

    def run(name, fn, bs, max_kv, *previous):
        bucket = graphs.bucket(bs)
        if bucket != bs or (name, bucket) not in graphs.graphs:  # a partial bucket: just replay
            return replay(name, fn, bs, max_kv, *previous)
        eager = snapshot(worker, name, fn(bs, max_kv, *previous), bs)
        shaped = snapshot(worker, name, fn(bucket, graphs.kv_bound, *previous), bs)
        out = replay(name, fn, bs, max_kv, *previous)
        graph = snapshot(worker, name, out, bs)
        st = stats[name]
        st["rounds"] += 1
        for label, a, b in (("eager_vs_shaped", eager, shaped), ("shaped_vs_graph", shaped, graph),
                            ("eager_vs_graph", eager, graph)):
            ex, diff = differs(a, b)
            st[f"{label}_exact_differs"] += int(ex)
            st[f"{label}_max_float_diff"] = max(st[f"{label}_max_float_diff"], diff)
        return out

    graphs.run = run
    return stats


def main() -> None:
    model, draft = sys.argv[1], sys.argv[2]
    specs = [tuple(int(x) for x in a.split(",")) for a in (sys.argv[3:] or ["5,4,16", "5,1,6", "6,8,32"])]
    texts = prompts(model, 16)
    results = []
    for spec in specs:
        for bs in (1, 16):
            r = compare_run(model, draft, spec, bs, texts)
            r["phases"] = {k: dict(v) for k, v in r["phases"].items()}
            results.append(r)
            print(json.dumps(r), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "graph_vs_eager.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
