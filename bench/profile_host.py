"""Where the host's time goes in the engine loop: cProfile over `LLM.generate` for plain decoding and an
EAGLE-3 config at several batch sizes, CUDA graphs on, overlap on and off.

Usage (device, repo root): python bench/profile_host.py MODEL DRAFT OUT_JSON [--batch-sizes 1 64]
Writes, per run: wall time, tokens/s, steps, host seconds per step inside the engine and the top functions
by own time (tottime) and by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time
from pathlib import Path

import torch

from spruce import LLM, SamplingParams
from spruce.bench.common import device_name, git_commit


def prompts(model: str, n: int, tokens: int) -> list[list[int]]:
    from spruce.models.hf_config import ModelConfig
    from spruce.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model, ModelConfig.from_dir(model))
    lines = (Path(model) / "heldout_prompts.jsonl").read_text().splitlines()
    texts = [json.loads(line)["text"] for line in lines if line.strip()]
    return [tok.encode(texts[i % len(texts)])[:tokens] for i in range(n)]


def top(stats: pstats.Stats, key: str, n: int = 25) -> list[dict]:
    stats.sort_stats(key)
    rows = []
    for func in stats.fcn_list[:n]:
        cc, nc, tt, ct, _ = stats.stats[func]
        rows.append({"function": f"{Path(func[0]).name}:{func[1]}({func[2]})", "calls": nc,
                     "tottime_s": round(tt, 4), "cumtime_s": round(ct, 4)})
    return rows


def profile_one(model: str, draft: str | None, bs: int, overlap: bool, output_len: int) -> dict:
    kw = dict(device="cuda", dtype="bfloat16", page_size=16, max_running_requests=bs, cuda_graph_max_bs=bs,
              context_length=512, disable_overlap_schedule=not overlap)
    if draft:
        kw.update(draft_model=draft, speculative_num_steps=5, speculative_eagle_topk=4,
                  speculative_num_draft_tokens=16)
    llm = LLM(model, **kw)
    batch = prompts(model, bs, 128)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    llm.generate(batch, SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    steps = [0]
    real_step = llm.engine.step

    def counted(**kwargs):
        steps[0] += 1
        return real_step(**kwargs)

    llm.engine.step = counted
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    outs = llm.generate(batch, params)
    prof.disable()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof, stream=io.StringIO())
    tokens = sum(len(o.token_ids) for o in outs)
    res = {"batch_size": bs, "overlap": overlap, "spec": "5,4,16" if draft else None, "wall_s": wall,
           "tokens": tokens, "tokens_per_s": tokens / wall, "steps": steps[0],
           "wall_ms_per_step": wall * 1e3 / max(steps[0], 1),
           "top_tottime": top(stats, "tottime"), "top_cumtime": top(stats, "cumulative")}
    del llm
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("draft")
    ap.add_argument("out")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args()
    runs = []
    for overlap in (True, False):
        for bs in args.batch_sizes:
            for draft in (None, args.draft):
                r = profile_one(args.model, draft, bs, overlap, args.output_len)
                print(f"bs={bs} overlap={overlap} spec={r['spec']} tok/s={r['tokens_per_s']:.0f} "
                      f"ms/step={r['wall_ms_per_step']:.3f}", flush=True)
                print("   ", "; ".join(f"{t['function']} {t['tottime_s']}" for t in r["top_tottime"][:8]))
                runs.append(r)
    Path(args.out).write_text(json.dumps({"device": device_name("cuda"), "git_commit": git_commit(),
                                          "runs": runs}, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
