"""Kernel table (issue 14): one attention layer per phase, Triton vs FlashInfer, at the Llama-3.1-8B shape.

Phases: decode, verify (N=32 tree tokens), draft decode (K=8 frontier, scratch K*S=40), draft extend (stride
S+1=6), prefill (bs 1). Batch 1/16/64 x context 1k/8k/32k, bf16, page 16. Each case times the backend's forward
(store + attention; decode-time phases replayed from a CUDA graph as the engine runs them, prefill eagerly;
FlashInfer's plan is host work outside it, timed apart),
and reports the HBM roofline of the KV bytes it must read. Under overlap scheduling the host's known length
trails the device by a round, so the FlashInfer half gets floor = context - (S+1) (decode: context - 1) and the
Triton tail the rest.

    python bench/attention_table.py --out bench/results/attention-table-<device>.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from types import SimpleNamespace

import torch

from spruce.attention.metadata import ForwardBatch, Phase
from spruce.runtime.device import device_name

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
STEPS, TOPK, VERIFY_N = 5, 8, 32


def build(phase: Phase, bs: int, ctx: int, device="cuda"):
    """Pools, page table and a ForwardBatch with host fields, for `bs` requests of `ctx` committed tokens."""
    q_len = {Phase.DECODE: 1, Phase.VERIFY: VERIFY_N, Phase.DRAFT_DECODE: TOPK, Phase.DRAFT_EXTEND: STEPS + 1,
             Phase.EXTEND: ctx}[phase]
    width = {Phase.VERIFY: VERIFY_N, Phase.DRAFT_DECODE: TOPK * STEPS}.get(phase, 0)
    prefix = 0 if phase == Phase.EXTEND else ctx - (1 if phase == Phase.DECODE else 0)
    pages_per = -(-(prefix + q_len + STEPS + 1) // PAGE)
    num_pages = 1 + bs * pages_per
    table = torch.zeros(bs + 1, pages_per, dtype=torch.int32, device=device)
    table[:bs] = (1 + torch.randperm(bs * pages_per, device=device).view(bs, pages_per)).to(torch.int32)
    scratch_start = num_pages * PAGE
    slots = scratch_start + (bs + 1) * width
    kc = torch.randn(slots, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    t = bs * q_len
    rows = torch.arange(bs, device=device)
    token_rows = rows.repeat_interleave(q_len)
    idx = torch.arange(q_len, device=device).repeat(bs)
    words = max(1, -(-width // 64))
    tree_mask = torch.zeros(t, words, dtype=torch.int64, device=device)
    if width:  # a chain: token i sees scratch entries 0..i
        bits = idx[:, None] >= torch.arange(64 * words, device=device)[None, :]
        weights = torch.tensor([1 << j for j in range(63)] + [-(1 << 63)], dtype=torch.int64, device=device)
        tree_mask = (bits.view(t, words, 64).long() * weights).sum(-1)
        kv_lens = torch.full((t,), prefix, dtype=torch.int32, device=device)
        out_slots = scratch_start + token_rows * width + idx
        positions = prefix + idx
    else:
        positions = prefix + idx
        kv_lens = (positions + 1).to(torch.int32)
        out_slots = table[token_rows, positions // PAGE].long() * PAGE + positions % PAGE
    floor = 0 if phase == Phase.EXTEND else max(ctx - (1 if phase == Phase.DECODE else STEPS + 1), 0)
    batch = ForwardBatch(
        phase=phase, batch_size=bs, num_tokens=t, input_ids=torch.zeros(t, dtype=torch.int64, device=device),
        positions=positions, out_slots=out_slots.long(), token_rows=token_rows, kv_lens=kv_lens, tree_mask=tree_mask,
        req_rows=rows, qo_indptr=torch.arange(0, t + 1, q_len, dtype=torch.int32, device=device),
        max_kv_len=int(kv_lens.max()), max_q_len=q_len, scratch_width=width,
        host_q_lens=(q_len,) * bs if phase == Phase.EXTEND else None,
        host_kv_lens=(prefix + q_len,) * bs if phase == Phase.EXTEND else None,
        host_rows=tuple(range(bs)), host_kv_floor=None if phase == Phase.EXTEND else (floor,) * bs)
    q = torch.randn(t, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    k = torch.randn(t, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    limits = SimpleNamespace(page_size=PAGE, num_rows=bs + 1, max_pages_per_request=pages_per, dummy_row=bs)
    return q, k, v, kc, vc, scratch_start, batch, table, limits


def graph_ms(fn, iters: int) -> float:
    """Mean ms of `fn` replayed from a CUDA graph (one eager warm-up first, on the capture stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / iters


def eager_ms(fn, iters: int) -> float:
    for _ in range(2):
        fn()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / iters


def time_backend(backend, case, iters: int) -> dict:
    """Forward time (decode-time phases: CUDA-graph replays, as the engine runs them; prefill: eager), the host
    plan time, and for flashinfer the Triton tail + scratch half alone."""
    q, k, v, kc, vc, start, batch, table, _ = case
    scale = HEAD_DIM ** -0.5
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        backend.plan(batch, table)
    torch.cuda.synchronize()
    res = {"plan_ms": (time.perf_counter() - t0) / 5 * 1e3}

    def forward():
        backend.forward(q, k, v, kc, vc, start, batch, table, scale)

    timer = eager_ms if batch.phase == Phase.EXTEND else graph_ms
    forward()  # first forward of a shape plans it (outside any capture)
    res["ms"] = timer(forward, iters)
    if backend.name == "flashinfer" and batch.phase != Phase.EXTEND:
        kv_start = backend.tail_start(batch.phase)
        res["tail_ms"] = graph_ms(lambda: backend.tail.attend(q, kc, vc, start, batch, table, scale,
                                                              kv_start=kv_start, return_lse=True), iters)
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    p.add_argument("--backends", nargs="+", default=["triton", "flashinfer"])
    p.add_argument("--hbm-gbps", type=float, default=3350.0, help="HBM bandwidth for the roofline (H100 SXM)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from spruce.attention.backend import create_backend

    rows = []
    for phase in (Phase.DECODE, Phase.VERIFY, Phase.DRAFT_DECODE, Phase.DRAFT_EXTEND, Phase.EXTEND):
        for ctx in args.contexts:
            for bs in args.batch_sizes:
                if phase == Phase.EXTEND and bs > 1:
                    continue
                case = build(phase, bs, ctx)
                kv_bytes = bs * ctx * KV_HEADS * HEAD_DIM * 2 * 2
                entry = {"phase": phase.value, "bs": bs, "context": ctx,
                         "kv_read_roofline_ms": kv_bytes / (args.hbm_gbps * 1e9) * 1e3}
                if phase == Phase.EXTEND:  # causal attention FLOPs: 2 matmuls x 2 x (ctx^2 / 2) x heads x dim
                    entry["attention_tflop"] = 2 * 2 * ctx * ctx / 2 * HEADS * HEAD_DIM / 1e12
                for name in args.backends:
                    backend = create_backend(name, PAGE)
                    backend.allocate(case[-1], "cuda")
                    iters = 3 if phase == Phase.EXTEND and ctx >= 16384 else 20
                    for key, value in time_backend(backend, case, iters).items():
                        entry[f"{name}_{key}"] = value
                    if "attention_tflop" in entry:
                        entry[f"{name}_tflops"] = entry["attention_tflop"] / (entry[f"{name}_ms"] / 1e3)
                    del backend
                ms = {n: entry[f"{n}_ms"] for n in args.backends}
                entry["faster"] = min(ms, key=ms.get)
                rows.append(entry)
                print(json.dumps(entry), flush=True)
                del case
                torch.cuda.empty_cache()
    result = {"bench": "attention_table", "device": device_name("cuda"),
              "commit": os.environ.get("SPRUCE_GIT_COMMIT", "unknown"),
              "config": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "page_size": PAGE,
                         "dtype": "bfloat16", "steps": STEPS, "topk": TOPK, "verify_tokens": VERIFY_N,
                         "hbm_gbps_roofline": args.hbm_gbps},
              "rows": rows}
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
