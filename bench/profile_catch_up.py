"""What an adaptive engine's extra work costs (issue 16): the draft's catch-up before a round that follows plain
steps, and a prefill (which also runs the draft over the prompt), each against what it replaces.

One adaptive engine (the target and draft given, greedy, --batch requests): it decodes plainly for --lag steps, then
runs one round, which catches the draft up over the batch x --lag missing positions first; repeated --repeats times.
Per catch-up: host seconds of its launch (perf_counter), device seconds (CUDA events around it), the call sites
that synchronised with the GPU during it (torch's sync debug mode, CUDA), and a cProfile of its launches (top
functions by own time). Then the prefill of one --prompt-tokens prompt, timed from `Engine.step` to its result on
the device, in that adaptive engine and in a plain engine on the same target.

Usage (repo root): python bench/profile_catch_up.py OUT_JSON --model DIR --draft DIR [--device cuda] [--lag 32]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time
from collections import Counter
from pathlib import Path

import torch

from adaptive_plain_overhead import count_syncs  # bench/ is this script's directory
from spruce import LLM, SamplingParams
from spruce.bench.common import device_name, git_commit
from spruce.speculative.adaptive_policy import PLAIN, SPECULATIVE

PROMPT = "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n"


def engine_kwargs(device: str) -> dict:
    kw = dict(page_size=16, max_running_requests=64, device=device, context_length=2048)
    return kw | (dict(dtype="bfloat16") if device == "cuda" else {})


def forced_choices(engine) -> dict:
    """Make the adaptive engine's policy run whatever `force["choice"]` says (its model still runs)."""
    policy = engine.strategy.policy
    decide = policy.decide
    force = {"choice": PLAIN}

    def forced(requests, *args, **kw):
        d = decide(requests, *args, **kw)
        d.choice = force["choice"]
        return d

    policy.decide = forced
    policy.repeat = lambda choice, batch_size: False  # every step decides (and is forced)
    return force


def profile_catch_up(args, cuda: bool) -> dict:
    llm = LLM(args.model, draft_model=args.draft, speculative_num_steps=5, speculative_eagle_topk=4,
              speculative_num_draft_tokens=8, speculative_adaptive=True, **engine_kwargs(args.device))
    engine = llm.engine
    force = forced_choices(engine)
    worker = engine.strategy.worker
    launch = worker.catch_up
    host_s, device_s, syncs = [], [], Counter()
    prof = cProfile.Profile()

    def timed(*a, **kw):
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        if cuda:
            start.record()
        t0 = time.perf_counter()
        prof.enable()
        try:
            return launch(*a, **kw)
        finally:
            prof.disable()
            host_s.append(time.perf_counter() - t0)
            if cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                end.synchronize()
                device_s.append(start.elapsed_time(end) / 1e3)

    params = SamplingParams(max_tokens=(args.lag + 2) * (args.repeats + 2), ignore_eos=True)
    rids = [engine.add_request(PROMPT, params) for _ in range(args.batch)]
    for _ in range(8):
        engine.step()
    worker.catch_up = timed
    for _ in range(args.repeats):
        force["choice"] = PLAIN
        for _ in range(args.lag):
            engine.step()
        force["choice"] = SPECULATIVE
        if cuda:
            with count_syncs(syncs):
                engine.step()
        else:
            engine.step()
    for rid in rids:
        engine.abort(rid)
    engine.drain()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats("spruce/|triton/compiler", 20)
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(20)
    calls = sum(v[1] for v in pstats.Stats(prof).stats.values()) / max(len(host_s), 1)
    return {"lag": args.lag, "batch": args.batch, "catch_ups": len(host_s), "host_ms": _ms(host_s[1:] or host_s),
            "device_ms": _ms(device_s[1:] or device_s) if cuda else None, "python_calls_per_catch_up": calls,
            "syncs": dict(syncs.most_common(20)), "profile": text.getvalue().splitlines()[:80]}, llm


def prefill_ms(llm: LLM, prompt: list[int], repeats: int, sync) -> dict:
    """Engine.step() of one prompt's prefill, to its result on the device (the first step after adding it), and
    a cProfile of those steps (top functions by own time)."""
    engine = llm.engine
    times = []
    prof = cProfile.Profile()
    for i in range(repeats + 2):  # the first two warm up (and are not profiled)
        rid = engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        sync()
        t0 = time.perf_counter()
        if i >= 2:
            prof.enable()
        engine.step()
        sync()
        prof.disable()
        if i >= 2:
            times.append(time.perf_counter() - t0)
        engine.abort(rid)
        engine.drain()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats("spruce/", 25)
    return _ms(times) | {"profile": text.getvalue().splitlines()[:45]}


def _ms(values: list[float]) -> dict:
    return {"median": round(statistics.median(values) * 1e3, 4), "min": round(min(values) * 1e3, 4)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--lag", type=int, default=32, help="plain steps before each round")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1, help="requests decoding together (each lags --lag positions)")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    catch_up, adaptive = profile_catch_up(args, cuda)
    print(json.dumps({k: v for k, v in catch_up.items() if k != "profile"}), flush=True)
    print("\n".join(catch_up["profile"]), flush=True)
    tokenizer = adaptive.engine.tokenizer
    text = "\n".join(json.loads(line)["text"] for line in
                     (Path(args.model) / "heldout_prompts.jsonl").read_text().splitlines()[:8])
    prompt = tokenizer.encode(text)[: args.prompt_tokens]
    prefill = {"prompt_tokens": len(prompt), "adaptive": prefill_ms(adaptive, prompt, args.repeats, sync)}
    del adaptive
    plain = LLM(args.model, **engine_kwargs(args.device))
    prefill["plain"] = prefill_ms(plain, prompt, args.repeats, sync)
    for name in ("adaptive", "plain"):
        print(name, json.dumps({k: v for k, v in prefill[name].items() if k != "profile"}))
        print("\n".join(prefill[name]["profile"]), flush=True)
    Path(args.out).write_text(json.dumps({"device": device_name(args.device), "git_commit": git_commit(),
                                          "model": args.model, "draft": args.draft, "catch_up": catch_up,
                                          "prefill_ms": prefill}, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
