"""FP8 decode benchmark (random weights at a named shape): the plain bs-N decode step unquantized (--dtype, bf16),
in FP8 per-channel (quantized at load) and FP8 block-wise (the shape's config given DeepSeek-V3's 128x128
quantization_config), each against the bytes it must read (weights touched + cached KV) at the measured copy
bandwidth; then the FP8 KV cache against the model-dtype cache at a long context (same weights, same backend).

    python -m spruce.bench.fp8 --model-shape llama-3.1-8b [--batch-sizes 1] [--kv-context 32768]
        [--kv-batch-sizes 1 8] [--kv-weights fp8]

Writes bench/results/fp8-<device>-<time>.json: per run the mean decode step (ms), its read bytes, the fraction of
the copy-bandwidth roofline, and the speed-ups (unquantized step / FP8 step; model-dtype-KV step / FP8-KV step).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import tempfile
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


def run(args) -> dict:
    from spruce.bench.shapes import write_shape_dirs

    bandwidth = None
    if args.device.startswith("cuda"):
        from spruce.bench.common import measure_copy_bandwidth

        bandwidth = measure_copy_bandwidth(args.device)
    root = Path(tempfile.mkdtemp(prefix="spruce-fp8-"))
    try:
        target = Path(args.model) if args.model else write_shape_dirs(args.model_shape, root)[0]
        block = block_shape_dir(target, root)
        figures = {"copy_bandwidth_bytes_per_s": bandwidth, "weights": {}, "kv_cache": {}}
        common = dict(context=args.context, output_len=args.output_len, device=args.device, backend=args.backend,
                      dtype=args.dtype)
        for bs in args.batch_sizes:
            runs = {"unquantized": decode_step(target, bs=bs, **common),
                    "fp8_per_channel": decode_step(target, bs=bs, quantization="fp8", **common),
                    "fp8_block": decode_step(block, bs=bs, **common)}
            runs = {k: with_roofline(v, bandwidth) for k, v in runs.items()}
            for k in ("fp8_per_channel", "fp8_block"):
                runs[k]["speedup_vs_unquantized"] = runs["unquantized"]["decode_step_ms"] / runs[k]["decode_step_ms"]
            figures["weights"][f"bs{bs}"] = runs
        kv = dict(common, context=args.kv_context, backend=args.kv_backend)
        for bs in args.kv_batch_sizes:
            runs = {"model_dtype_kv": decode_step(target, bs=bs, quantization=args.kv_weights, **kv),
                    "fp8_kv": decode_step(target, bs=bs, quantization=args.kv_weights, kv_cache_dtype="fp8_e4m3",
                                          **kv)}
            runs = {k: with_roofline(v, bandwidth) for k, v in runs.items()}
            runs["fp8_kv"]["speedup_vs_model_dtype_kv"] = (runs["model_dtype_kv"]["decode_step_ms"]
                                                           / runs["fp8_kv"]["decode_step_ms"])
            figures["kv_cache"][f"bs{bs}"] = runs
        return figures
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spruce.bench.fp8", description=__doc__.split("\n\n")[0],
                                 allow_abbrev=False)
    ap.add_argument("--model-shape", default="llama-3.1-8b", help="named shape (random weights)")
    ap.add_argument("--model", default=None, help="a config.json directory instead of --model-shape")
    ap.add_argument("--batch-sizes", type=int, nargs="*", default=[1], help="none: skip the weight runs")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens of the weight runs")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--backend", default=None, help="attention backend of the weight runs (default: auto)")
    ap.add_argument("--kv-context", type=int, default=32768, help="prompt tokens of the KV cache runs")
    ap.add_argument("--kv-batch-sizes", type=int, nargs="*", default=[1], help="none: skip the KV cache runs")
    ap.add_argument("--kv-backend", default="triton", help="attention backend of the KV runs (reads FP8)")
    ap.add_argument("--kv-weights", default=None, choices=[None, "fp8"], help="weights of the KV runs")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", help="the model dtype (the unquantized runs' weights)")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    figures = run(args)
    from spruce.bench.common import write_result

    path = write_result("fp8", args.device, vars(args), figures, args.out_dir)
    print(json.dumps(figures, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
