"""bench/adaptive_inprocess.py on the bundled model (CPU, a random EAGLE-3 head, 4-token requests): the engines
`--kinds` names are built as named (fixed: not adaptive; rounds: adaptive with plain steps priced out, so it runs
rounds only; fixed-S-K-N from `--shapes`: a fixed round of that tree shape; adaptive-N-N' from `--widths`: adaptive
over (5, 4, N) rounds that may verify N' nodes), `--workload short` sends the 128-token
prompts without a shared prefix, `--idle-gaps` lets the engine go idle before each request added while none is in
flight (each request at concurrency 1 is followed by an idle step; without it only the last), and
`--profile` writes each engine's cProfile report; `--scheduler-delay-factor` gives the engines the servers' prefill
batching, and each repetition reports its prefill launches' seconds and the admission rounds held."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import bench_scripts
from checkpoints import bundled_model_with_draft


def set_argv(monkeypatch, bench, tmp_path, max_tokens: int, *flags: str) -> Path:
    """bench/adaptive_inprocess.py's command line over the bundled model and a random EAGLE-3 head on the CPU, its
    requests `max_tokens` long, with `flags`; the directory its result goes to."""
    model, draft = bundled_model_with_draft(tmp_path, 2)
    out = tmp_path / "out"
    monkeypatch.setattr(bench, "MAX_TOKENS", max_tokens)
    monkeypatch.setattr(sys, "argv", ["adaptive_inprocess.py", "--model", str(model), "--draft", str(draft),
                                      "--device", "cpu", *flags, "--out-dir", str(out)])
    return out


def test_kinds_workload_and_profile_are_honoured(tmp_path, monkeypatch):
    bench = bench_scripts.load("adaptive_inprocess")
    out = set_argv(monkeypatch, bench, tmp_path, 4, "--kinds", "fixed", "rounds", "--shapes", "2,2,3", "--widths",
                   "16,8", "--workload", "short", "--idle-gaps", "--concurrency", "1", "--repeats", "1", "--requests",
                   "2", "--profile", "--scheduler-delay-factor", "4")
    built = []

    def build(kind, args, original=bench.build):  # the engines main() builds, kept for their config
        llm = original(kind, args)
        built.append(llm)
        return llm

    monkeypatch.setattr(bench, "build", build)
    bench.main()
    assert {llm.engine.config.scheduler_delay_factor for llm in built} == {4.0} and len(built) == 4
    result = json.loads(next(out.glob("adaptive-inprocess-cpu*.json")).read_text())
    assert result["config"]["kinds"] == ["fixed", "rounds", "fixed-2-2-3", "adaptive-16-8"]
    assert result["config"]["speculative"] == {"fixed": "EAGLE3 S=5 K=4 N=8", "rounds": "EAGLE3 S=5 K=4 N=8 adaptive",
                                               "fixed-2-2-3": "EAGLE3 S=2 K=2 N=3",
                                               "adaptive-16-8": "EAGLE3 S=5 K=4 N=16 adaptive widths=8,16"}
    (widths,) = result["figures"]["runs"]["1"]["adaptive-16-8"]
    assert set(widths["adaptive_total"]["tree_width"]["rounds"]) == {"8", "16"}  # (JSON keys)
    (shaped,) = result["figures"]["runs"]["1"]["fixed-2-2-3"]
    assert shaped["adaptive_total"] is None and shaped["steps"]["rounds"] == shaped["steps"]["decodes"] > 0
    assert (result["config"]["shared_prefix_tokens"], result["config"]["prompt_tokens"]) == (0, 128)
    (fixed,), (rounds,) = result["figures"]["runs"]["1"]["fixed"], result["figures"]["runs"]["1"]["rounds"]
    assert fixed["adaptive_total"] is None and fixed["steps"]["rounds"] == fixed["steps"]["decodes"] > 0
    assert fixed["idle_steps"] == 16 and result["config"]["idle_gaps"]  # 16 requests (16 a concurrency at least)
    assert fixed["prefill_launch_ms"] > 0 and fixed["prefill_holds"] == 0  # (concurrency 1: nothing decodes while
    # a request waits, so none is held)
    assert rounds["adaptive_total"]["chosen"]["plain"] == 0 and rounds["adaptive_total"]["chosen"]["speculative"] > 0
    assert "vs_fixed" in result["figures"]["summary"]["1"]["rounds"]
    for kind in ("fixed", "rounds"):
        assert "function calls" in (out / f"adaptive-inprocess-profile-{kind}-1.txt").read_text()


def test_paired_ratios_per_repetition_and_host_speed_adjusted():
    """Each repetition's tokens/s over the base's of that repetition, and the same scaled by their output processing
    seconds per decode row (the host's speed): a repetition on a host 20% slower whose engine did the same work per
    host second reads -20% measured and 0% adjusted."""
    bench = bench_scripts.load("adaptive_inprocess")

    def rep(tokens_per_s, outputs_ms, rows=1000):
        return {"tokens_per_s": tokens_per_s, "step_host_ms": {"outputs": outputs_ms}, "steps": {"decode_rows": rows}}

    base = [rep(100.0, 10.0), rep(100.0, 10.0)]
    mine = [rep(80.0, 12.5), rep(110.0, 10.0)]  # a slower host, then the same host and 10% faster
    figures = bench.paired(mine, base)
    assert figures["unadjusted"]["n"] == 2
    assert abs(figures["unadjusted"]["mean"] - (-0.2 + 0.1) / 2) < 1e-12
    assert abs(figures["host_adjusted"]["mean"] - (0.0 + 0.1) / 2) < 1e-12
    assert abs(figures["outputs"]["mean"] - 0.125) < 1e-12
    assert bench.paired(mine[:1], base[:1]) is None  # one repetition: no spread to judge


def test_warm_runs_go_unrecorded_before_the_timed_repetitions(tmp_path, monkeypatch):
    """--warm-runs N: at each concurrency every engine runs N closed loops of it before the timed repetitions (on
    prompts past the timed ones), and only the timed ones reach the result."""
    bench = bench_scripts.load("adaptive_inprocess")
    out = set_argv(monkeypatch, bench, tmp_path, 2, "--kinds", "plain", "--concurrency", "2", "--repeats", "1",
                   "--requests", "2", "--warm-runs", "2")
    calls = []

    def closed_loop(llm, prompts, first, concurrency, num_requests, *flags, original=bench.closed_loop):
        calls.append((first, concurrency, num_requests))
        return original(llm, prompts, first, concurrency, num_requests, *flags)

    monkeypatch.setattr(bench, "closed_loop", closed_loop)
    bench.main()
    level = [call for call in calls if call[1] == 2 and call[2] == 32]  # 16 x concurrency requests a loop
    assert level == [(32, 2, 32), (64, 2, 32), (0, 2, 32)]  # two warm loops past the timed prompts, then the timed
    result = json.loads(next(out.glob("adaptive-inprocess-cpu*.json")).read_text())
    assert len(result["figures"]["runs"]["2"]["plain"]) == 1 and result["config"]["warm_runs"] == 2


def test_per_request_records_and_excess_by_class(tmp_path, monkeypatch):
    """--per-request: every request's [e2e ms, TTFT ms, rounds in flight] in the order sent (rounds None without an
    adaptive policy; an adaptive engine priced into rounds counts rounds in every request), and per_request_excess
    splits a kind's excess over the base by requests that saw rounds, the AFTER_ROUNDS after them, and the others."""
    bench = bench_scripts.load("adaptive_inprocess")
    out = set_argv(monkeypatch, bench, tmp_path, 4, "--kinds", "plain", "rounds", "--workload", "short",
                   "--idle-gaps", "--concurrency", "1", "--repeats", "2", "--requests", "16", "--per-request")
    bench.main()
    result = json.loads(next(out.glob("adaptive-inprocess-cpu*.json")).read_text())
    runs = result["figures"]["runs"]["1"]
    for plain, rounds in zip(runs["plain"], runs["rounds"]):
        assert len(plain["requests"]) == len(rounds["requests"]) == 16
        assert all(record[2] is None and record[0] >= record[1] > 0 for record in plain["requests"])
        assert all(record[2] > 0 for record in rounds["requests"])  # (4 tokens: at least one round each)
    excess = result["figures"]["summary"]["1"]["rounds"]["per_request_vs_plain"]
    assert excess["rounds"]["requests"] == 32 and excess["after"]["requests"] == excess["other"]["requests"] == 0

    def rep(*records):
        return {"requests": [[e2e, 1.0, rounds] for e2e, rounds in records]}

    base = [rep(*[(10.0, None)] * 7)]
    mine = [rep((10.0, 0), (14.0, 3), (11.0, 0), (12.0, 0), (10.5, 0), (9.0, 0), (10.0, 0))]
    classes = bench.per_request_excess(mine, base)
    assert classes["rounds"] == {"requests": 1, "excess_ms": 4.0, "us_a_request": 4000.0}
    assert classes["after"]["requests"] == 3 and abs(classes["after"]["excess_ms"] - 3.5) < 1e-9
    assert classes["other"]["requests"] == 3 and abs(classes["other"]["excess_ms"] - (-1.0)) < 1e-9
    assert bench.per_request_excess(base, base) is None  # no rounds counted: not an adaptive engine
