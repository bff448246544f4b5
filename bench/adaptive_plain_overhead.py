"""What an adaptive engine's step costs on the host beyond the step of an engine that runs only that kind of step
(issue 16): its plain step against a plain engine's (`--choice plain`, the default), or its round against a fixed
(5, 4, 8) engine's round (`--choice speculative`).

Two engines on the same target: the baseline (plain decoding, or fixed rounds), and `speculative_adaptive=True`
whose start-up table prices the other candidate out (bench.common.price_out), so that its model chooses the given
one (plain, as on a host-bound model; rounds, as with short prompts on the H100); its probes are turned into that
choice too (they still decide afresh, as probes do). Greedy, batch sizes given, every request decoding (prompts
prefilled first).
Each decode step's wall time is split into:
- forward: plain, the DECODE phase function (target forward, token selection; adaptive: also the feature ring
  store), which is device work on a GPU (one graph replay there); rounds, the worker's whole `decode` (its three
  graphs and the host work between them, alike in both engines);
- host: the rest of `Engine.step` (on a GPU also the time blocked on the device: compare `block` there), with the
  strategy's choose and resolved (both engines' wrapped alike) and, separately, `Engine.stats()`, which the
  serving loops take when their `StatsCadence` is due (at most every 50 ms while busy; taken after every step, as
  here until 2026-11-25, it also ended an adaptive engine's standing steps taken ahead at every step);
- block: wall seconds per step over the whole run of steps (stats included), synchronised at its ends only: on a
  GPU, the figure to compare (overlap keeps the device busy while the host works).
Engines alternate per repeat and medians are taken, so the other processes on a shared CPU weigh on both alike.

Usage (repo root): python bench/adaptive_plain_overhead.py OUT_JSON [--choice plain|speculative] [--detached]
    [--batch-sizes 1 8] [--steps 200] [--repeats 5] [--device cpu] [--model DIR --draft DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import time
import traceback
import warnings
from collections import Counter, defaultdict
from pathlib import Path

import torch

from spruce import LLM, SamplingParams
from spruce.bench.common import device_name, git_commit, price_out
from spruce.config import builtin_draft_path, builtin_model_path
from spruce.server.metrics import StatsCadence
from spruce.speculative.adaptive_policy import PLAIN, SPECULATIVE

_UNIQUE = itertools.count()  # a number heading each prompt
PROMPT = "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n"


class Clocks:
    """Seconds spent inside wrapped callables, per name, for the current step."""

    def __init__(self):
        self.step: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.step[name] += time.perf_counter() - t0
        return timed


def build(adaptive: bool, choice: str, bs: int, device: str, clocks: Clocks, model: str, draft: str,
          detached: bool = False) -> LLM:
    """The baseline engine for `choice` (adaptive False: plain decoding, or fixed rounds) or the adaptive one
    made to choose it; its per-step hooks wrapped in `clocks`. `detached` (plain only): the adaptive engine's
    requests join detached (its policy finds every load detachable), so its steps are `detached_plain`."""
    kw = dict(page_size=16, max_running_requests=max(bs, 8), device=device, context_length=2048)
    if device == "cuda":
        kw.update(dtype="bfloat16")
    if adaptive or choice == SPECULATIVE:
        kw.update(draft_model=draft, speculative_num_steps=5, speculative_eagle_topk=4,
                  speculative_num_draft_tokens=8, speculative_adaptive=adaptive)
    llm = LLM(model, **kw)
    engine = engine_of(llm)
    strategy = engine.strategy
    if adaptive:
        price_out(llm, _other(choice))  # the model chooses `choice`
        policy = strategy.policy
        decide = policy.decide

        def forced(requests, *args, **kw):  # the real decide runs (its cost is measured); probes are `choice` too
            d = decide(requests, *args, **kw)
            d.choice = choice
            return d

        policy.decide = forced
        if detached:
            policy.detach_blocker = lambda batch_size: None
        stepper = (strategy.worker if choice != PLAIN else strategy.detached_plain if detached else strategy.plain)
    else:
        stepper = strategy
    # both engines' per-step hooks wrapped alike (the wrapper's cost cancels)
    strategy.choose = clocks.wrap("choose", strategy.choose)
    strategy.resolved = clocks.wrap("resolved", strategy.resolved)
    if choice == PLAIN:
        stepper._decode_phase = clocks.wrap("forward", stepper._decode_phase)
    else:
        stepper.decode = clocks.wrap("forward", stepper.decode)
    return llm


def _other(choice: str) -> str:
    return SPECULATIVE if choice == PLAIN else PLAIN


def engine_of(llm: LLM):
    return llm.engine


def measure(llm: LLM, bs: int, steps: int, clocks: Clocks, sync,
            syncs: Counter | None = None) -> dict[str, list[float]]:
    """Per decode step: wall seconds of Engine.step, of Engine.stats() (0 where the cadence was not due), and the
    wrapped parts. With `syncs` (CUDA), torch's sync debug mode is on during the timed steps and each synchronising
    call site is counted."""
    engine = engine_of(llm)
    params = SamplingParams(max_tokens=steps * engine.limits.step_advance + 64, ignore_eos=True)  # none ends
    ids = [engine.add_request(f"# {next(_UNIQUE)}\n{PROMPT}", params) for _ in range(bs)]  # (a repeated prompt's
    # draft is extended at its prefill, so that the prefix cache takes it: no request would be detached)
    while any(q.status.value != "decode" for q in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(8):  # settle: the first decode steps fill static rows
        engine.step()
    out = defaultdict(list)
    cadence = StatsCadence()  # the serving loops' (server/engine_loop.py, server/engine_process.py)
    sync()
    with count_syncs(syncs) if syncs is not None else contextlib.nullcontext():
        start = time.perf_counter()
        for _ in range(steps):  # no per-step sync: on a GPU the steps overlap as when serving
            clocks.step.clear()
            t0 = time.perf_counter()
            engine.step()
            t1 = time.perf_counter()
            if cadence.due(True):
                engine.stats()
            t2 = time.perf_counter()
            out["step"].append(t1 - t0)
            out["stats"].append(t2 - t1)
            for k in ("forward", "choose", "resolved"):
                out[k].append(clocks.step.get(k, 0.0))
        sync()
        out["block"].append((time.perf_counter() - start) / steps)  # wall per step, stats() included
    for rid in ids:
        engine.abort(rid)
    engine.drain()
    return out


@contextlib.contextmanager
def count_syncs(counter: Counter):
    """While inside: torch's sync debug mode is on (CUDA) and each synchronisation is counted in `counter` by
    where it came from (spruce's two innermost frames; also used by bench/profile_catch_up.py)."""
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *rest, **kw: counter.update([_call_site(message)])
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")


def _call_site(message) -> str:
    """Where a sync warning was raised (called while it is being shown): spruce's two innermost frames outside
    bench/."""
    frames = [f for f in traceback.extract_stack() if "/spruce/" in f.filename and "/bench/" not in f.filename]
    where = " < ".join(f"{f.filename.rsplit('/spruce/', 1)[-1]}:{f.lineno}" for f in frames[-2:][::-1]) or "?"
    return f"{where}: {str(message)[:60]}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--choice", choices=(PLAIN, SPECULATIVE), default=PLAIN,
                    help="the step compared: adaptive's plain step against a plain engine's, or its round against a "
                         "fixed engine's")
    ap.add_argument("--detached", action="store_true",
                    help="plain: the adaptive engine's requests join detached (its steps: detached_plain)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sync-debug", action="store_true",
                    help="CUDA: count the call sites that synchronise with the device during the timed steps")
    ap.add_argument("--model", default=str(builtin_model_path()), help="target (default: the bundled demo)")
    ap.add_argument("--draft", default=str(builtin_draft_path()), help="EAGLE draft (default: the bundled demo's)")
    args = ap.parse_args()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    results = []
    for bs in args.batch_sizes:
        baseline = "plain" if args.choice == PLAIN else "fixed"
        clocks = {name: Clocks() for name in (baseline, "adaptive")}
        llms = {name: build(name == "adaptive", args.choice, bs, args.device, clocks[name], args.model, args.draft,
                            args.detached) for name in clocks}
        samples = {name: defaultdict(list) for name in llms}
        syncs = {name: Counter() for name in llms} if args.sync_debug else {}
        for _ in range(args.repeats):
            for name, llm in llms.items():
                for k, v in measure(llm, bs, args.steps, clocks[name], sync, syncs.get(name)).items():
                    samples[name][k].extend(v)
        row = {"batch_size": bs}
        if syncs:
            row["syncs"] = {name: dict(c.most_common(20)) for name, c in syncs.items()}
        for name, s in samples.items():
            med = {k: statistics.median(v) * 1e3 for k, v in s.items()}
            host = [a - b for a, b in zip(s["step"], s["forward"])]
            med["host"] = statistics.median(host) * 1e3
            med["host_with_stats"] = statistics.median(h + st for h, st in zip(host, s["stats"])) * 1e3
            row[name] = {k: round(v, 4) for k, v in med.items()}
        p, a = row[baseline], row["adaptive"]
        row["extra_host_ms"] = round(a["host"] - p["host"], 4)
        row["extra_host_with_stats_ms"] = round(a["host_with_stats"] - p["host_with_stats"], 4)
        row["host_ratio"] = round(a["host"] / p["host"], 4)
        row["host_with_stats_ratio"] = round(a["host_with_stats"] / p["host_with_stats"], 4)
        print(json.dumps(row), flush=True)
        results.append(row)
        del llms
    Path(args.out).write_text(json.dumps({"device": device_name(args.device), "git_commit": git_commit(),
                                          "choice": args.choice, "detached": args.detached, "model": args.model,
                                          "draft": args.draft,
                                          "steps": args.steps, "repeats": args.repeats,
                                          "unit": "milliseconds per decode step (medians)", "runs": results},
                                         indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
