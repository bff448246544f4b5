"""python -m spruce.bench.fp8 --smoke on the CPU with the bundled demo model: every run reports a decode step, the
bytes it reads (FP8 weights and an FP8 cache read fewer) and the speed-ups; nothing is timed against a roofline
without a GPU; the JSON goes where --out says."""

from __future__ import annotations

import json

from spruce.bench.fp8 import linear_shapes, main


def test_fp8_bench_reports_every_run(tmp_path):
    out = tmp_path / "fp8.json"
    assert main(["--smoke", "--sections", "weights", "kv_cache", "--kv-batch-sizes", "1", "--out", str(out)]) == 0
    figures = json.loads(out.read_text())["figures"]
    weights, kv = figures["weights"]["bs1"], figures["kv_cache"]["bs1"]
    for run in (weights["unquantized"], weights["fp8_per_channel"], weights["fp8_block"], kv["model_dtype_kv"],
                kv["fp8_kv"]):
        assert run["decode_step_ms"] > 0 and "roofline_fraction" not in run
    assert weights["fp8_per_channel"]["decode_read_bytes"] < 0.5 * weights["unquantized"]["decode_read_bytes"]
    assert weights["fp8_block"]["weight_bytes"] < 0.5 * weights["unquantized"]["weight_bytes"]
    assert kv["fp8_kv"]["decode_read_bytes"] < kv["model_dtype_kv"]["decode_read_bytes"]
    assert kv["fp8_kv"]["kv_cache_dtype"] == "fp8_e4m3"
    assert "speedup_vs_model_dtype_kv" in kv["fp8_kv"] and 0 < kv["kv_share_of_model_dtype_read_bytes"] < 1


def test_linear_shapes_of_the_8b_shape():
    from spruce.bench.shapes import TARGET_SHAPES

    assert linear_shapes(TARGET_SHAPES["llama-3.1-8b"]) == {
        "qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096), "down_proj": (4096, 14336)}
