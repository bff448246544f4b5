"""TTFT of one long prompt at the Llama-3.1-8B shape (random bf16 weights), per attention backend (issue 14).

Reports the prefill wall time (max_tokens=1, after one warm-up prompt of the same length) and the
TFLOP/s-equivalent counted as 2 x params x tokens + causal attention (4 x T^2 / 2 x heads x head_dim x layers).

    python bench/ttft_long.py --tokens 16384 --backends flashinfer triton --out result.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from spruce import LLM, SamplingParams
from spruce.bench.shapes import write_shape_dirs
from spruce.runtime.device import device_name


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--backends", nargs="+", default=["flashinfer", "triton"])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    n = args.tokens
    with tempfile.TemporaryDirectory() as tmp:
        model, _ = write_shape_dirs("llama-3.1-8b", Path(tmp))
        cfg = json.loads((Path(model) / "config.json").read_text())
        rows = []
        for backend in args.backends:
            llm = LLM(str(model), device="cuda", dtype="bfloat16", load_format="dummy", attention_backend=backend,
                      max_total_tokens=2 * n + 256, context_length=n + 64, chunked_prefill_size=n)
            params_count = llm.engine.weight_bytes() / 2
            g = torch.Generator().manual_seed(0)
            prompts = [torch.randint(100, 30000, (n,), generator=g).tolist() for _ in range(2)]
            llm.generate([prompts[0]], SamplingParams(max_tokens=1))  # warm-up (JIT, allocations)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate([prompts[1]], SamplingParams(max_tokens=1))
            torch.cuda.synchronize()
            ttft = time.perf_counter() - t0
            attn = 4 * n * n / 2 * cfg["num_attention_heads"] * (cfg["hidden_size"] // cfg["num_attention_heads"]) \
                * cfg["num_hidden_layers"]
            flops = 2 * params_count * n + attn
            rows.append({"backend": backend, "tokens": n, "ttft_s": ttft, "tflops_equivalent": flops / ttft / 1e12,
                         "linear_tflop": 2 * params_count * n / 1e12, "attention_tflop": attn / 1e12})
            print(json.dumps(rows[-1]), flush=True)
            del llm
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"bench": "ttft_long", "device": device_name("cuda"),
                       "commit": os.environ.get("SPRUCE_GIT_COMMIT", "unknown"),
                       "config": {"shape": "llama-3.1-8b", "dtype": "bfloat16", "tokens": n,
                                  "target_tflops": 550, "h100_dense_bf16_peak_tflops": 989}, "rows": rows},
                      f, indent=2)


if __name__ == "__main__":
    main()
