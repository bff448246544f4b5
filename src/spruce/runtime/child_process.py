"""How spruce starts its child processes: the tensor-parallel ranks (runtime/launch.py) and the server's engine
process (server/engine_process.py).

Start method "forkserver": the first child starts one server process that imports `PRELOAD` and nothing else;
each child is forked from it with torch imported (a "spawn" child imports torch anew: seconds of CPU each) and no
CUDA state, as with spawn: importing torch initialises no CUDA driver, while spruce's kernel modules may query the
device when imported, so they are not preloaded. The child's target and arguments are pickled as with spawn.

A forked child inherits the fork server's environment, not its parent's at the time it starts: `process` passes
the parent's environment along and the child applies it before its target runs (e.g. NCCL_NVLS_ENABLE, which the
tp driver sets before it starts its ranks). What torch reads from the environment when it is imported
(OMP_NUM_THREADS) is read once, in the fork server, from the parent's environment when its first child starts.

A child's parent (os.getppid) is the fork server, which exits when the process that started it does: a child that
watches for its parent's death (runtime/launch.py `_watch_parent`) watches for the fork server's. Its command
line is the fork server's; its name (`ps -o comm`, /proc/PID/comm) is the Process name it was given, cut to 15
characters ("spruce-engine", "spruce-tp-rank1").
"""

from __future__ import annotations

import multiprocessing
import os

PRELOAD = ("torch",)


def context():
    """The multiprocessing context every spruce child process starts from (module doc)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def process(ctx, target, name: str, args: tuple = (), daemon: bool | None = None):
    """ctx.Process named `name` running target(*args) in the parent's environment as it is now."""
    return ctx.Process(target=_in_environment, args=(dict(os.environ), name, target, args), name=name, daemon=daemon)


def _in_environment(environ: dict, name: str, target, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environ)
    try:
        with open("/proc/self/comm", "w") as comm:  # Linux: the name ps and top show
            comm.write(name[:15])
    except OSError:
        pass
    target(*args)
