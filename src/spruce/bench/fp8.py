"""FP8 decode benchmark (random weights at a named shape), in sections (--sections, each written to the JSON as
it finishes, an error recorded in its place):

    gemm      every FP8 GEMM candidate (ops/fp8_select.py) on each linear of the shape (q/k/v, o, gate/up, down),
              per-channel and 128x128 block scales, at M = --gemm-m (1 4 8 16): ms, GB/s and the fraction of the
              copy-bandwidth roofline of the bytes it reads, the pick, and cuBLAS's bf16 linear for reference
    weights   the plain bs-N decode step unquantized (--dtype, bf16), FP8 per-channel (quantized at load) and FP8
              block-wise (DeepSeek-V3's 128x128 quantization_config), each against the bytes it reads (weights
              touched + cached KV), with the kernels chosen for each FP8 linear
    kv        the FP8 KV cache against the model-dtype cache at --kv-context for each of --kv-batch-sizes
    deepseek  the --moe-shape (deepseek-v2-lite) decode step unquantized and FP8 block-wise
    pycode    perplexity of --pycode (a real checkpoint, e.g. ../shared/models/pycode-19m) on its held-out
              prompts, unquantized against FP8 quantized at load (skipped when absent)

    python -m spruce.bench.fp8 --out fp8.json --pycode ../shared/models/pycode-19m
    python -m spruce.bench.fp8 --smoke --out fp8.json      (CPU, the bundled demo model, tiny shapes)

--write-table PATH also writes the load-time kernel choices as a table; installed as
src/spruce/ops/tables/fp8_gemm-<device>.json, ops/fp8_select.py reads it instead of measuring at load.
Without --out: bench/results/fp8-<device>-<time>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import tempfile
import time
import traceback
from pathlib import Path

import torch


def block_shape_dir(target: Path, root: Path) -> Path:
    """A copy of the shape's directory whose config.json says block-wise FP8 (128x128, DeepSeek-V3's layout)."""
    out = root / f"{target.name}-fp8-block"
    shutil.copytree(target, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def decode_step(model: Path, *, bs: int, context: int, output_len: int, device: str, backend: str | None,
                dtype: str = "bfloat16", quantization: str | None = None, kv_cache_dtype: str = "auto",
                graphs: bool = True) -> dict:
    """Mean plain decode step (ms) of `bs` requests at `context` prompt tokens, and the bytes that step reads."""
    from spruce import LLM, SamplingParams

    llm = LLM(model, device=device, dtype=dtype, load_format="dummy", quantization=quantization,
              kv_cache_dtype=kv_cache_dtype, attention_backend=backend, page_size=16, max_running_requests=bs,
              cuda_graph=graphs if device.startswith("cuda") else False, cuda_graph_max_bs=bs,
              context_length=context + output_len + 64, max_total_tokens=bs * (context + output_len + 80))
    eng = llm.engine
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, eng.vocab_size - 10, (bs, context), generator=g).tolist()
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up (graphs, kernels)
    timer = eng.phase_timer
    timer.reset()
    timer.enabled = True
    llm.generate(prompts, SamplingParams(max_tokens=output_len, ignore_eos=True))
    timer.enabled = False
    step_ms = timer.collect()["decode"]["mean_ms"]
    run = {"decode_step_ms": step_ms, "decode_read_bytes": eng.decode_read_bytes(bs, context + output_len // 2),
           "weight_bytes": eng.weight_bytes(), "attention": eng.info().get("attention_backend"),
           "quantization": quantization, "kv_cache_dtype": kv_cache_dtype, "batch_size": bs, "context": context}
    llm.shutdown()
    del llm, eng
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return run


def with_roofline(run: dict, bandwidth: float | None) -> dict:
    """`run` plus the fraction of the copy-bandwidth roofline its step reaches (read bytes / bandwidth / step)."""
    if bandwidth:
        run["roofline_ms"] = run["decode_read_bytes"] / bandwidth * 1e3
        run["roofline_fraction"] = run["roofline_ms"] / run["decode_step_ms"]
    return run


def linear_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of a dense decoder layer's linears (fused q/k/v and gate/up, as spruce holds them)."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    dim = cfg.get("head_dim") or hidden // heads
    kv = cfg.get("num_key_value_heads", heads)
    inter = cfg["intermediate_size"]
    return {"qkv_proj": ((heads + 2 * kv) * dim, hidden), "o_proj": (hidden, heads * dim),
            "gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter)}


def gemm_section(cfg: dict, ms: list[int], device: str, dtype: torch.dtype, bandwidth: float | None) -> dict:
    """Every candidate on every linear, layout and M (ops/fp8_select.measure), with bytes, GB/s and roofline."""
    from spruce.ops import fp8
    from spruce.ops.fp8_select import measure, pick

    out = {}
    g = torch.Generator(device=device).manual_seed(0)
    for name, (n, k) in linear_shapes(cfg).items():
        w = torch.randn(n, k, device=device, generator=g, dtype=torch.float32) * 0.02
        layouts = {"channel": (fp8.quantize_rows(w, None), None)}
        q, blocks = fp8.quantize_blocks(w)
        layouts["block128"] = ((q, fp8.block_scale_rows(blocks, n)), 128)
        wb = w.to(dtype)
        del w
        for layout, ((q, scale), group) in layouts.items():
            for m in ms:
                times = measure(q, scale, group, None, m, dtype=dtype)
                read = q.numel() + scale.numel() * 4 + m * k * wb.element_size() + m * n * wb.element_size()
                cands = {}
                for cand, t in times.items():
                    row = {"ms": t} if isinstance(t, float) else {"note": t}
                    if isinstance(t, float):
                        row["gb_per_s"] = read / t / 1e6
                        if bandwidth:
                            row["roofline_fraction"] = read / bandwidth * 1e3 / t
                    cands[cand] = row
                out[f"{name} N={n} K={k} {layout} M={m}"] = {"read_bytes": read, "pick": pick(times),
                                                            "candidates": cands}
        if device.startswith("cuda"):  # cuBLAS bf16 for reference (the unquantized step's linears)
            from spruce.ops.fp8_select import graph_time_ms

            copies = max(1, min(8, -(-(256 << 20) // (wb.numel() * wb.element_size()))))
            ws = [wb] + [wb.clone() for _ in range(copies - 1)]
            for m in ms:
                x = torch.randn(m, k, device=device, dtype=dtype)
                t = graph_time_ms(lambda i: torch.nn.functional.linear(x, ws[i]), copies)
                read = wb.numel() * wb.element_size()
                out[f"{name} N={n} K={k} {str(dtype).removeprefix('torch.')} M={m}"] = {
                    "ms": t, "gb_per_s": read / t / 1e6,
                    **({"roofline_fraction": read / bandwidth * 1e3 / t} if bandwidth else {})}
            del ws
        del wb, layouts, q, scale
        gc.collect()
    return out


def weights_section(target: Path, block: Path, args, bandwidth) -> dict:
    from spruce.ops.fp8_select import table_rows

    common = dict(context=args.context, output_len=args.output_len, device=args.device, backend=args.backend,
                  dtype=args.dtype)
    figures = {}
    for bs in args.batch_sizes:
        runs = {"unquantized": decode_step(target, bs=bs, **common),
                "fp8_per_channel": decode_step(target, bs=bs, quantization="fp8", **common),
                "fp8_block": decode_step(block, bs=bs, **common)}
        runs = {k: with_roofline(v, bandwidth) for k, v in runs.items()}
        for k in ("fp8_per_channel", "fp8_block"):
            runs[k]["speedup_vs_unquantized"] = runs["unquantized"]["decode_step_ms"] / runs[k]["decode_step_ms"]
        figures[f"bs{bs}"] = runs
    if args.device.startswith("cuda"):
        figures["kernel_choices"] = table_rows(torch.cuda.get_device_name(torch.device(args.device)))
    return figures


def kv_section(target: Path, args, bandwidth) -> dict:
    kv = dict(context=args.kv_context, output_len=args.output_len, device=args.device, backend=args.kv_backend,
              dtype=args.dtype)
    figures = {}
    for bs in args.kv_batch_sizes:
        runs = {"model_dtype_kv": decode_step(target, bs=bs, quantization=args.kv_weights, **kv),
                "fp8_kv": decode_step(target, bs=bs, quantization=args.kv_weights, kv_cache_dtype="fp8_e4m3", **kv)}
        runs = {k: with_roofline(v, bandwidth) for k, v in runs.items()}
        runs["fp8_kv"]["speedup_vs_model_dtype_kv"] = (runs["model_dtype_kv"]["decode_step_ms"]
                                                       / runs["fp8_kv"]["decode_step_ms"])
        kv_bytes = runs["model_dtype_kv"]["decode_read_bytes"] - runs["model_dtype_kv"]["weight_bytes"]
        runs["kv_share_of_model_dtype_read_bytes"] = kv_bytes / runs["model_dtype_kv"]["decode_read_bytes"]
        runs["read_bytes_ratio"] = (runs["model_dtype_kv"]["decode_read_bytes"]  # the speed-up at equal bandwidth
                                    / runs["fp8_kv"]["decode_read_bytes"])
        figures[f"bs{bs}"] = runs
    return figures


def deepseek_section(args, root: Path, bandwidth) -> dict:
    from spruce.bench.shapes import write_shape_dirs

    target = write_shape_dirs(args.moe_shape, root / "moe")[0]
    block = block_shape_dir(target, root / "moe")
    common = dict(context=args.context, output_len=args.output_len, device=args.device, backend=args.backend,
                  dtype=args.dtype)
    runs = {"unquantized": decode_step(target, bs=1, **common), "fp8_block": decode_step(block, bs=1, **common)}
    runs = {k: with_roofline(v, bandwidth) for k, v in runs.items()}
    runs["fp8_block"]["speedup_vs_unquantized"] = (runs["unquantized"]["decode_step_ms"]
                                                   / runs["fp8_block"]["decode_step_ms"])
    return {"shape": args.moe_shape, "bs1": runs}


def perplexity(model: Path, *, device: str, dtype: str, quantization: str | None, prompts: list[str],
               max_tokens: int) -> dict:
    """exp(mean negative log-likelihood) of each prompt's tokens after its first (truncated to max_tokens)."""
    from spruce import LLM, SamplingParams

    llm = LLM(model, device=device, dtype=dtype, quantization=quantization, page_size=16,
              cuda_graph=False, context_length=max_tokens + 16)
    ids = [llm.tokenizer.encode(p)[:max_tokens] for p in prompts]
    ids = [i for i in ids if len(i) > 1]
    outs = llm.generate(ids, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0))
    nll, count = 0.0, 0
    for toks, o in zip(ids, outs):
        for pos, entry in enumerate(o.prompt_logprobs):
            if entry is None:
                continue
            nll -= entry[toks[pos]].logprob
            count += 1
    llm.shutdown()
    del llm
    gc.collect()
    return {"perplexity": math.exp(nll / count), "tokens": count, "prompts": len(ids)}


def pycode_section(args) -> dict:
    path = Path(args.pycode) if args.pycode else None
    if path is None or not (path / "config.json").exists():
        return {"skipped": f"no model at {args.pycode!r} (--pycode)"}
    file = path / "heldout_prompts.jsonl"
    prompts = [json.loads(line)["text"] for line in file.read_text().splitlines() if line.strip()]
    prompts = prompts[:args.pycode_prompts]
    common = dict(device=args.device, dtype=args.dtype, prompts=prompts, max_tokens=args.pycode_tokens)
    plain = perplexity(path, quantization=None, **common)
    quant = perplexity(path, quantization="fp8", **common)
    return {"model": str(path), "unquantized": plain, "fp8_per_channel": quant,
            "ratio": quant["perplexity"] / plain["perplexity"]}


def run(args, write) -> dict:
    """Every section of --sections, `write(figures)` after each (a crash or timeout keeps what finished)."""
    from spruce.bench.shapes import write_shape_dirs

    bandwidth = None
    if args.device.startswith("cuda"):
        from spruce.bench.common import measure_copy_bandwidth

        bandwidth = measure_copy_bandwidth(args.device)
    root = Path(tempfile.mkdtemp(prefix="spruce-fp8-"))
    figures = {"copy_bandwidth_bytes_per_s": bandwidth, "seconds": {}}
    try:
        target = Path(args.model) if args.model else write_shape_dirs(args.model_shape, root)[0]
        block = block_shape_dir(target, root)
        cfg = json.loads((target / "config.json").read_text())
        dtype = getattr(torch, args.dtype)
        sections = {
            "gemm": lambda: gemm_section(cfg, args.gemm_m, args.device, dtype, bandwidth),
            "weights": lambda: weights_section(target, block, args, bandwidth),
            "kv_cache": lambda: kv_section(target, args, bandwidth),
            "deepseek": lambda: deepseek_section(args, root, bandwidth),
            "pycode": lambda: pycode_section(args),
        }
        for name in args.sections:
            start = time.perf_counter()
            try:
                figures[name] = sections[name]()
            except Exception as e:  # one section's failure is recorded; the others still run
                figures[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            figures["seconds"][name] = time.perf_counter() - start
            gc.collect()
            write(figures)
        return figures
    finally:
        shutil.rmtree(root, ignore_errors=True)


SECTIONS = ("gemm", "weights", "kv_cache", "deepseek", "pycode")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spruce.bench.fp8", description=__doc__.split("\n\n")[0],
                                 allow_abbrev=False)
    add_arguments(ap)
    return run_main(ap.parse_args(argv))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model-shape", default="llama-3.1-8b", help="named shape (random weights)")
    ap.add_argument("--model", default=None, help="a config.json directory instead of --model-shape")
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    ap.add_argument("--gemm-m", type=int, nargs="+", default=[1, 4, 8, 16], help="GEMM section: tokens (M)")
    ap.add_argument("--batch-sizes", type=int, nargs="*", default=[1], help="none: skip the weight runs")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens of the weight runs")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--backend", default=None, help="attention backend of the weight runs (default: auto)")
    ap.add_argument("--kv-context", type=int, default=32768, help="prompt tokens of the KV cache runs")
    ap.add_argument("--kv-batch-sizes", type=int, nargs="*", default=[1, 8],
                    help="none: skip the KV cache runs (bs 8 at 32k: the KV reads outweigh the weights 2:1)")
    ap.add_argument("--kv-backend", default="triton", help="attention backend of the KV runs (reads FP8)")
    ap.add_argument("--kv-weights", default=None, choices=[None, "fp8"], help="weights of the KV runs")
    ap.add_argument("--moe-shape", default="deepseek-v2-lite", help="deepseek section: named MoE/MLA shape")
    ap.add_argument("--pycode", default=None, help="pycode section: a checkpoint dir with heldout_prompts.jsonl")
    ap.add_argument("--pycode-prompts", type=int, default=53, help="pycode section: held-out prompts used")
    ap.add_argument("--pycode-tokens", type=int, default=1024, help="pycode section: tokens per prompt")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", help="the model dtype (the unquantized runs' weights)")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, the bundled demo model, tiny contexts, no deepseek section (checks it runs)")
    ap.add_argument("--out", default=None, help="the JSON to write (default: a file in --out-dir)")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--write-table", default=None, metavar="PATH",
                    help="also write this run's kernel choices as a table (install it as "
                         "src/spruce/ops/tables/fp8_gemm-<device>.json, which ops/fp8_select.py then reads)")


def run_main(args: argparse.Namespace) -> int:
    if args.smoke:
        from spruce.config import builtin_model_path

        os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton candidates on CPU tensors
        args.device, args.dtype, args.backend, args.kv_backend = "cpu", "float32", "torch", "torch"
        args.model = args.model or str(builtin_model_path())
        args.context, args.output_len, args.kv_context = 8, 3, 24
        args.kv_batch_sizes, args.gemm_m = [1, 2], [1, 4]
        args.sections = [s for s in args.sections if s != "deepseek"]
        args.pycode_prompts, args.pycode_tokens = 2, 48
    from spruce.bench.common import write_result

    def write(figures):
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"benchmark": "fp8", "config": vars(args), "figures": figures},
                                                 indent=2, default=str))

    figures = run(args, write)
    path = args.out or write_result("fp8", args.device, vars(args), figures, args.out_dir)
    if args.write_table and args.device.startswith("cuda"):
        from spruce.ops.fp8_select import table_path, table_rows

        name = torch.cuda.get_device_name(torch.device(args.device))
        table = Path(args.write_table)
        table.parent.mkdir(parents=True, exist_ok=True)
        table.write_text(json.dumps({"device": name, "source": str(path), "choices": table_rows(name)}, indent=1)
                         + "\n")
        print(f"wrote {table} (install as {table_path(name)})")
    print(json.dumps({k: v for k, v in figures.items() if k != "gemm"}, indent=2, default=str)[:20000])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
