"""Where a prefill's launch goes, plain against the never-speculating adaptive engine, in one process (issue 16).

Served with prefill batching (`--scheduler-delay-factor 4`, runtime/prefill_batching.py), arrivals are held by the
mean prefill launch, and on the H100 x4 (5cd14df, 2026-11-26, 1k shared prefix) the adaptive server's was 13% longer
than the plain servers' at concurrency 1-8 and 30% longer at 32-64, where it launched 8-10% fewer prefills per
request with TTFT p50 +9-11%. This program times the parts of each prefill launch: the engine's whole launch
(`Engine._launch_prefill`), the strategy's prefill, the target's forward, and, for the adaptive engine, which lazy
chunks to leave to a catch-up (`_lazy_chunks`, with the policy's steady choice), the extend step (lazy chunks' ring
store `FeatureRing.store` included), and the policy's ticket replay (`stood`) and `break_chain`, and counts
the prefills launched under a ticket of standing steps. It wraps those methods with a timer (a few microseconds a
call), so its totals are a little above an unwrapped run's; a profiler, it names private methods, and a renamed one
fails at once (AttributeError). Engines: plain and forced (bench/adaptive_inprocess.py:
adaptive with rounds priced out, so every step is plain). Arrivals: closed loops at each `--concurrency`; a
finished request is replaced at once (cohorts: one prefill holds many chunks), and with `--trickle` also one
arrival an engine step at most (as served, where requests come back one by one). Each part's seconds over a run
divided by the run's prefills (`stood` and `steady_choice` also run outside prefills: at decode steps, at
decisions), medians over repetitions.

With `--sync-debug` (CUDA) each engine's prefill launches also run under torch's sync debug mode, and every
synchronisation with the device inside them is counted by where it came from (bench/adaptive_plain_overhead.py's
count_syncs): a launch that waits on the device waits for the decode step in flight, which grows with the decode
batch (DESIGN §16, session 40: the adaptive launch's excess at 32-64 did not scale with its chunks). The mode's own
checks lengthen every launch: the times of such a run are not the engine's.

Usage (repo root): python bench/adaptive_prefill_parts.py --model DIR --draft DIR [--concurrency 1 32] [--trickle]
    [--repeats 2] [--requests 256] [--scheduler-delay-factor 4] [--sync-debug] [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:  # its sibling, also when loaded as a module (tests)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import adaptive_inprocess  # noqa: E402  (the engines it builds and the closed loop it drives)
from adaptive_plain_overhead import count_syncs  # noqa: E402
from spruce import SamplingParams  # noqa: E402
from spruce.bench.common import write_result  # noqa: E402
from spruce.bench.serving import load_prompts  # noqa: E402

KINDS = ("plain", "forced")


class PartTimer:
    """Seconds and calls per named part, from wrapped methods."""

    def __init__(self):
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)

    def wrap(self, owner, method: str, part: str) -> None:
        """Time `owner.method` as `part` (an instance attribute shadowing the method: its own calls go through it)."""
        inner = getattr(owner, method)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start
                self.calls[part] += 1

        setattr(owner, method, timed)

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def instrument(llm, timer: PartTimer, syncs: collections.Counter | None = None) -> None:
    """Wrap the prefill's parts of `llm`'s engine (the adaptive ones where its strategy has them); with `syncs`, count
    the synchronisations inside each prefill launch there by call site (`count_syncs`)."""
    engine = llm.engine
    strategy = engine.strategy
    if syncs is not None:
        launch = engine._launch_prefill

        def synced(*args, **kwargs):
            with count_syncs(syncs):
                return launch(*args, **kwargs)

        engine._launch_prefill = synced
    timer.wrap(engine, "_launch_prefill", "launch")
    timer.wrap(engine.runner, "prefill_forward", "target_forward")
    policy = getattr(strategy, "policy", None)
    if policy is None:
        timer.wrap(strategy, "prefill", "strategy_prefill")
        return
    prefill = strategy.prefill

    def counted(*args, **kwargs):  # which prefills run under a ticket of standing steps
        timer.calls["under_ticket"] += strategy._ticket is not None
        return prefill(*args, **kwargs)

    strategy.prefill = counted
    timer.wrap(strategy, "prefill", "strategy_prefill")
    timer.wrap(strategy, "_lazy_chunks", "lazy_chunks")
    timer.wrap(strategy, "extend_draft", "extend_draft")
    timer.wrap(strategy.ring, "store", "ring_store")
    for method in ("stood", "break_chain", "steady_choice"):
        timer.wrap(policy, method, method)


def trickle(llm, prompts: list, first: int, concurrency: int, num_requests: int) -> float:
    """A closed loop whose finished requests are replaced one an engine step at most; its output tokens/s."""
    engine = llm.engine
    params = SamplingParams(max_tokens=adaptive_inprocess.MAX_TOKENS, ignore_eos=True, temperature=0.0)
    live, sent, owed, tokens = set(), 0, 0, 0
    start = time.perf_counter()

    def submit() -> None:
        nonlocal sent
        live.add(engine.add_request(prompts[(first + sent) % len(prompts)], params))
        sent += 1

    while sent < min(concurrency, num_requests):
        submit()
    while live:
        for out in engine.step():
            if out.finished and out.request_id in live:
                live.discard(out.request_id)
                tokens += len(out.token_ids)
                owed += 1
        if owed and sent < num_requests:
            submit()
            owed -= 1
    return tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--trickle", action="store_true", help="also arrivals one an engine step at most")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--requests", type=int, default=256, help="requests a run (16 a concurrency at least)")
    ap.add_argument("--workload", choices=sorted(adaptive_inprocess.WORKLOADS), default="prefix")
    ap.add_argument("--scheduler-delay-factor", type=float, default=4.0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sync-debug", action="store_true",
                    help="CUDA: count the synchronisations with the device inside the prefill launches, by call site")
    ap.add_argument("--out-dir", default="bench/results")
    args = ap.parse_args()
    if args.sync_debug and args.device != "cuda":
        ap.error(f"--sync-debug needs --device cuda (got {args.device!r}): torch's sync debug mode watches CUDA")
    args.shapes = []  # (adaptive_inprocess.build's fixed-shape kinds: none here)
    llms = {kind: adaptive_inprocess.build(kind, args) for kind in KINDS}
    timers = {kind: PartTimer() for kind in KINDS}
    syncs = {kind: collections.Counter() for kind in KINDS} if args.sync_debug else None
    for kind, llm in llms.items():
        instrument(llm, timers[kind], syncs[kind] if syncs is not None else None)
    shared_prefix_tokens, prompt_tokens = adaptive_inprocess.WORKLOADS[args.workload]
    prompts = load_prompts(Path(args.model) / "heldout_prompts.jsonl", prompt_tokens, llms["plain"].engine.tokenizer,
                           shared_prefix_tokens)
    for llm in llms.values():  # every prompt twice: the cache holds them (bench/adaptive_inprocess.py)
        adaptive_inprocess.closed_loop(llm, prompts, 0, 1, len(prompts))
        adaptive_inprocess.closed_loop(llm, prompts, 0, 8, len(prompts))
    for counter in (syncs or {}).values():
        counter.clear()  # (the warm-up's)
    loops = [("cohort", c) for c in args.concurrency] + [("trickle", c) for c in args.concurrency if args.trickle]
    runs, summary = {}, {}
    launched = collections.Counter()  # prefill launches per kind over every run (what the syncs were counted over)
    for arrivals, concurrency in loops:
        num_requests = max(args.requests, 16 * concurrency)
        label = f"{arrivals}-{concurrency}"
        runs[label] = {kind: [] for kind in KINDS}
        for rep in range(args.repeats):
            for kind in KINDS if rep % 2 == 0 else KINDS[::-1]:
                timer = timers[kind]
                timer.clear()
                if arrivals == "cohort":
                    tokens_per_s = adaptive_inprocess.closed_loop(llms[kind], prompts, rep * num_requests,
                                                                  concurrency, num_requests)["tokens_per_s"]
                else:
                    tokens_per_s = trickle(llms[kind], prompts, rep * num_requests, concurrency, num_requests)
                prefills = max(timer.calls["launch"], 1)
                launched[kind] += timer.calls["launch"]
                row = {"tokens_per_s": round(tokens_per_s, 1), "prefills": timer.calls["launch"],
                       "under_ticket": timer.calls.get("under_ticket", 0),
                       "us_per_prefill": {part: round(1e6 * s / prefills, 1) for part, s in timer.seconds.items()},
                       "calls": {part: n for part, n in timer.calls.items() if part != "under_ticket"}}
                runs[label][kind].append(row)
                print(f"{label} rep {rep} {kind}: {row}", flush=True)
        summary[label] = {kind: {part: statistics.median(r["us_per_prefill"].get(part, 0.0) for r in rows)
                                 for part in rows[0]["us_per_prefill"]} for kind, rows in runs[label].items()}
        print(f"{label} medians (us a prefill): {summary[label]}", flush=True)
    config = vars(args) | {"kinds": list(KINDS), "max_tokens": adaptive_inprocess.MAX_TOKENS,
                           "shared_prefix_tokens": shared_prefix_tokens, "prompt_tokens": prompt_tokens}
    figures = {"summary": summary, "runs": runs}
    if syncs is not None:
        figures["syncs"] = {kind: {"prefill_launches": launched[kind], "sites": dict(counter.most_common())}
                            for kind, counter in syncs.items()}
        print(f"synchronisations inside prefill launches (every run): {figures['syncs']}", flush=True)
    path = write_result("adaptive-prefill-parts", args.device, config, figures, Path(args.out_dir))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
