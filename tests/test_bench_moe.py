"""`spruce bench moe --smoke` (also `python -m spruce.bench.moe`): the MoE tile benchmark runs on the CPU (Triton's interpreter) and writes
per token count the experts touched, the bytes read, each candidate's time and the best."""

from __future__ import annotations

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")


def test_moe_bench_smoke_writes_every_candidate(tmp_path):
    from spruce.cli import main

    assert main(["bench", "moe", "--smoke", "--out", str(tmp_path / "moe.json")]) == 0
    figures = json.loads((tmp_path / "moe.json").read_text())["figures"]
    assert set(figures["tokens"]) == {"1", "3"}
    for t, row in figures["tokens"].items():
        assert 1 <= row["experts_touched"] <= min(8, 2 * int(t)) and row["bytes_read"] > 0
        assert row["best"] in row["us"] and row["current"] in row["us"] and len(row["us"]) >= 2
        assert all(isinstance(v, float) and v > 0 for v in row["us"].values())
        assert set(row["align_us"]) == {"one_program", "chunked", "torch"} and row["align_current"] == "one_program"
        assert all(v > 0 for v in row["align_us"].values())
