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

Also here: `fp8_gemv`, the split-K GEMV for M <= 16 (whole weight rows per program, the K ranges summed in order
by the last program of each column block: one launch), and `quantize_activations`, dynamic per-token (and per
K group) FP8 activations in one launch, for torch's scaled matmuls. ops/fp8_select.py picks among them by shape.
"""

from __future__ import annotations

import torch

from spruce.ops.triton_support import tl, triton


@triton.jit
def _add_group(acc, part, s_ptr, rn, n_ok, stride_sn, k0, GROUP_K: tl.constexpr, ONE_GROUP: tl.constexpr):
    """acc [BM, BN] + part [BM, BN], the K step at k0 scaled by its group's column scales; with one group per row
    unscaled (`_scale_rows` scales the sum once)."""
    if ONE_GROUP:
        out = acc + part
    else:
        out = acc + part * tl.load(s_ptr + rn * stride_sn + k0 // GROUP_K, mask=n_ok, other=0.0)[None, :]
    return out


@triton.jit
def _scale_rows(acc, s_ptr, rn, n_ok, stride_sn, ONE_GROUP: tl.constexpr):
    """acc [BM, BN] times each column's one scale (one group per row), else as it is."""
    if ONE_GROUP:
        out = acc * tl.load(s_ptr + rn * stride_sn, mask=n_ok, other=0.0)[None, :]
    else:
        out = acc
    return out


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
        acc = _add_group(acc, part, s_ptr, rn, n_ok, stride_sn, k0, GROUP_K, ONE_GROUP)
    acc = _scale_rows(acc, s_ptr, rn, n_ok, stride_sn, ONE_GROUP)
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


# --- decode-sized M: split-K GEMV -------------------------------------------------------------------------------
# M <= 16 tokens (a decode step, a speculative verify) read each weight byte once and do ~M FLOPs per byte: the
# kernel is bound by its weight reads. Each program owns BLOCK_N whole rows over one K range and streams
# [BLOCK_N, BLOCK_K] fp8 tiles (K contiguous: 16-byte loads), widened in registers; USE_DOT multiplies on the tensor
# cores (x padded to BLOCK_M = 16 rows), else on the CUDA cores (BLOCK_M = M rounded up to a power of two <= 4).
# Scales: one per row (ONE_GROUP) once at the end, else each K step (BLOCK_K <= GROUP_K, inside one group) scales
# its partial sums. With S > 1 K ranges the programs of one column block write fp32 partials [S, M, N]; the last
# of them to finish (an atomic count per column block) sums the S partials in order, adds the bias, writes the
# output and resets its count: one launch, the same sum whatever order the programs ran in.


# M and SPLITS vary within one M bucket's choice: one compiled kernel for all their values (a new specialisation,
# e.g. M = 16 against M = 9, would compile in the middle of serving)
@triton.jit(do_not_specialize=["M", "SPLITS"])
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, k_per_split, stride_xm,
                     stride_wn, stride_sn, stride_om, GROUP_K: tl.constexpr, ONE_GROUP: tl.constexpr,
                     HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, SPLITS, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
                     EVEN_N: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr = False):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    k_lo = pid_s * k_per_split  # a multiple of BLOCK_K
    k_hi = tl.minimum(K, k_lo + k_per_split)
    rm = tl.arange(0, BLOCK_M)  # [BM]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    rk = tl.arange(0, BLOCK_K)  # [BK]
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn  # [BN, 1]
    if PREFETCH and EVEN_K:  # tile of step i + 1 loaded before step i's sums (w_next: zeros past the range)
        step0 = tl.zeros([1, BLOCK_K], dtype=tl.int32) + k_lo  # [1, BK] one value: the mask stays per row
        w_next = tl.load(w_rows + (k_lo + rk)[None, :], mask=n_ok[:, None] & (step0 < k_hi), other=0.0,
                         eviction_policy="evict_first")
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + rk
        w_ptrs = w_rows + k[None, :]  # [BN, BK]
        x_ptrs = x_ptr + rm[:, None] * stride_xm + k[None, :]  # [BM, BK]
        if PREFETCH and EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            w = w_next
            # a whole step or none (EVEN_K): one condition per row keeps the loads 16-byte vectors
            step = tl.zeros([1, BLOCK_K], dtype=tl.int32) + (k0 + BLOCK_K)
            w_next = tl.load(w_ptrs + BLOCK_K, mask=n_ok[:, None] & (step < k_hi), other=0.0,
                             eviction_policy="evict_first")
        elif EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            if EVEN_N:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = k < k_hi
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if USE_DOT:
            if IEEE:
                part = tl.dot(x, tl.trans(w.to(x.dtype)), input_precision="ieee")  # [BM, BN] fp32
            else:
                part = tl.dot(x, tl.trans(w.to(x.dtype)))
        elif BLOCK_M == 1:
            part = tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[None, :]  # [1, BN]
        else:  # row by row: the widened tile [BN, BK] times each x row (reloaded, [BK]), into its acc row
            wf = w.to(tl.float32)
            part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for i in tl.static_range(BLOCK_M):
                row_ok = (rk * 0 + i) < M  # [BK]
                if not EVEN_K:
                    row_ok = row_ok & (k < k_hi)
                xi = tl.load(x_ptr + i * stride_xm + k, mask=row_ok, other=0.0)
                pi = tl.sum(wf * xi.to(tl.float32)[None, :], axis=1)  # [BN]
                part += tl.where(rm[:, None] == i, pi[None, :], 0.0)
        acc = _add_group(acc, part, s_ptr, rn, n_ok, stride_sn, k0, GROUP_K, ONE_GROUP)
    acc = _scale_rows(acc, s_ptr, rn, n_ok, stride_sn, ONE_GROUP)
    out_mask = m_ok[:, None] & n_ok[None, :]
    out_off = rm[:, None] * stride_om + rn[None, :]
    if not SPLIT:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part_off = rm[:, None] * N + rn[None, :]  # partials [S, M, N] contiguous
        tl.store(part_ptr + pid_s * M * N + part_off, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial stored before the count (whose release covers them)
        done = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == SPLITS - 1:  # the last K range of this column block: sum the S partials in order
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s_i in range(SPLITS):
                total += tl.load(part_ptr + s_i * M * N + part_off, mask=out_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + out_off, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(count_ptr + pid_n, 0)  # ready for the next launch (and every CUDA-graph replay)


GEMV_MAX_M = 16  # the largest M the GEMV runs (its tile rows: 16 with tensor cores, <= 4 on the CUDA cores)
FMA_MAX_M = 4
_COUNTS: dict[tuple[str, int | None], torch.Tensor] = {}  # per device: the split-K arrival counts, zeros at rest
_COUNT_SLOTS = 1 << 16  # column blocks of the widest GEMV (N / BLOCK_N), far above any model's


def _counts(device: torch.device) -> torch.Tensor:
    """The device's arrival counts (int32 zeros: each launch leaves them as it found them). Made on first use,
    which must not be inside a CUDA-graph capture (fp8_select measures every GEMV before any capture)."""
    key = (device.type, device.index)
    if key not in _COUNTS:
        _COUNTS[key] = torch.zeros(_COUNT_SLOTS, dtype=torch.int32, device=device)
    return _COUNTS[key]


def gemv_splits(n: int, k: int, block_n: int, block_k: int, waves: int, sms: int) -> int:
    """K ranges of the GEMV: the fewest that divide K into whole BLOCK_K steps (so no K step is masked) and give
    at least `waves` programs per SM, at most one step each; e.g. N 4096, K 4096, BN 32, BK 256 (16 steps),
    4 waves on 132 SMs: 128 column blocks need 5 ranges, 8 is the first divisor of 16 at least 5: 8 ranges."""
    steps = -(-k // block_k)
    want = -(-waves * sms // -(-n // block_n))
    if k % block_k:
        return max(1, min(want, steps))
    return next(d for d in range(1, steps + 1) if steps % d == 0 and d >= min(want, steps))


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_k: int | None,
             bias: torch.Tensor | None = None, *, block_n: int = 32, block_k: int = 256, use_dot: bool = False,
             waves: int = 4, num_warps: int = 4, splits: int | None = None, prefetch: bool = False) -> torch.Tensor:
    """The decode-sized GEMM (M <= GEMV_MAX_M; M <= FMA_MAX_M without `use_dot`): the same contract as `fp8_gemm`.
    block_k must not cross a scale group (block_k <= group_k) unless one scale covers each row. `splits`: K ranges
    (None: `gemv_splits` with `waves`). `prefetch`: each program loads its next weight tile before summing the
    current one (two tiles in flight; streamed with evict_first), where K splits into whole steps."""
    m, k = x.shape
    n = weight.shape[0]
    one_group = group_k is None or group_k >= k
    if m > (GEMV_MAX_M if use_dot else FMA_MAX_M):
        raise ValueError(f"fp8_gemv runs at most {GEMV_MAX_M if use_dot else FMA_MAX_M} rows "
                         f"({'tensor' if use_dot else 'CUDA'} cores), got M={m}")
    if not one_group and (block_k > group_k or group_k % block_k):
        raise ValueError(f"fp8_gemv: block_k={block_k} must divide the scale group {group_k}")
    x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    splits = splits or gemv_splits(n, k, block_n, block_k, waves, _num_sms(x.device))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    n_blocks = triton.cdiv(n, block_n)
    if splits > 1 and n_blocks > _COUNT_SLOTS:
        raise ValueError(f"fp8_gemv: N={n} needs {n_blocks} column blocks, more than {_COUNT_SLOTS}")
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else out
    counts = _counts(x.device) if splits > 1 else out
    block_m = 16 if use_dot else triton.next_power_of_2(m)
    _fp8_gemv_kernel[(n_blocks, splits)](
        x, weight, scale, x if bias is None else bias, out, part, counts, m, n, k, k_per_split, x.stride(0),
        weight.stride(0), scale.stride(0), out.stride(0), GROUP_K=group_k or k, ONE_GROUP=one_group,
        HAS_BIAS=bias is not None, USE_DOT=use_dot, SPLITS=splits, SPLIT=splits > 1, EVEN_K=k % k_per_split == 0,
        EVEN_N=n % block_n == 0, IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PREFETCH=prefetch, num_warps=num_warps)
    return out


# --- dynamic activation quantization ------------------------------------------------------------------------------
FP8_DTYPE = torch.float8_e4m3fn  # spruce's FP8 format (ops/fp8.py re-exports both)
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0


@triton.jit
def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm, stride_sg,
                            GROUP: tl.constexpr, FP8_MAX: tl.constexpr):
    """Program (row, group): the group's amax -> scale = amax / FP8_MAX (>= 1e-12), q = x / scale in e4m3."""
    row = tl.program_id(0)
    g = tl.program_id(1)
    offs = g * GROUP + tl.arange(0, GROUP)
    ok = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FP8_MAX, 1e-12)
    q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * stride_sm + g * stride_sg, scale)


def quantize_activations(x: torch.Tensor, group: int | None = None, rows: int | None = None,
                         scale_major: str = "row") -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 activations in one launch: x [M, K] -> (fp8 [R, K], float32 scales [R, G]); G = 1 (group None:
    per token, the row's amax -> 448) or ceil(K / group) (per token and K group). R = `rows` (>= M; the rows past
    M are zeros with scale 1e-12, for kernels that need R a multiple of 4). scale_major "col" lays the scales out
    column-major (stride (1, R)), as torch's block-scaled matmul reads them. The same values as
    ops/fp8.quantize_per_token for G = 1."""
    m, k = x.shape
    r = rows or m
    width = triton.next_power_of_2(k) if group is None else group
    g = triton.cdiv(k, width)
    q = torch.zeros(r, k, dtype=FP8_DTYPE, device=x.device) if r > m else torch.empty(m, k, dtype=FP8_DTYPE,
                                                                                      device=x.device)
    scale = (torch.full((g, r), 1e-12, dtype=torch.float32, device=x.device).t() if scale_major == "col"
             else torch.full((r, g), 1e-12, dtype=torch.float32, device=x.device))
    if m:
        _quantize_groups_kernel[(m, g)](x, q, scale, k, x.stride(0), q.stride(0), scale.stride(0), scale.stride(1),
                                        GROUP=width, FP8_MAX=FP8_MAX, num_warps=4 if width <= 2048 else 8)
    return q, scale
