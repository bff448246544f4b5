"""runtime/child_process.py: spruce's child processes (tp ranks, the engine process) fork from a server that has
torch imported, yet each runs in its parent's environment as it was when the child started, under its own name."""

from __future__ import annotations

import os

from spruce.runtime import child_process


def _report(queue, key: str) -> None:
    with open("/proc/self/comm") as comm:
        queue.put((os.environ.get(key), comm.read().strip(), "torch" in __import__("sys").modules))


def test_a_child_runs_in_its_parents_environment_of_now_under_its_name(monkeypatch):
    ctx = child_process.context()
    queue = ctx.Queue()
    monkeypatch.setenv("SPRUCE_CHILD_PROCESS_PROBE", "first")
    first = child_process.process(ctx, _report, "spruce-probe-1", args=(queue, "SPRUCE_CHILD_PROCESS_PROBE"))
    first.start()  # starts the fork server (if this process has none yet), with the environment of now
    assert queue.get(timeout=120) == ("first", "spruce-probe-1", True)
    first.join(30)
    # set after the fork server started: a child forked from it sees it only because its parent passes it along
    monkeypatch.setenv("SPRUCE_CHILD_PROCESS_PROBE", "second")
    second = child_process.process(ctx, _report, "spruce-probe-2-long-name", args=(queue, "SPRUCE_CHILD_PROCESS_PROBE"))
    second.start()
    assert queue.get(timeout=120) == ("second", "spruce-probe-2-", True)  # names cut to 15 characters
    second.join(30)
    assert first.exitcode == second.exitcode == 0
