"""The routed experts of one MoE layer at a named shape, per block configuration: which tiles serve decode best.

    spruce bench moe --shape qwen3-30b-a3b --tokens 1 4 16 64 --out moe-qwen3.json

For each token count T: random routing (k distinct experts per token, uniform), random bf16 weights in enough
layer copies to overflow the L2 cache (what a decode step sees), and `ops/moe._fused_moe_triton` timed in a CUDA
graph (`graph_time_ms`, the FP8 table's timer) for every candidate `_Config` (block sizes, warps, stages) and for
the one `_config` picks today. Per T: microseconds a layer, the experts' bytes read (the distinct experts the
routing touches: gate/up and down), that over the copy bandwidth measured in the same run (the roofline), and the
fastest candidate; and the time of each way to sort the T*k assignments by expert (`ops/moe.ALIGNS`: one program,
the chunked launches where they fit, torch ops) beside the one `align_path` picks. `--smoke`: the CPU (Triton's
interpreter), a tiny shape, a few candidates (checks it runs).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

DECODE_TILES = list(itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (3, 4)))  # block_n, block_k, warps, stages
L2_FLUSH_BYTES = 256 << 20


def moe_dims(shape: str) -> dict:
    """E, k, hidden and per-expert intermediate of a named shape, as spruce's config parser reads them."""
    import tempfile

    from spruce.bench.shapes import write_shape_dirs
    from spruce.models.hf_config import ModelConfig

    with tempfile.TemporaryDirectory() as tmp:
        cfg = ModelConfig.from_dir(write_shape_dirs(shape, Path(tmp))[0])
    if cfg.moe is None:
        raise SystemExit(f"--shape {shape} has no routed experts")
    return {"experts": cfg.moe.num_experts, "top_k": cfg.moe.top_k, "hidden": cfg.hidden_size,
            "inter": cfg.moe.intermediate_size}


def routing(t: int, e: int, k: int, device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] (distinct experts per token) and softmax-like weights [T, k] float32."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(device)
    weights = torch.rand(t, k, generator=g).softmax(-1).to(device)
    return ids, weights


def run(args) -> dict:
    from spruce.ops.fp8_select import graph_time_ms
    from spruce.ops.moe import (ALIGNS, _Config, _config, _fused_moe_triton, align_chunked_fits,
                                align_path)  # after --smoke set TRITON_INTERPRET

    d = moe_dims(args.shape) if not args.smoke else {"experts": 8, "top_k": 2, "hidden": 64, "inter": 32}
    e, k, h, inter = d["experts"], d["top_k"], d["hidden"], d["inter"]
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    expert_bytes = 3 * h * inter * torch.empty((), dtype=dtype).element_size()  # gate, up and down of one expert
    copies = max(1, min(8, -(-L2_FLUSH_BYTES // (k * expert_bytes)))) if cuda else 1  # T = 1 reads k experts
    g = torch.Generator(device=args.device).manual_seed(0)
    w13 = [torch.randn(e, 2 * inter, h, generator=g, device=args.device, dtype=dtype) * h ** -0.5
           for _ in range(copies)]
    w2 = [torch.randn(e, h, inter, generator=g, device=args.device, dtype=dtype) * inter ** -0.5
          for _ in range(copies)]
    bandwidth = None
    if cuda:
        from spruce.bench.common import measure_copy_bandwidth

        bandwidth = measure_copy_bandwidth(args.device)
    candidates = [_Config(16, *tile) for tile in (DECODE_TILES if not args.smoke else DECODE_TILES[:2])]
    figures = {"dims": d, "copies": copies, "copy_bandwidth_bytes_per_s": bandwidth, "tokens": {}}
    for t in args.tokens:
        ids, weights = routing(t, e, k, args.device)
        x = torch.randn(t, h, generator=g, device=args.device, dtype=dtype)
        touched = ids.unique().numel()
        read = touched * expert_bytes
        current = _config(ids.numel(), e)
        times = {}
        for cfg in dict.fromkeys([current, *(candidates if current.block_m == 16 else [])]):
            try:
                ms = graph_time_ms(lambda i, c=cfg: _fused_moe_triton(x, w13[i], w2[i], ids, weights, c), copies,
                                   cuda)
            except Exception as exc:  # a tile that does not fit this device's shared memory
                times[",".join(map(str, cfg))] = f"failed: {type(exc).__name__}"
                continue
            times[",".join(map(str, cfg))] = ms * 1e3
        timed = {c: us for c, us in times.items() if isinstance(us, float)}
        best = min(timed, key=timed.get)
        now = ",".join(map(str, current))
        align_us = {name: graph_time_ms(lambda i, f=fn: f(ids, e, current.block_m), 1, cuda) * 1e3
                    for name, fn in ALIGNS.items() if name != "chunked" or align_chunked_fits(ids.numel(), e)}
        align_now = align_path(ids.numel(), e)
        figures["tokens"][str(t)] = {
            "experts_touched": touched, "bytes_read": read,
            "roofline_us": read / bandwidth * 1e6 if bandwidth else None,
            "current": now, "current_us": times.get(now), "best": best, "best_us": timed[best], "us": times,
            "align_current": align_now, "align_us": align_us}
        print(f"T={t}: {touched} experts, {read / 1e6:.1f} MB; current {now} {times.get(now)} us; best {best} "
              f"{timed[best]:.1f} us" + (f"; roofline {read / bandwidth * 1e6:.1f} us" if bandwidth else "")
              + f"; align ({align_now}) " + ", ".join(f"{n} {us:.1f}" for n, us in align_us.items())
              + " us", flush=True)
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m spruce.bench.moe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_main(p.parse_args(argv))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default="qwen3-30b-a3b", help="a named MoE shape (bench/shapes.py)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64], help="tokens routed at once (T)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", action="store_true", help="CPU, a tiny shape, two candidates (checks it runs)")
    p.add_argument("--out", type=Path, default=None, help="the JSON to write")


def run_main(args: argparse.Namespace) -> int:
    import os

    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.device, args.tokens = "cpu", [1, 3]
    figures = run(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"benchmark": "moe", "config": {k: str(v) for k, v in vars(args).items()},
                                        "figures": figures}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
