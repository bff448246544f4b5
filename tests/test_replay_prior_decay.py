"""bench/replay_prior_decay.py on the CPU: every case and fade is replayed and written, and over the first requests
of the shared-prefix-like case (rounds accepting ~0.28 drafts) a faster fade runs fewer rounds on the prior."""

from __future__ import annotations

import json
import sys

import bench_scripts
from spruce.speculative import adaptive_policy


def test_replay_prior_decay_writes_every_case(tmp_path, monkeypatch):
    bench = bench_scripts.load("replay_prior_decay")
    kept = adaptive_policy.PRIOR_DECAY
    monkeypatch.setattr(sys, "argv", ["replay_prior_decay.py", "--decays", "512", "128", "--requests", "16",
                                      "--out-dir", str(tmp_path)])
    bench.main()
    assert adaptive_policy.PRIOR_DECAY == kept  # restored
    (path,) = tmp_path.glob("replay-prior-decay-*.json")
    figures = json.loads(path.read_text())["figures"]
    assert set(figures) == {name for name, *_ in bench.cases()}
    shared = figures["shared-prefix-like"]["16"]
    assert shared["128"]["rounds"] < shared["512"]["rounds"], shared
    assert shared["128"]["adaptive_vs_better_pct"] > shared["512"]["adaptive_vs_better_pct"], shared
