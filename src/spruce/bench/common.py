"""What every benchmark records: device, commit, config, figures; and the memory-bandwidth ceiling."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import torch

from spruce.runtime.device import device_name  # noqa: F401  (results name their device)

RESULTS_DIR = Path("bench/results")


def git_commit() -> str:
    """HEAD (+ "-dirty"), or $SPRUCE_GIT_COMMIT when set: a copy of the tree elsewhere (a GPU machine) may carry
    no .git or a stale one, so whoever sends the tree names its commit."""
    if os.environ.get("SPRUCE_GIT_COMMIT"):
        return os.environ["SPRUCE_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_result(kind: str, device: str, config: dict, figures: dict, out_dir: Path | None = None) -> Path:
    """Write bench/results/<kind>-<device>-<time>.json and return its path."""
    out_dir = Path(out_dir or RESULTS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = device_name(device)
    slug = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = out_dir / f"{kind}-{slug}-{stamp}.json"
    payload = {"benchmark": kind, "device": name, "git_commit": git_commit(), "torch": torch.__version__,
               "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "config": config, "figures": figures}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def measure_copy_bandwidth(device: str, nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written (GPU only)."""
    dev = torch.device(device)
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=dev).normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize(dev)
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    del src, dst
    return 2 * nbytes / times[len(times) // 2]
