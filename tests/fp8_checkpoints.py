"""Test helper: FP8 copies of tiny checkpoints in the published layouts, each with its float32 dequantized twin.

The quantization here is the tests' own (block loops, no spruce code), so a layout or scale mix-up in spruce's
loader shows as a mismatch against the twin, which holds exactly the values the FP8 tensors and scales encode."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from checkpoints import read_tensors

E4M3 = torch.float8_e4m3fn
# the linears FP8 checkpoints quantize: attention (MHA and MLA), dense MLPs, routed and shared experts, MTP's eh_proj
QUANTIZED = re.compile(r".*layers\.\d+\.(self_attn\.(q|k|v|o|q_a|q_b|kv_a_proj_with_mqa|kv_b)(_proj)?|"
                       r"mlp\.(shared_experts\.|experts\.\d+\.)?(gate|up|down)_proj|eh_proj)\.weight$")
LAYOUTS = ("block", "channel", "tensor")


def quantize_block_layout(w: torch.Tensor, bn: int, bk: int):
    """(fp8 [N, K], scale_inv [ceil(N/bn), ceil(K/bk)], dequantized float32 [N, K]), one block at a time."""
    n, k = w.shape
    gn, gk = -(-n // bn), -(-k // bk)
    scale = torch.empty(gn, gk)
    q = torch.empty(n, k, dtype=E4M3)
    deq = torch.empty(n, k)
    for i in range(gn):
        for j in range(gk):
            rows, cols = slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)
            block = w[rows, cols].float()
            scale[i, j] = block.abs().max() / 448.0
            q[rows, cols] = (block / scale[i, j]).to(E4M3)
            deq[rows, cols] = q[rows, cols].float() * scale[i, j]
    return q, scale, deq


def _quantize(w: torch.Tensor, layout: str, block):
    """{suffix: tensor} of one weight in `layout`, and its dequantized twin."""
    if layout == "block":
        q, s, deq = quantize_block_layout(w, *block)
        return {"weight": q, "weight_scale_inv": s}, deq
    if layout == "channel":
        s = w.float().abs().amax(dim=1, keepdim=True) / 448.0  # [N, 1]
    else:
        s = w.float().abs().max().reshape(()) / 448.0
    q = (w.float() / s).to(E4M3)
    return {"weight": q, "weight_scale": s}, q.float() * s


def quantization_config(layout: str, block=(128, 128)) -> dict:
    """config.json's quantization_config: DeepSeek-V3's for blocks, compressed-tensors' for channel / tensor."""
    if layout == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": layout, "dynamic": False, "symmetric": True},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}


def write_fp8_checkpoint(src, dst, twin, layout: str, block=(128, 128)) -> tuple[Path, Path]:
    """`dst`: `src` with its decoder linears in FP8 (`layout`); `twin`: `src` with those weights replaced by
    their dequantized float32 values (no quantization_config)."""
    fp8, deq = {}, {}
    for name, w in read_tensors(src).items():
        if QUANTIZED.match(name):
            parts, deq[name] = _quantize(w, layout, block)
            base = name.removesuffix("weight")
            fp8.update({base + suffix: t.contiguous() for suffix, t in parts.items()})
        else:
            fp8[name] = deq[name] = w
    for d, tensors in ((Path(dst), fp8), (Path(twin), deq)):
        d.mkdir(parents=True, exist_ok=True)
        for f in Path(src).iterdir():
            if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json" and f.is_file():
                shutil.copy(f, d / f.name)
        save_file(tensors, str(d / "model.safetensors"))
    cfg = json.loads((Path(dst) / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(layout, block)
    (Path(dst) / "config.json").write_text(json.dumps(cfg, indent=2))
    return Path(dst), Path(twin)
