"""Issue 16's adaptive-speculation bar over many `spruce bench serving --launch` results: per workload and
concurrency, the adaptive server pass by pass against the better of the other configurations (plain and fixed;
copies of one configuration averaged, spruce.bench.serving.paired_versus_best_other), run by run and pooled, beside
the spread of the control copy (CONTROL=1: a second copy of the workload's better server, `paired_versus_twin`).

One run's four to six passes cannot tell 5% apart on the H200 (identical servers move 10-40% between passes): the
pooled figures over runs of similar code are what the bar can be judged on. Only results that ran plain, fixed and
adaptive side by side count; their prefix-cache levels only; runs whose servers had different CPU budgets
(--pin-cpus, --cpus-per-server) are pooled apart (`bar_setting`). bench/serving_passes.py splits the same passes by
whether the adaptive server ran the losing choice in them (probes, switches) and by first and later passes.

Usage (repo root): python bench/serving_bar.py bench/results/serving-nvidia-h200-2026112*.json [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
from pathlib import Path

from spruce.bench.common import write_result
from spruce.bench.serving import bar_setting, paired_versus_best_other, paired_versus_twin
from spruce.bench.serving_launch import LaunchConfig

BAR = ("plain", "fixed", "adaptive")


def run_figures(result: dict) -> dict | None:
    """One result's bar figures per concurrency: the adaptive server against the better other configuration and
    the control copy against its twin (None: the result lacks one of plain, fixed and adaptive)."""
    launch = result["config"].get("launch") or []
    config_of = {cfg.name: shlex.join(cfg.flags) for cfg in map(LaunchConfig.parse, launch)}
    if not set(BAR) <= set(config_of):
        return None
    bar_configs = {config_of[name] for name in BAR}
    per_level = result["figures"]["summary"].get("prefix_cache", {})
    out = {}
    for concurrency, per_run in per_level.items():
        per_run = {name: tps for name, tps in per_run.items() if config_of.get(name) in bar_configs}
        if not all(per_run.get(name) for name in BAR):
            continue
        twins = paired_versus_twin(per_run, config_of)
        control = [name for name in twins if name not in BAR]
        out[concurrency] = {"adaptive_vs_better": paired_versus_best_other(per_run, config_of)["adaptive"],
                            "control_vs_twin": twins[control[0]] if control else None,
                            "passes": min(len(per_run[name]) for name in BAR)}
    return out


# Student's t, one-sided 95%, by degrees of freedom (runs - 1); the normal's 1.645 from 31 on
T_ONE_SIDED_95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761,
                  1.753, 1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701,
                  1.699, 1.697)


def one_sided_95(runs: int) -> float:
    """Standard errors below the mean of `runs` figures that its one-sided 95% lower bound lies (Student's t)."""
    return T_ONE_SIDED_95[runs - 2] if runs - 1 <= len(T_ONE_SIDED_95) else 1.645


def pooled(values: list[float]) -> dict:
    """Runs' figures pooled: their mean, median, spread, the mean's standard error (stdev / sqrt(runs)), so that
    a mean can be read against its noise (mean +- 2 standard errors: ~95%), and the one-sided 95% lower bound of
    the mean (`lower_95`, Student's t: the adaptive server is behind by less than this with 95% confidence, all the
    bar can claim from these runs)."""
    stdev = statistics.stdev(values) if len(values) > 1 else None
    mean = statistics.fmean(values)
    stderr = stdev / len(values) ** 0.5 if stdev is not None else None
    return {"runs": len(values), "mean": mean, "median": statistics.median(values), "stdev": stdev,
            "stderr": stderr, "lower_95": mean - one_sided_95(len(values)) * stderr if stderr is not None else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    runs, devices = [], set()
    for path in args.results:
        result = json.loads(path.read_text())
        if result.get("benchmark") != "serving" or "summary" not in result["figures"]:
            continue
        figures = run_figures(result)
        if figures:
            runs.append({"file": path.name, "git_commit": result["git_commit"],
                         "workload": bar_setting(result), "levels": figures})
            devices.add(result["device"])
    table = {}
    for run in runs:
        for concurrency, fig in run["levels"].items():
            cell = table.setdefault(run["workload"], {}).setdefault(concurrency, {"adaptive": [], "control": []})
            cell["adaptive"].append(fig["adaptive_vs_better"])
            if fig["control_vs_twin"] is not None:
                cell["control"].append(fig["control_vs_twin"])
    summary = {w: {c: {"adaptive_vs_better": pooled(cell["adaptive"]),
                       "control_vs_twin": pooled(cell["control"]) if cell["control"] else None}
                   for c, cell in sorted(per_c.items(), key=lambda kv: int(kv[0]))} for w, per_c in table.items()}
    for w, per_c in summary.items():
        print(f"-- {w}: adaptive pass by pass vs the better of plain and fixed, pooled over runs (control vs twin)")
        for c, cell in per_c.items():
            a, ctl = cell["adaptive_vs_better"], cell["control_vs_twin"]
            line = f"   concurrency {c:>3}: {a['runs']:>2} runs, mean {a['mean']:+.1%}, median {a['median']:+.1%}"
            if a["stdev"] is not None:
                line += f", stdev {a['stdev']:.1%}, standard error {a['stderr']:.1%}, 95% lower bound " \
                        f"{a['lower_95']:+.1%}"
            if ctl:
                line += f" | control ({ctl['runs']}) mean {ctl['mean']:+.1%}, mean |.| " + \
                        f"{statistics.fmean(abs(v) for v in table[w][c]['control']):.1%}"
            print(line)
    device = next(iter(devices)) if len(devices) == 1 else "mixed"
    path = write_result("serving-bar", device, {"results": [p.name for p in args.results], "devices": sorted(devices)},
                        {"runs": runs, "pooled": summary}, args.out_dir)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
