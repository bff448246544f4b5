"""Triton GEMM with FP8 (e4m3) weights and group-wise scales: the block-scaled linear (DeepSeek-V3 / Qwen3-FP8)
and every FP8 layout torch's scaled matmul does not take.

    out[m, n] = sum_k x[m, k] * weight[n, k] * scale[n, k // GROUP_K]  (+ bias[n])

x [M, K] in the compute dtype, weight [N, K] float8_e4m3fn, scale [N, G] float32, G = ceil(K / GROUP_K)
(G == 1: one scale per output row, per-channel / per-tensor; GROUP_K = 128: 128x128 blocks, spruce
keeps a block's scale on each of its rows, ops/fp8.py). Each program owns a BLOCK_M x BLOCK_N tile and walks K
in steps of BLOCK_K, which divides GROUP_K, so one step lies in one scale group: the fp8 tile is widened exactly
to x's dtype, multiplied on the tensor cores (fp32 accumulate, IEEE products for float32 inputs), and the step's
partial sum is scaled per column before it joins the accumulator (with G == 1, once at the end). Activations are
not quantized: the products are those of the dequantized weight, as the CPU emulation computes them (ops/fp8.py).

Decode-sized M leaves too few output tiles to occupy the GPU (N / 64 programs), so K is split: program (m, n, s)
sums K range s into an fp32 partial [S, M, N], and a torch sum over S (fixed order: deterministic) adds them.
"""

from __future__ import annotations

import torch

from spruce.ops.triton_support import tl, triton


@triton.jit
def _fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_wn, stride_sn,
                     stride_om, stride_os, GROUP_K: tl.constexpr, ONE_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                     IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)  # K range [pid_s * k_per_split, ...) (k_per_split a multiple of BLOCK_K)
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    rk = tl.arange(0, BLOCK_K)  # [BK]
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + rk
        k_ok = k < k_hi
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + rn[None, :] * stride_wn + k[:, None], mask=n_ok[None, :] & k_ok[:, None],
                    other=0.0)  # [BK, BN] fp8
        w = w.to(x.dtype)
        if IEEE:
            part = tl.dot(x, w, input_precision="ieee")
        else:
            part = tl.dot(x, w)
        if ONE_GROUP:
            acc += part
        else:
            s = tl.load(s_ptr + rn * stride_sn + k0 // GROUP_K, mask=n_ok, other=0.0)  # [BN]
            acc += part * s[None, :]
    if ONE_GROUP:
        s = tl.load(s_ptr + rn * stride_sn, mask=n_ok, other=0.0)
        acc = acc * s[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + pid_s * stride_os + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _block_sizes(m: int, group_k: int, one_group: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps): 16-row tiles and narrow columns for decode-sized M (the weight reads
    dominate: more programs, longer K steps), wider ones for prefill. BLOCK_K divides the scale group (128 for
    blocks) unless one scale covers the row."""
    block_k = 128 if one_group else min(128, group_k)
    if m <= 16:
        return 16, 32, 256 if one_group else block_k, 4
    if m <= 64:
        return 64, 64, block_k, 4
    return 128, 128, min(block_k, 64), 8


_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def _num_splits(m: int, n: int, k: int, bm: int, bn: int, bk: int, device: torch.device) -> int:
    """K splits for decode-sized M: enough programs for two per SM, each split at least 4 K steps long."""
    if m > 64:
        return 1
    programs = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    return max(1, min(triton.cdiv(2 * _num_sms(device), programs), k // (4 * bk)))


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_k: int | None,
             bias: torch.Tensor | None = None, splits: int | None = None) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] fp8 * scale [N, G] per row and K-group of `group_k` columns; None: per-row
    [N, 1]).T (+ bias [N]) -> [M, N] in x's dtype.

    Needs group_k to be a power of two >= 16 when G > 1 (128 for block-scaled checkpoints). `splits`: K splits
    (None: by shape, `_num_splits`)."""
    m, k = x.shape
    n = weight.shape[0]
    one_group = group_k is None or group_k >= k
    if not one_group and (group_k < 16 or group_k & (group_k - 1)):
        raise ValueError(f"fp8_gemm needs a power-of-two scale group >= 16 along K, got {group_k} (K={k})")
    x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    bm, bn, bk, warps = _block_sizes(m, group_k, one_group)
    splits = splits or _num_splits(m, n, k, bm, bn, bk, x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), bk) * bk
    splits = triton.cdiv(k, k_per_split)
    dest = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), splits)
    _fp8_gemm_kernel[grid](x, weight, scale, x if bias is None else bias, dest, m, n, k, k_per_split, x.stride(0),
                           weight.stride(0), scale.stride(0), dest.stride(-2), m * n, GROUP_K=group_k or k,
                           ONE_GROUP=one_group, HAS_BIAS=bias is not None and splits == 1,
                           IEEE=x.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    if splits == 1:
        return out
    total = dest.sum(dim=0)  # [M, N] fp32
    if bias is not None:
        total += bias.float()
    return total.to(x.dtype)
