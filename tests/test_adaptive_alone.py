"""bench/adaptive_alone.py on the bundled model (CPU, a random EAGLE-3 head, short prompts): both kinds time every
step of their timed requests, the adaptive one labelled by its strategy's state, and bad counts are refused."""

from __future__ import annotations

import json
import sys

import pytest

import bench_scripts
from checkpoints import bundled_model_with_draft


@pytest.mark.parametrize("kind", ["plain", "adaptive"])
def test_each_step_of_the_timed_requests_is_timed_and_labelled(kind, tmp_path, monkeypatch):
    bench = bench_scripts.load("adaptive_alone")
    model, draft = bundled_model_with_draft(tmp_path, 3)
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["adaptive_alone.py", kind, "--model", str(model), "--draft", str(draft),
                                      "--device", "cpu", "--requests", "3", "--warm", "1", "--gap", "0",
                                      "--max-tokens", "4", "--shared-prefix-tokens", "32", "--prompt-tokens", "16",
                                      "--out-dir", str(out)])
    bench.main()
    result = json.loads(next(out.glob(f"adaptive-alone-{kind}-cpu*.json")).read_text())
    figures = result["figures"]
    steps = figures["steps"]
    labels = {"plain", "plain+prefill"} if kind == "plain" else {"P", "t", "o", "P+prefill", "t+prefill",
                                                                  "o+prefill"}
    assert set(steps) <= labels and any(label.endswith("+prefill") for label in steps)
    assert sum(row["per_request"] for row in steps.values()) == pytest.approx(figures["steps_per_request"])
    assert sum(row["per_request"] for label, row in steps.items() if label.endswith("+prefill")) == 1.0
    assert figures["steps_per_request"] >= 4  # the prefill and the decode steps of 4 tokens (overlap: one more)
    assert 0 < figures["ttft_ms_mean"] < figures["e2e_ms_mean"]
    assert ("adaptive" in figures) == (kind == "adaptive")
    assert (result["config"]["shared_prefix_tokens"], result["config"]["prompt_tokens"]) == (32, 16)


def test_bad_counts_are_refused(monkeypatch):
    bench = bench_scripts.load("adaptive_alone")
    monkeypatch.setattr(sys, "argv", ["adaptive_alone.py", "plain", "--model", "m", "--draft", "d", "--requests", "0"])
    with pytest.raises(SystemExit, match="--requests, --max-tokens and --prompt-tokens must be >= 1.*got 0"):
        bench.main()
