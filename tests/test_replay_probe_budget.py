"""bench/replay_probe_budget.py: the adaptive policy's probe budget replayed at concurrency 1, where plain steps win
2:1 and then the workload changes so that rounds win. A smaller budget spends fewer rounds on probes and takes longer
to hand the load back to rounds; a budget of 0 never does (the cold start's probes were its last)."""

from __future__ import annotations

import json
import sys

import bench_scripts


def test_a_smaller_budget_probes_less_and_notices_a_change_later(tmp_path, monkeypatch):
    bench = bench_scripts.load("replay_probe_budget")
    monkeypatch.setattr(bench, "CHANGES", 2)
    monkeypatch.setattr(sys, "argv", ["replay_probe_budget.py", "--budgets", "0.005", "0.001", "0", "--requests",
                                      "1024", "--before", "256", "--after", "1024", "--out-dir", str(tmp_path)])
    bench.main()
    figures = json.loads(next(tmp_path.glob("replay-probe-budget-*.json")).read_text())["figures"]
    default, small, none = figures["0.005"], figures["0.001"], figures["0.0"]
    assert default["probe_rounds"] > small["probe_rounds"] >= none["probe_rounds"] == 0
    assert default["adaptive_vs_plain_pct"] < small["adaptive_vs_plain_pct"] <= none["adaptive_vs_plain_pct"] < 0
    assert default["most_requests_until_rounds"] < small["most_requests_until_rounds"]
    assert none["requests_until_rounds"] == [None, None] and none["mean_requests_until_rounds"] is None
