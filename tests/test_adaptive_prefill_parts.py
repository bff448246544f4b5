"""bench/adaptive_prefill_parts.py on the bundled model (CPU, a random EAGLE-3 head, 4-token requests): each
prefill's parts are timed for both engines (the adaptive ones only for the forced engine), cohort and trickled
arrivals both run, and `--scheduler-delay-factor` and `--workload` reach the engines and prompts."""

from __future__ import annotations

import json
import sys

import bench_scripts
from checkpoints import bundled_model_with_draft


def test_prefill_parts_are_timed_for_both_engines(tmp_path, monkeypatch):
    bench = bench_scripts.load("adaptive_prefill_parts")
    model, draft = bundled_model_with_draft(tmp_path, 3)
    out = tmp_path / "out"
    monkeypatch.setattr(bench.adaptive_inprocess, "MAX_TOKENS", 4)
    monkeypatch.setattr(sys, "argv", ["adaptive_prefill_parts.py", "--model", str(model), "--draft", str(draft),
                                      "--device", "cpu", "--workload", "short", "--concurrency", "2", "--trickle",
                                      "--repeats", "1", "--requests", "4", "--scheduler-delay-factor", "2",
                                      "--out-dir", str(out)])
    built = []

    def build(kind, args, original=bench.adaptive_inprocess.build):  # the engines main() builds, kept for their config
        llm = original(kind, args)
        built.append(llm)
        return llm

    monkeypatch.setattr(bench.adaptive_inprocess, "build", build)
    bench.main()
    assert [llm.engine.config.scheduler_delay_factor for llm in built] == [2.0, 2.0]
    result = json.loads(next(out.glob("adaptive-prefill-parts-cpu*.json")).read_text())
    assert set(result["figures"]["runs"]) == {"cohort-2", "trickle-2"}
    for label, runs in result["figures"]["runs"].items():
        (plain,), (forced,) = runs["plain"], runs["forced"]
        assert plain["prefills"] > 0 and forced["prefills"] > 0, label
        assert set(plain["us_per_prefill"]) == {"launch", "strategy_prefill", "target_forward"}
        assert {"launch", "strategy_prefill", "target_forward", "lazy_chunks", "extend_draft",
                "steady_choice"} <= set(forced["us_per_prefill"])
        for row in (plain, forced):  # the parts lie within the launch
            parts = row["us_per_prefill"]
            assert 0 < parts["target_forward"] <= parts["strategy_prefill"] <= parts["launch"]
        assert 0 <= forced["under_ticket"] <= forced["prefills"]
    assert (result["config"]["shared_prefix_tokens"], result["config"]["prompt_tokens"]) == (0, 128)  # --workload
