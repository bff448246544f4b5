"""Fused elementwise ops of the decoder (RMSNorm with residual add, rotary, SiLU-and-mul).

Each op has a plain torch version (the reference, used on CPU) and a Triton kernel (used for CUDA tensors);
tests run both, through Triton's interpreter on CPU and natively on the GPU, and require equal results.
Triton is optional: kernel modules take it from `spruce.ops.triton_support`, and without it every op runs
its torch version.
"""

from spruce.ops.fused import add_rms_norm, qk_rotary_, rms_norm, rotary_, silu_and_mul
from spruce.ops.moe import fused_moe
from spruce.ops.topk import softmax_topk

__all__ = ["add_rms_norm", "fused_moe", "qk_rotary_", "rms_norm", "rotary_", "silu_and_mul", "softmax_topk"]
