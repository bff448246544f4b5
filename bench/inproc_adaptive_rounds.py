"""The adaptive engine's own cost while it runs rounds only, in process (no HTTP, no engine process): the engine loop
of `spruce bench serving`'s workload (pycode-19m, 128-token prompts, 128 output tokens, requests topped up to the
concurrency as they finish) at concurrency 8, 32 and 64, a fixed EAGLE-3 (5, 4, 8) engine or an adaptive one over
the same (5, 4, 8) held to rounds (plain steps priced out, `price_out`; no probes). Per level: wall seconds per
decode step and the engine's counters per decode step (launch, wait, resolve, outputs); the last of three
repetitions under cProfile, whose top functions go to OUT_DIR/prof-KIND-CONCURRENCY.txt.

Run each kind in its own process, alternated (fixed, adaptive, fixed, adaptive) on one machine: the served bar
(bench/serving_passes.py) puts the adaptive server's host time per decode step above the fixed one's, and this
separates the engine's own share from the serving process's.

Usage (repo root): python bench/inproc_adaptive_rounds.py fixed|adaptive OUT_DIR
  SPRUCE_PYCODE_19M: the model's folder (default ../shared/models/pycode-19m); SPRUCE_DEVICE: cuda (default) or
  cpu; SMALL=1: two tiny levels (a smoke test on the CPU).
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

import spruce.speculative.adaptive_policy as adaptive_policy
from spruce import LLM, SamplingParams
from spruce.bench.common import price_out, write_result
from spruce.bench.serving import load_prompts

DRAFT = "bench/assets/pycode-19m-eagle3"
LEVELS = ((8, 512), (32, 768), (64, 1024))  # (concurrency, requests)
REPETITIONS = 3


def serve(engine, prompts: list, params: SamplingParams, concurrency: int) -> tuple[int, int]:
    """Every prompt through the engine, at most `concurrency` at once: (engine steps, tokens generated)."""
    pending, active, steps, tokens = list(prompts), set(), 0, 0
    while pending or engine.has_unfinished():
        while pending and len(active) < concurrency:
            active.add(engine.add_request(pending.pop(0), params))
        for out in engine.step():
            tokens += len(out.new_token_ids)
            if out.finished:
                active.discard(out.request_id)
        steps += 1
    return steps, tokens


def main() -> None:
    kind, out_dir = sys.argv[1], Path(sys.argv[2])
    if kind not in ("fixed", "adaptive"):
        raise SystemExit(f"KIND must be fixed or adaptive, got {kind!r}")
    out_dir.mkdir(parents=True, exist_ok=True)
    model = os.environ.get("SPRUCE_PYCODE_19M", "../shared/models/pycode-19m")
    device = os.environ.get("SPRUCE_DEVICE", "cuda")
    small = os.environ.get("SMALL") == "1"
    llm = LLM(model, device=device, dtype="bfloat16" if device == "cuda" else "float32", page_size=16,
              max_running_requests=64, scheduler_delay_factor=4.0, draft_model=DRAFT, speculative_num_steps=5,
              speculative_eagle_topk=4, speculative_num_draft_tokens=8, speculative_adaptive=kind == "adaptive",
              **({"cuda_graph_max_bs": 64} if device == "cuda" else {}))
    engine = llm.engine
    if kind == "adaptive":  # rounds held: plain steps never priced below them, no probe budget
        adaptive_policy.PROBE_BUDGET, adaptive_policy.PROBE_ALLOWANCE = 0.0, 0.0
        price_out(llm, adaptive_policy.PLAIN)
    prompts = load_prompts(Path(model) / "heldout_prompts.jsonl", 128, engine.tokenizer, 0)
    params = SamplingParams(max_tokens=128, ignore_eos=True)
    levels = ((8, 8), (64, 64)) if small else LEVELS
    serve(engine, prompts[:levels[-1][0]], params, levels[-1][0])  # warm-up
    rows = []
    for rep in range(REPETITIONS):
        for concurrency, requests in levels:
            before = engine.stats()["steps"]
            profile = cProfile.Profile() if rep == REPETITIONS - 1 else None
            t0 = time.perf_counter()
            if profile is not None:
                profile.enable()
            steps, tokens = serve(engine, (prompts * (requests // len(prompts) + 1))[:requests], params, concurrency)
            if profile is not None:
                profile.disable()
            wall = time.perf_counter() - t0
            stats = engine.stats()
            after = stats["steps"]
            decodes = max(after["decodes"] - before["decodes"], 1)
            row = {"kind": kind, "rep": rep, "concurrency": concurrency, "steps": steps, "decodes": decodes,
                   "prefills": after["prefills"] - before["prefills"], "wall_s": round(wall, 3),
                   "tokens_per_s": round(tokens / wall), "us_per_decode": round(wall / decodes * 1e6, 1),
                   "counters_us_per_decode": {part: round((seconds - before["seconds"][part]) / decodes * 1e6, 1)
                                              for part, seconds in after["seconds"].items()},
                   "chosen": (stats.get("adaptive") or {}).get("chosen"), "profiled": profile is not None}
            print(json.dumps(row), flush=True)
            rows.append(row)
            if profile is not None:
                text = io.StringIO()
                report = pstats.Stats(profile, stream=text)
                report.sort_stats("tottime").print_stats(45)
                report.sort_stats("cumulative").print_stats("adaptive|epoch_clock|engine.py|eagle_worker", 60)
                (out_dir / f"prof-{kind}-{concurrency}.txt").write_text(text.getvalue())
    write_result(f"inproc-adaptive-rounds-{kind}", device, {"model": model, "draft": DRAFT, "levels": levels},
                 {"rows": rows}, out_dir)


if __name__ == "__main__":
    main()
