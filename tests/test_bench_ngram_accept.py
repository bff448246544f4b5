"""`python -m spruce.bench.ngram_accept` on the CPU: spruce alone (vLLM skipped), one JSON with each engine's
acceptance, speed and equality with plain decoding."""

from __future__ import annotations

import json

from spruce.bench.ngram_accept import copy_prompt, main


def test_copy_prompt_repeats_its_beginning():
    assert copy_prompt("abcdefgh", 6, 2) == "abcdef\n\n\nab"


def test_cpu_run_writes_one_json(tmp_path):
    out = tmp_path / "ngram.json"
    assert main(["--out", str(out), "--device", "cpu", "--num-prompts", "2", "--max-tokens", "6", "--body-chars", "200",
                 "--head-chars", "30", "--spruce-topk", "2", "--prompt-lookup-min", "1"]) == 0
    result = json.loads(out.read_text())
    engines = result["engines"]
    assert set(engines) == {"spruce_plain", "spruce_ngram_k2", "vllm_ngram"}
    assert "skipped" in engines["vllm_ngram"]
    ngram = engines["spruce_ngram_k2"]
    assert ngram["equal_to_plain"] and ngram["speculative"] == "NGRAM S=5 K=2 N=11"
    assert ngram["mean_acceptance_length"] >= 1.0 and ngram["tokens_per_s"] > 0
    assert result["config"]["prompt_lookup_min"] == 1 and result["config"]["num_prompts"] == 2
