"""Where served engines spend one function's time, from a py-spy recording of a `spruce bench serving` run (issue 16).

On the H100 x4 (2026-11-26) the adaptive server's mean prefill launch was 13-32% longer than the plain servers'
while in one process the adaptive prefill cost only ~0.2 ms more at concurrency 1 and ~27 us a chunk at 32: this
program says, per served engine, where the samples inside `--root` (default the engine's `_launch_prefill`) go.
bench/device_served_profile.sh records the run with `py-spy record --subprocesses --nonblocking --format raw` (py-spy
reads the processes' memory without stopping them, so the servers run as unprofiled) and runs this on it.

Each stack of the raw file names its processes ('process PID:"CMDLINE"' frames); a stack belongs to the server whose
`spruce.cli serve` command line it passes through (named by `--name NAME=FLAG`: the first whose FLAG is in the
command line; a server matching none is "plain"), and the client's stacks are left out. Per server: its samples,
those inside the root, and inside the root the inclusive samples of each call path `--depth` frames deep (functions,
not lines) and the leaf lines with most own samples; with `--rate` and the servers' launches of the root (`--calls
NAME=N`) the figures are also milliseconds a call.

Usage: python bench/served_pyspy.py RAW [--root _launch_prefill] [--depth 3] [--rate 500] [--calls adaptive=N ...]
    [--name adaptive=--speculative-adaptive --name fixed=--speculative-algorithm] [--top 25] [--out JSON]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

PROCESS = re.compile(r'^process \d+:"(.*)"$')
FRAME = re.compile(r'process \d+:"[^"]*"|[^;]+')  # a stack's frames: ';' apart, but a quoted command line may hold
# one (a spawned engine process's: "-c from multiprocessing.spawn import spawn_main; spawn_main(...)")
LINE = re.compile(r"^(.*) \(([^():]+)(?::\d+)?\)$")  # "func (file.py:12)" -> func, file.py


def server_of(processes: list[str], names: list[tuple[str, str]]) -> str | None:
    """The server a stack's process command lines pass through (None: not a server's, e.g. the client)."""
    for cmdline in processes:
        if "spruce.cli serve" not in cmdline and " serve " not in cmdline:
            continue
        for name, flag in names:
            if flag in cmdline:
                return name
        return "plain"
    return None


def function(frame: str) -> str:
    """A frame without its line number: 'func (file.py)'."""
    match = LINE.match(frame)
    return f"{match.group(1)} ({match.group(2)})" if match else frame


def name_of(frame: str) -> str:
    """A frame's function name as py-spy writes it ('Engine._launch_prefill': qualified)."""
    return function(frame).split(" (")[0]


def analyse(lines, names: list[tuple[str, str]], root: str, depth: int) -> dict[str, dict]:
    """Per server: total samples, samples inside `root`, inclusive samples of each call path below it (up to
    `depth` functions) and own samples of each leaf line inside it."""
    out: dict[str, dict] = {}
    for raw in lines:
        raw = raw.rstrip("\n")
        if not raw:
            continue
        stack, _, count = raw.rpartition(" ")
        frames = FRAME.findall(stack)
        processes = [m.group(1) for m in map(PROCESS.match, frames) if m]
        server = server_of(processes, names)
        if server is None:
            continue
        entry = out.setdefault(server, {"samples": 0, "in_root": 0, "paths": collections.Counter(),
                                        "leaves": collections.Counter()})
        n = int(count)
        entry["samples"] += n
        code = [f for f in frames if not PROCESS.match(f)]
        at = next((i for i, f in enumerate(code) if name_of(f) == root or name_of(f).endswith("." + root)), None)
        if at is None:
            continue
        entry["in_root"] += n
        below = [function(f) for f in code[at + 1:]]
        for d in range(1, min(depth, len(below)) + 1):
            entry["paths"][" > ".join(below[:d])] += n
        if len(below) < depth:
            entry["paths"][" > ".join(below) + " > (own)" if below else "(own)"] += n
        entry["leaves"][code[-1]] += n
    return out


def report(result: dict[str, dict], rate: float | None, calls: dict[str, int], top: int) -> dict:
    """Printable per-server tables; ms a call where the rate and the calls are known."""
    summary = {}
    for server, entry in sorted(result.items()):
        per_call = 1e3 / rate / calls[server] if rate and calls.get(server) else None
        scale = (lambda n: round(n * per_call, 4)) if per_call else (lambda n: n)
        summary[server] = {
            "samples": entry["samples"], "in_root": entry["in_root"], "calls": calls.get(server),
            "root_ms_a_call": scale(entry["in_root"]) if per_call else None,
            "paths": {p: scale(n) for p, n in sorted(entry["paths"].items(), key=lambda kv: (kv[0].count(" > "),
                                                                                               -kv[1]))},
            "leaves": {leaf: scale(n) for leaf, n in entry["leaves"].most_common(top)},
        }
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("raw", help="py-spy record --format raw output")
    p.add_argument("--root", default="_launch_prefill", help="the function whose time is split")
    p.add_argument("--depth", type=int, default=3, help="call path depth below the root")
    p.add_argument("--rate", type=float, default=None, help="py-spy's samples a second")
    p.add_argument("--calls", nargs="*", default=[], metavar="NAME=N", help="the root's calls per server")
    p.add_argument("--name", action="append", default=None, metavar="NAME=FLAG",
                   help="a server is NAME if its command line holds FLAG (in order; default adaptive, fixed)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None, help="JSON to write the tables to")
    args = p.parse_args(argv)
    names = [tuple(n.split("=", 1)) for n in (args.name or ["adaptive=--speculative-adaptive",
                                                            "fixed=--speculative-algorithm"])]
    calls = {}
    for item in args.calls:
        name, _, n = item.partition("=")
        if not n.isdigit():
            raise SystemExit(f"--calls takes NAME=N with N a count, got {item!r}")
        calls[name] = int(n)
    with open(args.raw) as f:
        summary = report(analyse(f, names, args.root, args.depth), args.rate, calls, args.top)
    for server, table in summary.items():
        unit = "ms a call" if table["root_ms_a_call"] is not None else "samples"
        per_call = f" ({table['root_ms_a_call']} ms a call over {table['calls']} calls)" if table["calls"] else ""
        print(f"== {server}: {table['samples']} samples, {table['in_root']} in {args.root}{per_call}")
        print(f"  call paths ({unit}):")
        for path, v in table["paths"].items():
            print(f"    {v:>10}  {path}")
        print(f"  leaf lines ({unit}):")
        for leaf, v in table["leaves"].items():
            print(f"    {v:>10}  {leaf}")
    if args.out:
        Path(args.out).write_text(json.dumps({"root": args.root, "rate": args.rate, "servers": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
