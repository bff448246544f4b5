"""`spruce bench latency` end to end on CPU with the bundled model and head (tiny sizes)."""

from __future__ import annotations

import json

from spruce.cli import main
from spruce.config import builtin_draft_path, builtin_model_path


def test_latency_bench_writes_result(tmp_path):
    model, draft = builtin_model_path(), builtin_draft_path()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["def fib(n):", "import os\n", "class A:"]))
    rc = main(["bench", "latency", "--model", str(model), "--draft", str(draft), "--device", "cpu",
               "--dtype", "float32", "--batch-sizes", "1", "2", "--input-len", "12", "--output-len", "6",
               "--num-prompts", "3", "--spec", "3,2,4", "--graphs", "off", "--overlap", "on", "off", "--repeats", "1", "--compare-hf",
               "--prompts", str(prompts), "--out-dir", str(tmp_path / "out")])
    assert rc == 0
    (path,) = (tmp_path / "out").glob("latency-*.json")
    res = json.loads(path.read_text())
    all_runs = res["figures"]["runs"]
    assert len(all_runs) == 8 and {r["overlap"] for r in all_runs} == {True, False}
    for r in all_runs:  # wall time against the summed phase time of the same run
        assert r["gpu_phase_ms"] > 0 and r["wall_over_gpu_phases"] == r["total_s"] * 1e3 / r["gpu_phase_ms"]
    on = [r for r in all_runs if r["overlap"]]
    off = {(r["batch_size"], tuple(r["spec_config"] or ())): r for r in all_runs if not r["overlap"]}
    runs = {(r["batch_size"], tuple(r["spec_config"] or ())): r for r in on}
    assert set(runs) == {(1, ()), (1, (3, 2, 4)), (2, ()), (2, (3, 2, 4))} == set(off)
    assert runs[(2, (3, 2, 4))]["spec"] == off[(2, (3, 2, 4))]["spec"]  # the same rounds with and without overlap
    assert runs[(1, ())]["num_prompts"] == 3 and runs[(2, ())]["num_prompts"] == 4  # whole batches
    for r in runs.values():
        assert r["output_tokens"] == 6 * r["num_prompts"] and r["tokens_per_s"] > 0
    assert runs[(1, (3, 2, 4))]["spec"]["mean_accept_length"] >= 1.0
    assert res["figures"]["hf"]["1"]["plain"]["output_tokens"] == 18
    assert "assisted_prompt_lookup" in res["figures"]["hf"]["1"]


def test_latency_bench_tp_sizes(tmp_path):
    """--tp-size 1 2 on the cpu (gloo): one run per size, the tp=2 run compared with the tp=1 one."""
    rc = main(["bench", "latency", "--model", str(builtin_model_path()), "--device", "cpu", "--dtype", "float32",
               "--batch-sizes", "2", "--input-len", "8", "--output-len", "4", "--num-prompts", "2", "--spec",
               "--graphs", "off", "--repeats", "1", "--tp-size", "1", "2", "--out-dir", str(tmp_path / "out")])
    assert rc == 0
    (path,) = (tmp_path / "out").glob("latency-*.json")
    runs = {r["tp_size"]: r for r in json.loads(path.read_text())["figures"]["runs"]}
    assert set(runs) == {1, 2}
    assert runs[2]["output_tokens"] == runs[1]["output_tokens"] == 8
    assert runs[2]["tp_speedup_tokens_per_s"] == runs[2]["decode_tokens_per_s"] / runs[1]["decode_tokens_per_s"]
    assert runs[2]["weight_bytes"] < runs[1]["weight_bytes"]  # one rank's slices


def test_latency_bench_lists_the_kernels_of_decode_steps(tmp_path):
    """--profile-steps N: per run, the ops (CPU) of N decode steps by name, the prefill's subtracted; a decode step
    runs the model's linears once per layer and token batch (8 layers of the bundled model: q/k/v fused, o,
    gate/up fused, down, plus the head)."""
    model = builtin_model_path()
    rc = main(["bench", "latency", "--model", str(model), "--device", "cpu", "--dtype", "float32", "--batch-sizes",
               "1", "--input-len", "8", "--output-len", "4", "--num-prompts", "1", "--graphs", "off",
               "--repeats", "1", "--profile-steps", "3", "--out-dir", str(tmp_path / "out")])
    assert rc == 0
    (path,) = (tmp_path / "out").glob("latency-*.json")
    (run,) = json.loads(path.read_text())["figures"]["runs"]
    census = run["kernels"]
    assert census["steps"] == 3 and census["launches_per_step"] > 0 and census["us_per_step"] > 0
    linears = {r["name"]: r["launches_per_step"] for r in census["kernels"]}.get("aten::linear")
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    assert linears is not None and linears >= 4 * layers, census["kernels"][:5]


def test_latency_bench_runs_ngram_without_a_draft(tmp_path):
    """--speculative-algorithm NGRAM: prompt lookup, no draft loaded; on prompts that repeat themselves the
    lookups find continuations (accept length above 1 counts drafts that were right)."""
    prompts = tmp_path / "prompts.jsonl"
    text = "def add(a, b):\n    return a + b\n\n" * 4
    prompts.write_text(json.dumps({"text": text}) + "\n")
    rc = main(["bench", "latency", "--model", str(builtin_model_path()), "--device", "cpu", "--dtype", "float32",
               "--batch-sizes", "1", "--input-len", "48", "--output-len", "12", "--num-prompts", "1", "--spec",
               "4,1,5", "--speculative-algorithm", "NGRAM", "--prompt-lookup-min", "2", "--prompt-lookup-max", "3",
               "--no-plain", "--graphs", "off", "--repeats", "1", "--prompts", str(prompts),
               "--out-dir", str(tmp_path / "out")])
    assert rc == 0
    (path,) = (tmp_path / "out").glob("latency-*.json")
    (run,) = json.loads(path.read_text())["figures"]["runs"]
    assert run["spec_config"] == [4, 1, 5] and run["output_tokens"] == 12
    assert run["spec"]["mean_accept_length"] >= 1.0


def test_latency_bench_refuses_lookup_flags_it_would_not_use(tmp_path, capsys):
    """--prompt-lookup-min / -max without NGRAM speculation, and NGRAM with a --draft, are refused by name rather
    than run without them."""
    import pytest

    base = ["bench", "latency", "--model", str(builtin_model_path()), "--device", "cpu", "--dtype", "float32",
            "--batch-sizes", "1", "--input-len", "8", "--output-len", "2", "--num-prompts", "1", "--graphs", "off",
            "--repeats", "1", "--no-plain", "--out-dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit, match="--prompt-lookup-min 2: needs --speculative-algorithm NGRAM"):
        main([*base, "--draft", str(builtin_draft_path()), "--spec", "3,1,4", "--prompt-lookup-min", "2"])
    with pytest.raises(SystemExit, match="--prompt-lookup-max 3: needs"):
        main([*base, "--speculative-algorithm", "NGRAM", "--spec", "--prompt-lookup-max", "3"])  # no spec run
    rc = main([*base, "--speculative-algorithm", "NGRAM", "--spec", "3,1,4", "--draft", str(builtin_draft_path())])
    assert rc == 2 and "NGRAM' drafts from the request's own tokens and loads no draft" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_latency_bench_quantizes_weights_and_the_kv_cache_to_fp8(tmp_path):
    """--quantization fp8 --kv-cache-dtype fp8_e4m3 reach the engine: the run's weights and a decode step's read
    bytes (its roofline) shrink against the same run without them (CPU: FP8 emulated)."""
    model = builtin_model_path()
    runs = {}
    for name, extra in (("bf16", []), ("fp8", ["--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3"])):
        out = tmp_path / name
        rc = main(["bench", "latency", "--model", str(model), "--device", "cpu", "--dtype", "float32",
                   "--batch-sizes", "1", "--input-len", "8", "--output-len", "4", "--num-prompts", "1", "--graphs",
                   "off", "--repeats", "1", "--spec", "--out-dir", str(out), *extra])
        assert rc == 0
        (path,) = out.glob("latency-*.json")
        res = json.loads(path.read_text())
        (runs[name],) = res["figures"]["runs"]
        assert res["config"]["quantization"] == (None if name == "bf16" else "fp8")
    assert runs["fp8"]["weight_bytes"] < 0.6 * runs["bf16"]["weight_bytes"]
    assert runs["fp8"]["decode_read_bytes"] < 0.6 * runs["bf16"]["decode_read_bytes"]
