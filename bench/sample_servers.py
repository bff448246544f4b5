"""Where served engines spend their host time, sampled from outside with py-spy (issue 16: an adaptive server that
runs the same choice as a dedicated one was 10-25% slower per token on the H100, while offline their steps cost
the same).

`watch OUT_DIR [--rate HZ]`: until stopped (SIGTERM / SIGINT) or `--seconds` pass, find every `spruce serve`
process and its engine process (the multiprocessing child) and record each with `py-spy record --nonblocking` (raw
collapsed stacks, idle threads left out) into OUT_DIR/<name>-<role>-<pid>.txt, where name is plain, fixed or
adaptive (from the server's speculation flags) and role is server or engine. Run it beside `spruce bench serving
--launch ...`: each recording ends when its process exits.

`summarize OUT_DIR OUT_JSON [--top 40]`: per recording, its busy samples and seconds (samples / rate), and the
functions with the most samples by own time (the stack's last frame) and by total time (anywhere on the stack,
once per sample), line numbers dropped.

py-spy must be on PATH (pip install py-spy; on the device, carried as a wheel). Compare servers with each other in
one run: sampling costs every process alike.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import signal
import subprocess
import time
from pathlib import Path

SERVE = re.compile(r"spruce(\.cli)? serve")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _children(pid: int) -> list[int]:
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    except OSError:
        return []
    return [int(p) for p in out.split()]


def _server_name(cmdline: str) -> str:
    if "--speculative-adaptive" in cmdline:
        return "adaptive"
    return "fixed" if "--speculative-algorithm" in cmdline else "plain"


def watch(out_dir: Path, rate: int, seconds: float) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    recorders: dict[int, subprocess.Popen] = {}
    stop = False

    def on_signal(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    end = time.monotonic() + seconds
    while not stop and time.monotonic() < end:
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) in recorders:
                continue
            pid, cmdline = int(proc.name), _cmdline(int(proc.name))
            if not SERVE.search(cmdline) or "py-spy" in cmdline:
                continue
            engines = [c for c in _children(pid) if "spawn_main" in _cmdline(c)]
            if not engines:  # the engine process is not up yet: look again next time
                continue
            name = _server_name(cmdline)
            for target, role in [(pid, "server")] + [(c, "engine") for c in engines]:
                path = out_dir / f"{name}-{role}-{target}.txt"
                recorders[target] = subprocess.Popen(
                    ["py-spy", "record", "--pid", str(target), "--rate", str(rate), "--nonblocking", "--threads",
                     "--format", "raw", "--output", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        time.sleep(0.5)
    for rec in recorders.values():  # a recording whose process still runs is ended and written now
        if rec.poll() is None:
            rec.send_signal(signal.SIGINT)
    for rec in recorders.values():
        try:
            rec.wait(timeout=30)
        except subprocess.TimeoutExpired:
            rec.kill()


FRAME = re.compile(r"^(.*) \((.*?)(:\d+)?\)$")


def _frame(raw: str) -> str:
    """`function (file:line)` without the line number."""
    m = FRAME.match(raw)
    return f"{m.group(1)} ({m.group(2)})" if m else raw


def _bare(frame: str) -> str:
    """`function (file)` with any class qualifier left out of the function: `LLM.__init__ (spruce/llm.py)` ->
    `__init__ (spruce/llm.py)`."""
    name, sep, rest = frame.partition(" (")
    return name.rpartition(".")[2] + sep + rest


STARTUP = ("__init__ (spruce/llm.py)", "__init__ (spruce/server/engine_process.py)", "_find_and_load",
           "freeze_startup")
# frames of start-up (building the engine, importing, waiting for it), by bare function name and file: samples under
# any of them are not serving time. py-spy names a method with its class or without it, by version ("LLM.__init__
# (spruce/llm.py)" from 0.4.3, "__init__ (spruce/llm.py)" as session 17 read its recordings), so a frame is matched with
# its class left out (`_bare`). Matched by the class-qualified names until session 17 and by the bare ones alone
# since, each missed the other version's: on the H200 (2026-11-24, py-spy 0.4.3) 1081 of an adaptive engine's 5311
# "serving" samples at concurrency 1 were LLM.__init__ (graph capture, the warm-up, the draft's loading).
IDLE_ENTRY = "engine_process_main ("  # a sample whose deepest frame is this function itself is outside the loop


def summarize_file(path: Path, rate: int, top: int) -> dict:
    own: collections.Counter = collections.Counter()
    total: collections.Counter = collections.Counter()
    threads: collections.Counter = collections.Counter()
    samples = startup = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        thread = frames[0] if frames[0].startswith("thread") else ""
        frames = [_frame(f) for f in frames if not f.startswith(("thread", "process"))]
        if any(_bare(f).startswith(STARTUP) for f in frames) or (frames and frames[-1].startswith(IDLE_ENTRY)):
            startup += n
            continue
        samples += n
        threads[thread] += n
        if frames:
            own[frames[-1]] += n
            for f in set(frames):
                total[f] += n
    return {"samples": samples, "busy_seconds": samples / rate, "startup_samples": startup,
            "threads": {t: {"samples": n, "seconds": n / rate} for t, n in threads.most_common()},
            "by_own": [{"function": f, "samples": n, "share": n / max(samples, 1)} for f, n in own.most_common(top)],
            "by_total": [{"function": f, "samples": n, "share": n / max(samples, 1)}
                         for f, n in total.most_common(top)]}


def summarize(out_dir: Path, out_json: Path, rate: int, top: int) -> None:
    result = {p.stem: summarize_file(p, rate, top) for p in sorted(out_dir.glob("*.txt"))}
    out_json.write_text(json.dumps({"rate": rate, "recordings": result}, indent=1))
    for name, r in result.items():
        print(f"== {name}: {r['samples']} samples ({r['busy_seconds']:.1f} s busy serving)")
        for key in ("by_total", "by_own"):
            print(f"  {key}:")
            for row in r[key][:top]:
                print(f"   {100 * row['share']:5.1f}%  {row['function']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("watch")
    w.add_argument("out_dir", type=Path)
    w.add_argument("--rate", type=int, default=500)
    w.add_argument("--seconds", type=float, default=3600.0)
    s = sub.add_parser("summarize")
    s.add_argument("out_dir", type=Path)
    s.add_argument("out_json", type=Path)
    s.add_argument("--rate", type=int, default=500)
    s.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    if args.command == "watch":
        watch(args.out_dir, args.rate, args.seconds)
    else:
        summarize(args.out_dir, args.out_json, args.rate, args.top)


if __name__ == "__main__":
    main()
