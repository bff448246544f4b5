"""`spruce bench serving-compare`: several serving results (spec vs plain, overlap on/off) on the same axes."""

from __future__ import annotations

import json

import pytest

from spruce.cli import main


def result(tmp_path, name: str, speculative: str, overlap: str, scale: float):
    levels = [{"concurrency": c, "output_throughput_tok_s": scale * c ** 0.5,
               "ttft_s": {"p50": 0.01 * c, "p90": 0.015 * c, "p99": 0.02 * c},
               "itl_s": {"p50": 0.001 * c, "p90": 0.002 * c, "p99": 0.003 * c},
               "e2e_s": {"p50": 0.1 * c, "p90": 0.15 * c, "p99": 0.2 * c}} for c in (1, 8, 32)]
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"config": {"server": {"speculative": speculative, "overlap_schedule": overlap}},
                                "figures": {"levels": levels}}))
    return str(path)


def test_spec_and_plain_on_the_same_axes(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    files = [result(tmp_path, "spec", "EAGLE3 S=6 K=8 N=32", "on", 3000.0),
             result(tmp_path, "plain", "off", "on", 2000.0)]
    out = tmp_path / "cmp.png"
    assert main(["bench", "serving-compare", *files, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "EAGLE3 S=6 K=8 N=32, overlap on: c1: 3000 tok/s" in printed and "plain, overlap on: c1: 2000" in printed
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_label_per_result(tmp_path, capsys):
    files = [result(tmp_path, "a", "off", "on", 1.0), result(tmp_path, "b", "off", "off", 1.0)]
    assert main(["bench", "serving-compare", *files, "--labels", "only-one", "--out", str(tmp_path / "x.png")]) == 2
    assert "1 labels for 2 results" in capsys.readouterr().err
