"""`spruce bench parity`: the CLI end to end on the bundled model (float32: no divergence), the divergence
and near-tie logic on handcrafted logits, and the teacher-forced logits helper."""

from __future__ import annotations

import json

import pytest
import torch

from spruce import SamplingParams
from spruce.bench.parity import divergence_record, first_divergence, target_logits, token_deficits, verdict
from spruce.cli import main

PROMPTS = ["def fib(n):\n    if n < 2:\n", "import os\nimport sys\n\n\nclass Config:\n"]


def test_cli_float32_has_no_divergence(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in PROMPTS))
    out = tmp_path / "parity.json"
    code = main(["bench", "parity", "--prompts", str(prompts), "--num-prompts", "2", "--max-tokens", "8",
                 "--spec", "3,1,4", "3,2,6", "--page-sizes", "1,16", "--device", "cpu", "--dtype", "float32",
                 "--out", str(out)])
    assert code == 0
    res = json.loads(out.read_text())
    assert res["benchmark"] == "parity" and res["device"].startswith("cpu") and res["git_commit"]
    assert res["config"]["max_tokens"] == 8 and res["config"]["page_sizes"] == [1, 16]
    figures = res["figures"]
    assert figures["verdict"] == "identical" and figures["num_divergences"] == 0
    assert [(r["page_size"], r["spec"]["eagle_topk"]) for r in figures["runs"]] == [(1, 1), (1, 2), (16, 1), (16, 2)]
    for run in figures["runs"]:
        assert run["spec"]["num_steps"] == 3 and run["num_prompts"] == 2 and run["matched_prompts"] == 2
        assert run["tokens"] == run["tokens_before_first_divergence"] == 16 and run["divergences"] == []
        assert run["spec_stats"]["mean_accept_length"] >= 1


def logits_rows(rows: list[dict[int, float]], vocab: int = 6) -> torch.Tensor:
    """[n, vocab] logits: 0 everywhere but the given {token: logit} entries of each row."""
    out = torch.zeros(len(rows), vocab)
    for i, row in enumerate(rows):
        for tok, val in row.items():
            out[i, tok] = val
    return out


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 4, 3]) == 1
    assert first_divergence([7], [8]) == 0


def test_near_tie_divergence():
    """Position 1: tokens 2 and 3 within 0.1 of each other; each run's tokens are its own argmax elsewhere."""
    plain, spec = [1, 2, 4], [1, 3, 5]
    plain_logits = logits_rows([{1: 5.0}, {2: 4.0, 3: 3.9}, {4: 2.0}])
    spec_logits = logits_rows([{1: 5.0}, {2: 4.0, 3: 3.9}, {5: 2.0}])
    rec = divergence_record(plain, spec, plain_logits, spec_logits, threshold=0.5)
    assert (rec["position"], rec["plain_token"], rec["spec_token"]) == (1, 2, 3)
    for view in (rec["plain_run"], rec["spec_run"]):
        assert view["argmax"] == 2
        assert view["top2_gap"] == pytest.approx(0.1) and view["spec_token_deficit"] == pytest.approx(0.1)
        assert view["plain_token_deficit"] == 0.0
    assert rec["plain_run"]["max_deficit_of_own_tokens"] == 0.0
    assert rec["spec_run"]["max_deficit_of_own_tokens"] == pytest.approx(0.1)
    assert rec["logits_max_abs_diff_at_position"] == 0.0
    assert rec["near_tie"] and verdict([rec]) == "near-ties"


def test_spec_token_far_below_the_top_is_a_bug():
    """The spec token is 3 logits below the argmax, while the top-2 gap (2 vs 1) is tiny: flagged."""
    plain, spec = [2], [5]
    logits = logits_rows([{2: 4.0, 1: 3.95, 5: 1.0}])
    rec = divergence_record(plain, spec, logits, logits, threshold=0.5)
    assert rec["plain_run"]["top2_gap"] == pytest.approx(0.05)
    assert rec["spec_run"]["spec_token_deficit"] == pytest.approx(3.0)
    assert not rec["near_tie"] and rec["worst_deficit"] == pytest.approx(3.0)
    assert verdict([rec]) == "NOT near-tie: bug"


def test_wrong_token_after_a_near_tie_is_a_bug():
    """A near-tie at position 0, then the spec run emits a token 2 logits below its own argmax."""
    plain, spec = [1, 1], [2, 4]
    plain_logits = logits_rows([{1: 3.0, 2: 2.9}, {1: 3.0}])
    spec_logits = logits_rows([{1: 3.0, 2: 2.9}, {3: 2.5, 4: 0.5}])
    rec = divergence_record(plain, spec, plain_logits, spec_logits, threshold=0.5)
    assert rec["spec_run"]["spec_token_deficit"] == pytest.approx(0.1)
    assert rec["spec_run"]["max_deficit_of_own_tokens"] == pytest.approx(2.0)
    assert not rec["near_tie"] and verdict([rec, {"near_tie": True}]) == "NOT near-tie: bug"
    assert verdict([]) == "identical"


def test_target_logits_reproduce_greedy_and_free_their_pages(make_llm):
    """Teacher-forced logits (prompt longer than a prefill chunk) pick exactly the plain greedy tokens."""
    llm = make_llm(page_size=4, chunked_prefill_size=16)
    prompt = llm.tokenizer.encode(PROMPTS[1] + PROMPTS[0])
    assert len(prompt) > 16
    out = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    logits = target_logits(llm, prompt, out)  # [12, V]
    assert logits.shape == (12, llm.engine.runner.model_config.vocab_size) and logits.dtype == torch.float32
    assert logits.argmax(dim=1).tolist() == out
    assert torch.all(token_deficits(logits, out) == 0)
    assert llm.engine.runner.allocator.num_used == llm.engine.scheduler.cached_pages


def test_tp_parity_cli_float32_is_identical(tmp_path):
    """`spruce bench tp-parity` on the cpu (gloo, 2 processes): float32 tp=2 gives tp=1's tokens."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in PROMPTS))
    code = main(["bench", "tp-parity", "--prompts", str(prompts), "--num-prompts", "2", "--max-tokens", "6",
                 "--tp-size", "2", "--device", "cpu", "--dtype", "float32", "--out-dir", str(tmp_path)])
    assert code == 0
    (path,) = tmp_path.glob("tp-parity-*.json")
    figures = json.loads(path.read_text())["figures"]
    assert figures["verdict"] == "identical" and figures["token_match_rate"] == 1.0 and figures["tokens"] == 12


def test_tp_parity_divergence_entry_names_both_views():
    """A tp=N token far below the top logit is reported as no near-tie, seen by both engines (here the same
    one-process engine stands in for both)."""
    from spruce import LLM
    from spruce.bench.tp_parity import describe, divergence_entry

    llm = LLM(page_size=16, max_running_requests=2)
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    prompt, a = out.prompt_token_ids, out.token_ids
    b = a[:3] + [(a[3] + 17) % 4096] + a[4:]
    d = divergence_entry(llm, llm, prompt, a, b, 0.5, 2)
    assert (d["position"], d["tp1_token"], d["tp2_token"], d["near_tie"]) == (3, a[3], b[3], False)
    assert d["seen_by_tp2"]["tp2_run"]["top2_gap"] >= 0.0
    assert d["seen_by_tp1"]["tp2_token"] == b[3] and "NOT A NEAR-TIE" in describe({"prompt_index": 0, **d}, 2)
