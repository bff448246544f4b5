"""bench/served_pyspy.py on a hand-made py-spy raw file: stacks go to the server whose `serve` command line they pass
through (the client's are left out), samples inside the root split by call path and leaf line, in ms a call."""

from __future__ import annotations

import json

import bench_scripts
import pytest

SERVE = ('process 10:"python3 -m spruce.cli serve --port 1 {flags}";'
         'process 11:"python3 -c from multiprocessing.spawn import spawn_main; spawn_main(pipe_handle=21)"')
RAW = "\n".join([
    f"{SERVE.format(flags='')};run (engine.py:10);Engine._launch_prefill (engine.py:20);prefill (strategy.py:5) 40",
    f"{SERVE.format(flags='')};run (engine.py:10);_launch_decode (engine.py:30) 100",
    f"{SERVE.format(flags='--speculative-adaptive')};run (engine.py:10);Engine._launch_prefill (engine.py:20);"
    "prefill (adaptive.py:7);_lazy_chunks (adaptive.py:9) 30",
    f"{SERVE.format(flags='--speculative-adaptive')};run (engine.py:10);Engine._launch_prefill (engine.py:20);"
    "prefill (adaptive.py:8) 50",
    f"{SERVE.format(flags='--speculative-adaptive')};run (engine.py:10);Engine._launch_prefill (engine.py:21) 20",
    'process 3:"python3 -m spruce.cli bench serving";send (client.py:1) 500',
])


def test_samples_split_per_server_and_call_path(tmp_path, capsys):
    tool = bench_scripts.load("served_pyspy")
    raw = tmp_path / "pyspy.raw"
    raw.write_text(RAW + "\n")
    out = tmp_path / "out.json"
    assert tool.main([str(raw), "--rate", "100", "--calls", "plain=4", "adaptive=10", "--depth", "2",
                      "--out", str(out)]) == 0
    servers = json.loads(out.read_text())["servers"]
    assert set(servers) == {"plain", "adaptive"}  # the client's stacks belong to no server
    plain, adaptive = servers["plain"], servers["adaptive"]
    assert (plain["samples"], plain["in_root"]) == (140, 40)
    assert (adaptive["samples"], adaptive["in_root"]) == (100, 100)
    # 100 samples at 100 a second over 10 calls: 100 ms a call; each path inclusive, by function not line
    assert adaptive["root_ms_a_call"] == 100.0
    assert adaptive["paths"]["prefill (adaptive.py)"] == 80.0
    assert adaptive["paths"]["prefill (adaptive.py) > _lazy_chunks (adaptive.py)"] == 30.0
    assert adaptive["paths"]["prefill (adaptive.py) > (own)"] == 50.0
    assert adaptive["paths"]["(own)"] == 20.0
    assert plain["root_ms_a_call"] == 100.0 and plain["paths"]["prefill (strategy.py)"] == 100.0
    assert adaptive["leaves"]["prefill (adaptive.py:8)"] == 50.0
    # the engine process's command line holds a ';': one frame, not a process frame and a code frame
    frames = tool.FRAME.findall(SERVE.format(flags="") + ";run (engine.py:10)")
    assert len(frames) == 3 and all(tool.PROCESS.match(f) for f in frames[:2])
    assert "== adaptive: 100 samples, 100 in _launch_prefill" in capsys.readouterr().out


def test_calls_must_be_counts(tmp_path):
    tool = bench_scripts.load("served_pyspy")
    raw = tmp_path / "pyspy.raw"
    raw.write_text(RAW)
    with pytest.raises(SystemExit, match="plain=many"):
        tool.main([str(raw), "--calls", "plain=many"])
