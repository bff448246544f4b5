"""Adaptive speculation's policy replayed offline at concurrency 1 (issue 16): recorded acceptance
(bench/accept_trace.py) through the real AdaptivePolicy, with a cost model of the H100 serving runs, against plain
decoding and fixed rounds over the same requests. For policy changes that no GPU run has measured yet: what they do
to the choices and the catch-ups, not what a server's tokens/s will be.

The replay mirrors speculative/adaptive.py at one request: each request's prefill (lazy, the draft lagging by the
prompt, while the policy's steady choice is plain; else with the draft's extend), then per decode step the standing
decision (`repeat`) or a new one (`decide`), a catch-up before a round over a lagging draft, and the policy fed as
the CPU path feeds it (the step's time as device time; catch-ups excluded from epochs). A round over a request at
output position p commits accept[p] + 1 tokens. Costs (seconds; defaults fitted to the H100 runs of 2026-11-23 at
concurrency 1: a plain server's tpot 0.275 ms, a fixed one's 0.174 ms x 4.15 tokens per round, a catch-up's fitted
2.8 ms + 10 us per position, TTFT 13.5 vs 16.5 ms): --plain, --round, --prefill, --extend, --catch-up-fixed,
--catch-up-per-position. The cost model holds at concurrency 1 only: above it, prefill batching and the batch's
fill decide more than the steps (the serving benchmark measures those).

Usage (repo root): python bench/replay_adaptive.py TRACE_JSON [--requests 256] [--collapse-fraction F]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from spruce.speculative import adaptive_policy
from spruce.speculative.adaptive_policy import PLAIN, SPECULATIVE, AdaptivePolicy

BUCKETS = (1, 2, 4, 8)
DEFAULT_COST = {"plain": 0.275e-3, "round": 0.72e-3, "prefill": 13.5e-3, "extend": 3e-3, "catch_up_fixed": 2.8e-3,
                "catch_up_per_position": 10e-6}  # seconds (module docstring: the H100 runs of 2026-11-23)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Request:
    """One replayed request: its acceptance at every output position, where it is, how far its draft lags."""

    def __init__(self, accept: list[int], prompt_len: int):
        self.accept, self.prompt_len = accept, prompt_len
        self.pos = 0  # output[pos] is the last token committed (output[0] came from the prefill)
        self.lag = 0
        self.accept_state = None  # the policy's record of its acceptance


def replay(accept: list[list[int]], prompt_lens: list[int], num_requests: int, mode: str, cost: dict,
           probe_budget: float | None = None) -> dict:
    """Replay `num_requests` requests (the traces in turn) one at a time under `mode` (plain, fixed, adaptive), the
    adaptive policy's probes given `probe_budget` of the time (None: its default). Also each request's rounds, in
    order ("rounds_per_request")."""
    clock = Clock()
    table = {(c, b): cost["plain"] if c == PLAIN else cost["round"] for c in (PLAIN, SPECULATIVE) for b in BUCKETS}
    policy = AdaptivePolicy(BUCKETS, table, overlapped=False, max_accept=5, clock=clock, probe_budget=probe_budget)
    last = None  # the choice of the decision that may stand
    counts = {"plain": 0, "rounds": 0, "catch_ups": 0, "tokens": 0}
    rounds_per_request = []
    for r in range(num_requests):
        i = r % len(accept)
        req = Request(accept[i], prompt_lens[i])
        out_len = len(req.accept) + 1
        policy.break_chain(arrivals=1)  # its prefill completes its prompt
        lazy = mode == "adaptive" and policy.steady_choice(1) == PLAIN
        step = cost["prefill"] + (cost["extend"] if mode != "plain" and not lazy else 0.0)
        if mode == "adaptive" and not lazy:
            policy.drafts_joined()  # as AdaptiveDecoding.prefill: its draft is current
            policy.prompt_extend_launched(cost["extend"])
        clock.now += step
        if mode == "adaptive":
            policy.waited(step)
            if not lazy:
                policy.drafted_prompts(1, cost["extend"], 0.0)
        req.lag = req.prompt_len if lazy else 0
        counts["tokens"] += 1
        rounds_before = counts["rounds"]
        while req.pos < out_len - 1:
            lagging, decided = 0, None
            if mode != "adaptive":
                choice = PLAIN if mode == "plain" else SPECULATIVE
            elif last == PLAIN and policy.repeat(PLAIN, 1):
                choice = PLAIN
                req.lag += 1
            elif last == SPECULATIVE and not req.lag and policy.repeat(SPECULATIVE, 1):
                choice = SPECULATIVE
            else:
                decided = policy.decide([req], [req.lag], out_len - 1 - req.pos, out_len, req.prompt_len)
                choice = last = decided.choice
                if choice == SPECULATIVE:
                    lagging, req.lag = req.lag, 0
                else:
                    req.lag += 1
            catch_up = cost["catch_up_fixed"] + cost["catch_up_per_position"] * lagging if lagging else 0.0
            if lagging:
                policy.catch_up_launched(catch_up)
                counts["catch_ups"] += 1
            seconds = cost["plain"] if choice == PLAIN else cost["round"]
            clock.now += catch_up + seconds
            accepted = min(req.accept[req.pos], out_len - 2 - req.pos) if choice == SPECULATIVE else 0
            req.pos += accepted + 1
            counts["tokens"] += accepted + 1
            counts["plain" if choice == PLAIN else "rounds"] += 1
            if decided is not None:
                policy.waited(catch_up + seconds)
                if lagging:
                    policy.caught_up(lagging, catch_up, 0.0)
                policy.measured(choice, decided.bucket, seconds)
            if mode == "adaptive" and choice == SPECULATIVE:
                policy.accepted_round([req], [accepted])
        rounds_per_request.append(counts["rounds"] - rounds_before)
    return counts | {"seconds": clock.now, "tokens_per_second": counts["tokens"] / clock.now,
                     "rounds_per_request": rounds_per_request}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--collapse-fraction", type=float, default=adaptive_policy.COLLAPSE_FRACTION)
    for key, value in DEFAULT_COST.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=float, default=value)
    args = parser.parse_args()
    adaptive_policy.COLLAPSE_FRACTION = args.collapse_fraction
    trace = json.loads(args.trace.read_text())["figures"]
    cost = {key: getattr(args, key) for key in DEFAULT_COST}
    lens = [len(p) for p in trace["prompts"]]
    results = {mode: replay(trace["accept"], lens, args.requests, mode, cost)
               for mode in ("plain", "fixed", "adaptive")}
    for figures in results.values():
        del figures["rounds_per_request"]
    best = max(results["plain"]["tokens_per_second"], results["fixed"]["tokens_per_second"])
    print(json.dumps({"cost": cost, "collapse_fraction": args.collapse_fraction, "results": results,
                      "adaptive_vs_better": results["adaptive"]["tokens_per_second"] / best - 1}, indent=1))


if __name__ == "__main__":
    main()
