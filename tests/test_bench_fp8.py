"""python -m spruce.bench.fp8 on the CPU with the bundled demo model: every run reports a decode step, the bytes
it reads (FP8 weights and an FP8 cache read fewer) and the speed-ups; nothing is timed against a roofline
without a GPU."""

from __future__ import annotations

import json

from spruce.bench.fp8 import main
from spruce.config import builtin_model_path


def test_fp8_bench_reports_every_run(tmp_path):
    assert main(["--model", str(builtin_model_path()), "--device", "cpu", "--backend", "torch", "--context", "8",
                 "--output-len", "3", "--kv-context", "24", "--dtype", "float32", "--kv-backend", "torch", "--out-dir", str(tmp_path)]) == 0
    (result,) = tmp_path.glob("fp8-*.json")
    figures = json.loads(result.read_text())["figures"]
    weights, kv = figures["weights"]["bs1"], figures["kv_cache"]["bs1"]
    for run in (*weights.values(), *kv.values()):
        assert run["decode_step_ms"] > 0 and "roofline_fraction" not in run
    assert weights["fp8_per_channel"]["decode_read_bytes"] < 0.5 * weights["unquantized"]["decode_read_bytes"]
    assert weights["fp8_block"]["weight_bytes"] < 0.5 * weights["unquantized"]["weight_bytes"]
    assert kv["fp8_kv"]["decode_read_bytes"] < kv["model_dtype_kv"]["decode_read_bytes"]
    assert kv["fp8_kv"]["kv_cache_dtype"] == "fp8_e4m3"
    assert "speedup_vs_model_dtype_kv" in kv["fp8_kv"]
