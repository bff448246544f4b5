"""Where a loaded server's threads spend their time (issue 16: an adaptive server running only rounds was 7-15% slower
than a fixed one at concurrency 32-64 on the H100, where the host takes ~90% of a step).

For each NAME=FLAGS configuration in turn: `spruce serve --disable-engine-process FLAGS` (the engine as a thread,
so that one yappi sees the engine and the event loop) runs under yappi (--clock, every thread), one
level of `spruce bench serving` drives it, and the server is stopped; per thread (the event loop's, the engine's)
its wall seconds and its top functions by own time (tsub) and by total time (ttot) go to OUT_JSON with the level's
throughput. yappi slows Python code down, so compare configurations with each other, not with unprofiled runs.

Usage (repo root): python bench/profile_serving.py OUT_JSON --model DIR --launch NAME=FLAGS [--launch ...]
    [--concurrency 64] [--num-requests 512] [--prompts FILE] [--top 40] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from spruce.bench.common import device_name, git_commit
from spruce.bench.serving_launch import free_port

WRAPPER = """
import json, sys, atexit, threading, yappi
yappi.set_clock_type(sys.argv[3])
yappi.start(builtins=False, profile_threads=True)
def dump():
    yappi.stop()
    names = {t.id: t.name for t in yappi.get_thread_stats()}
    out = {}
    for t in yappi.get_thread_stats():
        stats = yappi.get_func_stats(ctx_id=t.id)
        rows = [(f.full_name, f.ncall, f.tsub, f.ttot) for f in stats]
        top = int(sys.argv[1])
        out[t.name + "-" + str(t.id)] = {
            "wall_s": t.ttot,
            "by_own_time": [dict(zip(("function", "calls", "own_s", "total_s"), r))
                            for r in sorted(rows, key=lambda r: -r[2])[:top]],
            "by_total_time": [dict(zip(("function", "calls", "own_s", "total_s"), r))
                              for r in sorted(rows, key=lambda r: -r[3])[:top]]}
    json.dump(out, open(sys.argv[2], "w"))
atexit.register(dump)
from spruce.cli import main
sys.exit(main(sys.argv[4:]))
"""


def profile_one(name: str, flags: list[str], args, workdir: Path) -> dict:
    port = free_port()
    stats_path = workdir / f"{name}-threads.json"
    cmd = [sys.executable, "-c", WRAPPER, str(args.top), str(stats_path), args.clock, "serve", "--host", "127.0.0.1",
           "--port", str(port), "--model", args.model, "--disable-engine-process", *flags]
    log = (workdir / f"{name}.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.launch_timeout
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"{name}: `{shlex.join(cmd[6:])}` did not start; see {log.name}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    bench_dir = workdir / name
    subprocess.run([sys.executable, "-m", "spruce.cli", "bench", "serving", "--base-url", base_url,
                    "--concurrency", str(args.concurrency), "--num-requests", str(args.num_requests),
                    "--max-tokens", "128", "--prompt-tokens", str(args.prompt_tokens), "--tokenizer", args.model,
                    "--prompts", args.prompts or str(Path(args.model) / "heldout_prompts.jsonl"),
                    "--out-dir", str(bench_dir)], check=True)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    level = json.loads(next(bench_dir.glob("serving-*.json")).read_text())["figures"]["levels"][0]
    return {"flags": flags, "output_tok_s": level["output_throughput_tok_s"],
            "mean_accept_length": level["mean_accept_length"], "adaptive_steps": level["adaptive_steps"],
            "threads": json.loads(stats_path.read_text())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", required=True)
    ap.add_argument("--launch", action="append", required=True, metavar="NAME=FLAGS")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--prompts", default=None)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="wall: where each thread's time goes, waits (GIL, device) included; cpu: its own work")
    ap.add_argument("--launch-timeout", type=float, default=600.0)
    args = ap.parse_args()
    runs = {}
    workdir = Path(tempfile.mkdtemp(prefix="profile-serving-"))  # kept: the server logs are there
    for text in args.launch:
        name, _, flags = text.partition("=")
        runs[name] = profile_one(name, shlex.split(flags), args, workdir)
        busy = {k: round(v["wall_s"], 2) for k, v in runs[name]["threads"].items() if v["wall_s"] > 1}
        print(f"{name}: {runs[name]['output_tok_s']:.0f} tok/s, threads ({args.clock} s): {busy}")
    result = {"benchmark": "profile-serving", "device": device_name("cuda"), "git_commit": git_commit(),
              "config": {k: v for k, v in vars(args).items()}, "runs": runs}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
