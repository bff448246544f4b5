"""The epochs an adaptive server's policy measured, from its log (issue 16): per (load, choice), the seconds a
request-step of its epochs, steady ones (mean batch at least half the load) apart from the rest, and their
prefills per step, as `speculative/epoch_clock.py` logs each epoch it closes at debug level. And its probes, as
`AdaptivePolicy._explore` logs them at info level: per (probed choice, load), how many began, were cut, and were
measured, each measure's measured over priced seconds, and the cost factors after the last (`_probe_factor`; a cut
probe is measured since session 54, `_measured_cut`).

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


PROBE = re.compile(r"adaptive probe( cut| measured)? (\{.*\})")


def probes(lines) -> dict:
    """Per "load/choice" probed: the probes that began, were cut and were measured, each measure's measured over
    priced seconds (in order), and the choice-wide and load's cost factors after the last measure."""
    out: dict[str, dict] = {}
    for line in lines:
        m = PROBE.search(line)
        if m is None:
            continue
        kind, fields = (m.group(1) or "").strip() or "began", json.loads(m.group(2))
        choice = fields.get("choice", "speculative")  # (a cut line names no choice: only probes of rounds are cut)
        row = out.setdefault(f"{fields['load']}/{choice}", {"began": 0, "cut": 0, "measured": 0, "ratios": [],
                                                            "factor": None, "factor_at_load": None})
        if kind == "measured":
            row["ratios"].append(round(fields["measured"] / fields["priced"], 3))
            row["factor"], row["factor_at_load"] = fields["factor"], fields["factor_at_load"]
        row[kind] += 1
    return dict(sorted(out.items(), key=lambda kv: (int(kv[0].split("/")[0]), kv[0])))


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
    lines = [line for path in args.logs for line in open(path)]
    print(json.dumps({"epochs": summarize(parse(lines)), "probes": probes(lines)}, indent=1))


if __name__ == "__main__":
    main()
