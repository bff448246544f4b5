"""`auto` on a GPU without a kernel table of its own: the table of another GPU of its SM architecture (an H200 runs
by the H100's ranking), an exact table first, none across architectures."""

from __future__ import annotations

import json

import pytest

from spruce.attention import kernel_table
from spruce.attention.kernel_table import architecture, find_table, select

H100 = "NVIDIA H100 80GB HBM3"
PHASES = ("decode", "extend", "verify", "draft_decode", "draft_extend")


def write(path, device, triton_ms):
    path.write_text(json.dumps({"device": device, "rows": [{"phase": "decode", "bs": 1, "context": 8,
                                                            "triton_ms": triton_ms}]}))


@pytest.mark.parametrize("name, arch", [
    ("NVIDIA H200", "Hopper (sm90)"), ("NVIDIA H200 NVL", "Hopper (sm90)"), (H100, "Hopper (sm90)"),
    ("NVIDIA GH200 480GB", "Hopper (sm90)"), ("NVIDIA H20", "Hopper (sm90)"),
    ("NVIDIA A100-SXM4-80GB", "Ampere GA100 (sm80)"), ("NVIDIA A10", None), ("NVIDIA L40S", None),
    ("NVIDIA GeForce RTX 4090", None), ("NVIDIA B200", "Blackwell (sm100)"), ("NVIDIA H1000X", None),
])
def test_architecture_by_name(name, arch):
    assert architecture(name) == arch


def test_an_h200_takes_the_packaged_h100_table_and_its_choice():
    table = find_table("NVIDIA H200")
    assert table is not None and table.device == H100
    got = select(table, PHASES, {"triton": None, "flashinfer": None}, "triton")
    assert {c.backend for c in got.values()} == {"flashinfer"} and not any(c.fell_back for c in got.values())
    assert find_table("NVIDIA L40S") is None and find_table("NVIDIA A100-SXM4-80GB") is None


def test_an_exact_table_comes_first_and_architectures_do_not_mix(tmp_path):
    write(tmp_path / "a.json", H100, 1.0)
    assert find_table("NVIDIA H200", tmp_path).device == H100
    write(tmp_path / "b.json", "NVIDIA H200", 2.0)
    assert find_table("NVIDIA H200", tmp_path).device == "NVIDIA H200"
    assert find_table(H100, tmp_path).device == H100
    assert find_table("NVIDIA A100-SXM4-80GB", tmp_path) is None
    assert kernel_table.known_devices(tmp_path) == (H100, "NVIDIA H200")
