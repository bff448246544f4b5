"""The epochs an adaptive server's policy measured, from its log (issue 16): per (load, choice), the seconds a
request-step of its epochs, steady ones (mean batch at least half the load) apart from the rest, and their
prefills per step, as `speculative/epoch_clock.py` logs each epoch it closes at debug level.

For the realized figures that price the choices (`AdaptivePolicy._realized`, the low median of recent epochs): on the
H100 (2026-11-25, 1k shared prefix) switches to rounds at loads 8-64 were priced by plain figures of 64-126 us a
request-step, ~2x what served plain steps cost, and these lines tell which epochs read high. Run the serving bar with
ADAPTIVE_EXTRA="--log-level debug" (bench/device_serving_prefix.sh), whose adaptive-policy.log holds these lines.

Usage (repo root): python bench/adaptive_epochs.py LOG [LOG ...]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics

EPOCH = re.compile(r"epoch (plain|speculative) at load (\d+): (\d+) steps \(per cost bucket \{[^}]*\}\), "
                   r"(\d+) request-steps, batch (\d+) to (\d+), (\d+) prefills, (\d+) arrivals, busy ([\d.]+) s, "
                   r"modelled ([\d.]+) s, ratio ([\d.]+), ([\d.]+) us a request-step( \(looks drained)?")


def parse(lines) -> list[dict]:
    """The epochs logged in `lines`, each a dict (drained: it looked drained and was judged with the next)."""
    epochs = []
    for line in lines:
        m = EPOCH.search(line)
        if m is None:
            continue
        choice, load, steps, request_steps, first, last, prefills, arrivals, busy, modelled, ratio, us, drained = (
            m.groups())
        epochs.append({"choice": choice, "load": int(load), "steps": int(steps), "request_steps": int(request_steps),
                       "first_batch": int(first), "last_batch": int(last), "prefills": int(prefills),
                       "arrivals": int(arrivals), "busy_s": float(busy), "modelled_s": float(modelled),
                       "ratio": float(ratio), "us_per_request_step": float(us), "drained": drained is not None})
    return epochs


def summarize(epochs: list[dict]) -> dict:
    """Per "load/choice": epochs, and for steady ones (mean batch >= half the load) and the rest: their count, median
    us a request-step and median prefills a step."""
    groups = collections.defaultdict(lambda: {"steady": [], "other": []})
    for e in epochs:
        steady = e["request_steps"] / e["steps"] >= e["load"] / 2
        groups[(e["load"], e["choice"])]["steady" if steady else "other"].append(e)
    out = {}
    for (load, choice), parts in sorted(groups.items()):
        row = {}
        for name, group in parts.items():
            row[name] = {"epochs": len(group),
                         "median_us_per_request_step": (statistics.median(e["us_per_request_step"] for e in group)
                                                        if group else None),
                         "median_prefills_per_step": (statistics.median(e["prefills"] / e["steps"] for e in group)
                                                      if group else None)}
        out[f"{load}/{choice}"] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+")
    args = ap.parse_args()
    epochs = [e for path in args.logs for e in parse(open(path))]
    print(json.dumps(summarize(epochs), indent=1))


if __name__ == "__main__":
    main()
