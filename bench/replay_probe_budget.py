"""The adaptive policy's probe budget (`speculative_adaptive_probe_budget`) replayed at concurrency 1 (issue 16): what
exploration costs where plain steps win by far, against how soon rounds take the load back once the workload
changes, through the real AdaptivePolicy (bench/replay_adaptive.py's replay and cost model).

Two workloads of synthetic acceptance, each request 128 tokens:
- stationary: every round accepts ~0.33 drafts (P(1) = 0.25, P(2) = 0.04: the 1k shared prefix's ~0.3), so rounds
  commit ~1.3 tokens in `round` seconds against a plain step's one in `plain` (with the default costs, the H200's
  serving bar: 0.70 and 0.26 ms, rounds at ~0.5x plain steps' tokens/s). Per budget: the adaptive replay's tokens/s
  against plain decoding's over `--requests` requests, and its rounds after the cold start's (the probes').
- change: the same for `--before` requests, then requests whose rounds accept 4 drafts (rounds ~2x plain steps'
  tokens/s). Per budget: how many requests after the change until rounds run in `TAKEN_OVER` requests in a row
  (None: not within `--after`), for CHANGES change points CHANGE_STEP requests apart (where the change falls in the
  probes' cycle decides much of it): each, their mean and their largest.

Usage (repo root): python bench/replay_probe_budget.py [--budgets 0.005 0.0025 0.001 0] [--requests 1024]
    [--before 512] [--after 1024] [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # its sibling, also when loaded as a module (tests)
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import replay_adaptive  # noqa: E402

from spruce.bench.common import write_result  # noqa: E402
from spruce.config import ADAPTIVE_PROBE_BUDGET  # noqa: E402

COST = {"plain": 0.26e-3, "round": 0.70e-3, "prefill": 2e-3, "extend": 1e-3, "catch_up_fixed": 1.5e-3,
        "catch_up_per_position": 3e-6}  # seconds: the H200 bar's steps at concurrency 1 (session 57)
OUTPUT_TOKENS = 128
PROMPT_TOKENS = 256
TRACES = 64  # distinct requests drawn per workload (the replay takes them in turn)
COLD_START = 16  # requests whose rounds are the cold start's, not probes
TAKEN_OVER = 8  # requests in a row with rounds: rounds hold the load
CHANGES, CHANGE_STEP = 8, 160  # change points replayed, requests apart (spanning the slowest budgets' probe cycles)


def low_acceptance(rng: random.Random) -> list[list[int]]:
    """TRACES requests whose every round accepts 0, 1 or 2 drafts (P = 0.71, 0.25, 0.04: ~0.33 a round)."""
    def draw() -> int:
        u = rng.random()
        return 2 if u < 0.04 else 1 if u < 0.29 else 0
    return [[draw() for _ in range(OUTPUT_TOKENS - 1)] for _ in range(TRACES)]


def stationary(budget: float, requests: int, cost: dict, rng_seed: int = 0) -> dict:
    """Rounds at ~0.5x plain steps throughout: the adaptive replay against plain decoding, and its probes' rounds."""
    traces = low_acceptance(random.Random(rng_seed))
    lens = [PROMPT_TOKENS] * len(traces)
    plain = replay_adaptive.replay(traces, lens, requests, "plain", cost)
    adaptive = replay_adaptive.replay(traces, lens, requests, "adaptive", cost, probe_budget=budget)
    probed = [n for n in adaptive["rounds_per_request"][COLD_START:] if n]
    return {"adaptive_vs_plain_pct": round(100 * (adaptive["tokens_per_second"] / plain["tokens_per_second"] - 1), 3),
            "probe_requests": len(probed), "probe_rounds": sum(probed)}


def taken_over(budget: float, before: int, after: int, cost: dict, rng_seed: int = 0) -> int | None:
    """`before` requests at ~0.33 drafts a round, then `after` at 4: the requests after the change until rounds run
    in TAKEN_OVER requests in a row (None: never within `after`)."""
    low = low_acceptance(random.Random(rng_seed))
    traces = [low[i % TRACES] for i in range(before)] + [[4] * (OUTPUT_TOKENS - 1)] * after
    figures = replay_adaptive.replay(traces, [PROMPT_TOKENS] * len(traces), len(traces), "adaptive", cost,
                                     probe_budget=budget)
    run = 0
    for k, n in enumerate(figures["rounds_per_request"][before:]):
        run = run + 1 if n else 0
        if run == TAKEN_OVER:
            return k + 1 - TAKEN_OVER
    return None


def change(budget: float, before: int, after: int, cost: dict) -> dict:
    """`taken_over` at CHANGES change points from `before` on, CHANGE_STEP requests apart: each, their mean and their
    largest (None where any never was within `after`)."""
    each = [taken_over(budget, before + k * CHANGE_STEP, after, cost) for k in range(CHANGES)]
    known = None not in each
    return {"requests_until_rounds": each, "mean_requests_until_rounds": sum(each) / len(each) if known else None,
            "most_requests_until_rounds": max(each) if known else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", type=float, nargs="+", default=[ADAPTIVE_PROBE_BUDGET, 0.0025, 0.001, 0.0])
    ap.add_argument("--requests", type=int, default=1024, help="stationary workload's requests")
    ap.add_argument("--before", type=int, default=512, help="requests before the change")
    ap.add_argument("--after", type=int, default=1024, help="requests after it")
    ap.add_argument("--out-dir", default="bench/results")
    args = ap.parse_args()
    figures = {}
    for budget in args.budgets:
        figures[str(budget)] = (stationary(budget, args.requests, COST)
                                | change(budget, args.before, args.after, COST))
        print(f"budget {budget:g}: {figures[str(budget)]}", flush=True)
    config = vars(args) | {"cost": COST, "output_tokens": OUTPUT_TOKENS, "prompt_tokens": PROMPT_TOKENS,
                           "traces": TRACES, "cold_start": COLD_START, "taken_over": TAKEN_OVER, "changes": CHANGES,
                           "change_step": CHANGE_STEP}
    print(f"results: {write_result('replay-probe-budget', 'cpu', config, figures, Path(args.out_dir))}")


if __name__ == "__main__":
    main()
