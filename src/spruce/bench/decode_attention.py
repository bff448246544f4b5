"""Decode attention benchmark: the triton backend's grouped decode kernel (plus its split merge) on a 16-bit and an
FP8 KV cache, every launch configuration of GROUPED_CANDIDATES, at a named head shape, batch sizes and one context.

Per (cache dtype, batch size, configuration): ms of one layer's attention call (CUDA graph replays), the K/V bytes
it reads, GB/s, the fraction of the copy-bandwidth roofline, and the largest difference from the dtype's default
configuration's output. Per (cache dtype, batch size): the default configuration and the fastest one. CPU
(--smoke): tiny shapes under Triton's interpreter (checks that it runs; its times mean nothing).

    python -m spruce.bench.decode_attention --out /tmp/decode_attention.json
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from pathlib import Path

import torch

HEAD_SHAPES = {"llama-3.1-8b": (32, 8, 128)}  # query heads, kv heads, head dim


def make_decode_batch(bs: int, context: int, page_size: int, device: torch.device, seed: int = 0):
    """(ForwardBatch of one decode token per request over `context` cached keys, page table [bs, pages],
    pages in the pool). Requests' pages are a random permutation of the pool (no two requests share a page)."""
    from spruce.attention.metadata import ForwardBatch, Phase

    g = torch.Generator().manual_seed(seed)
    pages = -(-context // page_size)
    table = (torch.randperm(bs * pages, generator=g) + 1).to(torch.int32).view(bs, pages)  # page 0 unused
    batch = ForwardBatch(
        phase=Phase.DECODE, batch_size=bs, num_tokens=bs, input_ids=torch.zeros(bs, dtype=torch.int64, device=device),
        positions=torch.full((bs,), context - 1, dtype=torch.int64, device=device),
        out_slots=torch.zeros(bs, dtype=torch.int64, device=device),
        token_rows=torch.arange(bs, dtype=torch.int64, device=device),
        kv_lens=torch.full((bs,), context, dtype=torch.int32, device=device),
        tree_mask=torch.zeros(bs, 1, dtype=torch.int64, device=device),
        req_rows=torch.arange(bs, dtype=torch.int64, device=device),
        qo_indptr=torch.arange(bs + 1, dtype=torch.int32, device=device), max_kv_len=context, scratch_width=0,
        max_q_len=1)
    return batch, table.to(device), 1 + bs * pages


def measure(args, cache_dtype: torch.dtype, bs: int, bandwidth: float | None) -> dict:
    """Every candidate configuration on one cache dtype and batch size (see the module docstring)."""
    from spruce.attention.triton_backend import GROUPED_CANDIDATES, TritonAttention
    from spruce.ops.fp8_select import graph_time_ms

    device = torch.device(args.device)
    heads, kv_heads, dim = HEAD_SHAPES[args.head_shape] if not args.smoke else (4, 2, 16)
    dtype = getattr(torch, args.dtype)
    batch, table, num_pages = make_decode_batch(bs, args.context, args.page_size, device)
    g = torch.Generator(device=device).manual_seed(1)
    slots = num_pages * args.page_size
    k_cache = torch.randn(slots, kv_heads, dim, device=device, generator=g, dtype=dtype).to(cache_dtype)
    v_cache = torch.randn(slots, kv_heads, dim, device=device, generator=g, dtype=dtype).to(cache_dtype)
    q = torch.randn(bs, heads, dim, device=device, generator=g, dtype=dtype)
    backend = TritonAttention(args.page_size)
    read = 2 * bs * args.context * kv_heads * dim * cache_dtype.itemsize  # K and V of every cached key

    def call():
        return backend.attend(q, k_cache, v_cache, slots, batch, table, dim ** -0.5)[0]

    default = backend.grouped_decode_config(cache_dtype, dtype)
    want = call()
    effective = []  # each candidate as it launches on this cache and query (FP16_DOT only for an FP8 cache)
    for cfg in GROUPED_CANDIDATES:
        backend.grouped_config = cfg
        effective.append(backend.grouped_decode_config(cache_dtype, dtype))
    rows, best = {}, None
    for cfg in dict.fromkeys([default, *effective]):
        backend.grouped_config = cfg
        name = "n{block_n}-w{num_warps}-s{num_stages}{pf}{f16}-{per_sm}persm".format(
            **asdict(cfg), pf="-prefetch" if cfg.prefetch else "", f16="-fp16dot" if cfg.fp16_dot else "")
        splits = backend.grouped_splits(bs * kv_heads, args.context, cfg, device)
        try:
            diff = (call().float() - want.float()).abs().max().item()
            ms = graph_time_ms(lambda _: call(), 1, device.type == "cuda", args.reps)
        except Exception as e:  # noqa: BLE001 - a configuration that fails to compile or launch is a result
            rows[name] = {"config": asdict(cfg), "error": f"{type(e).__name__}: {e}"[:300]}
            continue
        row = {"config": asdict(cfg), "kv_splits": splits, "ms": ms, "gb_per_s": read / ms / 1e6,
               "max_abs_diff_vs_default": diff}
        if bandwidth:
            row["roofline_fraction"] = read / bandwidth * 1e3 / ms
        rows[name] = row
        if cfg == default:
            rows[name]["default"] = True
        if best is None or ms < rows[best]["ms"]:
            best = name
    return {"kv_read_bytes": read, "programs_before_splits": bs * kv_heads, "best": best, "candidates": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spruce.bench.decode_attention",
                                 description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--head-shape", default="llama-3.1-8b", choices=sorted(HEAD_SHAPES))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=32768, help="cached keys per request")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", help="the query's (and the 16-bit cache's) dtype")
    ap.add_argument("--reps", type=int, default=10, help="calls per CUDA graph replay")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="CPU under Triton's interpreter, tiny shapes")
    ap.add_argument("--out", required=True, help="the JSON to write")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.device, args.dtype, args.context, args.batch_sizes, args.page_size = "cpu", "float32", 40, [2], 4
    from spruce.ops.fp8 import FP8_DTYPE

    bandwidth = None
    if args.device.startswith("cuda"):
        from spruce.bench.common import measure_copy_bandwidth

        bandwidth = measure_copy_bandwidth(args.device)
    figures: dict = {"copy_bandwidth_bytes_per_s": bandwidth}
    for cache_dtype in (getattr(torch, args.dtype), FP8_DTYPE):
        name = str(cache_dtype).removeprefix("torch.")
        figures[name] = {f"bs{bs}": measure(args, cache_dtype, bs, bandwidth) for bs in args.batch_sizes}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "decode_attention", "config": vars(args), "figures": figures},
                              indent=2) + "\n")
    for dt, per_bs in figures.items():
        if isinstance(per_bs, dict):
            for bs, f in per_bs.items():
                print(dt, bs, "best", f["best"], {k: round(v.get("ms", float("nan")), 4)
                                                  for k, v in f["candidates"].items()})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
