"""bench/sample_servers.py's summary of py-spy recordings: start-up samples (building the engine, capturing its
graphs, importing) are counted apart from serving time, whether py-spy names a method with its class (0.4.3) or
without it."""

from __future__ import annotations

import bench_scripts


def test_start_up_samples_are_not_serving_time(tmp_path):
    main = ('process 1:"python";_main (multiprocessing/spawn.py:131);'
            "engine_process_main (spruce/server/engine_process.py:80)")
    recording = tmp_path / "adaptive-engine-1.txt"
    recording.write_text("\n".join([
        f"{main};__init__ (spruce/llm.py:27);capture_graphs (spruce/speculative/adaptive.py:300) 7",
        f"{main};__init__ (spruce/server/engine_process.py:127) 1",
        f"{main};LLM.__init__ (spruce/llm.py:27);"
        "AdaptiveDecoding.capture_graphs (spruce/speculative/adaptive.py:300) 3",
        f"{main};_EngineServer.run (spruce/server/engine_process.py:150);Engine.step (spruce/runtime/engine.py:200) 2",
        f"{main};_find_and_load (<frozen importlib._bootstrap>:1360) 2",
        f"{main} 4",  # the process's entry itself, outside the loop
        f"{main};run (spruce/server/engine_process.py:150);step (spruce/runtime/engine.py:200) 5",
    ]) + "\n")
    got = bench_scripts.load("sample_servers").summarize_file(recording, rate=100, top=10)
    assert got["startup_samples"] == 17 and got["samples"] == 7 and got["busy_seconds"] == 0.07
    totals = {row["function"]: row["samples"] for row in got["by_total"]}
    assert totals["step (spruce/runtime/engine.py)"] == 5 and totals["Engine.step (spruce/runtime/engine.py)"] == 2
    assert not any("capture_graphs" in f for f in totals)
