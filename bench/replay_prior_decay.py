"""How fast the acceptance prior's pseudo-rounds at S should fade (adaptive_policy.PRIOR_DECAY, issue 16), replayed
at concurrency 1 through the real policy (bench/replay_adaptive.py's replay and cost model): adaptive against the
better of plain decoding and fixed rounds over the first N requests, for each fade.

Cases: the recorded 128-token trace (rounds lead; bench/results/accept-trace-cpu-20261123-121800.json) at the
replay's default costs; acceptance like the 1k shared prefix's (drawn per position, mean ~0.28 drafts a round;
0.3 ms plain steps, 0.745 ms rounds as on the H100 x4 at 4b3d27c) over 256-token prompts; and cold starts that read
low at first: one request at 2.0 drafts, two at 1.0, or half a request at 0, each followed by the trace.

Usage (repo root): python bench/replay_prior_decay.py [--decays 512 192 128 96 64] [--requests 64 256 512]
    [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # its sibling
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import replay_adaptive  # noqa: E402
from spruce.bench.common import write_result  # noqa: E402
from spruce.speculative import adaptive_policy  # noqa: E402

TRACE = Path(__file__).resolve().parent / "results" / "accept-trace-cpu-20261123-121800.json"
COST = replay_adaptive.DEFAULT_COST
SHARED_PREFIX_COST = COST | {"plain": 0.30e-3, "round": 0.745e-3}
SHARED_PREFIX_DRAWS = ((0, 0.82), (1, 0.11), (2, 0.04), (3, 0.02), (5, 0.01))  # (drafts, probability): mean 0.28


def shared_prefix_like(num_traces: int, length: int, seed: int = 0) -> list[list[int]]:
    """Per-position acceptance drawn from SHARED_PREFIX_DRAWS."""
    rng = random.Random(seed)
    values, weights = zip(*SHARED_PREFIX_DRAWS)
    return [rng.choices(values, weights, k=length) for _ in range(num_traces)]


def cases() -> list[tuple[str, list[list[int]], list[int], dict]]:
    trace = json.loads(TRACE.read_text())["figures"]
    accept, lens = trace["accept"], [len(p) for p in trace["prompts"]]
    first = lens[0]
    return [("128-token trace", accept, lens, COST),
            ("shared-prefix-like", shared_prefix_like(53, 127), [256] * 53, SHARED_PREFIX_COST),
            ("one request at 2.0, then the trace", [[2] * 127] + accept, [first] + lens, COST),
            ("two requests at 1.0, then the trace", [[1] * 127] * 2 + accept, [first] * 2 + lens, COST),
            ("half a request at 0, then the trace", [[0] * 64 + [3] * 63] + accept, [first] + lens, COST)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decays", type=int, nargs="+", default=[512, 192, 128, 96, 64])
    ap.add_argument("--requests", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument("--out-dir", default="bench/results")
    args = ap.parse_args()
    kept = adaptive_policy.PRIOR_DECAY
    figures = {}
    try:
        for name, accept, lens, cost in cases():
            for n in args.requests:
                row = {}
                for decay in args.decays:
                    adaptive_policy.PRIOR_DECAY = decay
                    res = {mode: replay_adaptive.replay(accept, lens, n, mode, cost)
                           for mode in ("plain", "fixed", "adaptive")}
                    best = max(res["plain"]["tokens_per_second"], res["fixed"]["tokens_per_second"])
                    row[str(decay)] = {"adaptive_vs_better_pct": round(
                        100 * (res["adaptive"]["tokens_per_second"] / best - 1), 2),
                        "rounds": res["adaptive"]["rounds"], "plain_steps": res["adaptive"]["plain"]}
                figures.setdefault(name, {})[str(n)] = row
                print(name, n, {d: r["adaptive_vs_better_pct"] for d, r in row.items()}, flush=True)
    finally:
        adaptive_policy.PRIOR_DECAY = kept
    config = vars(args) | {"trace": TRACE.name, "cost": COST, "shared_prefix_cost": SHARED_PREFIX_COST,
                           "shared_prefix_draws": SHARED_PREFIX_DRAWS}
    print(f"results: {write_result('replay-prior-decay', 'cpu', config, figures, Path(args.out_dir))}")


if __name__ == "__main__":
    main()
