"""Fused mixture-of-experts MLP (the routed experts of DeepSeek-V2/V3, Qwen2/3-MoE, Mixtral, gpt-oss): two
grouped GEMM launches over tokens sorted by expert.

    out[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = ids[t, j]
    gate_e(x) = x @ w13[e, :I].T,  up_e(x) = x @ w13[e, I:].T,  down_e(y) = y @ w2[e].T
gpt-oss adds biases (gate_e(x) = x @ w13[e, :I].T + b13[e, :I], ... down_e(y) = y @ w2[e].T + b2[e]) and its
clamped SwiGLU in place of silu(gate) * up (`clamped_swiglu`).

Reference (`fused_moe_reference`, the CPU path and the path without Triton): transformers' DeepseekV3Experts
loop, one expert present at a time: gather its tokens, gate/up linear, silu(gate) * up, down linear, times the
routing weight, rounded to x's dtype, index_add into a zero output.

Triton path (CUDA tensors), in three steps; every shape depends on T, k, E and the block size only, and nothing
reads a value back to the host, so the whole op can be captured in a CUDA graph and replayed with any routing:
  1. align (`_align_triton`: one program, for decode-sized M; `_align_chunked`: three launches over chunks of
     the assignments, for verify- and short-prefill-sized M; `_align`: torch ops above): the M = T*k assignments
     (token t, slot j) get the ids a = t*k + j. A stable
     sort by expert puts each expert's assignments together; each expert's segment is then padded up to a
     multiple of BLOCK_M with the sentinel M, so that every block of BLOCK_M entries belongs to one expert.
     At most min(E, M) experts have assignments, so min(E, M)*(BLOCK_M - 1) pad entries suffice: the buffer
     has (M + min(E, M)*(BLOCK_M - 1)) // BLOCK_M blocks (the used entries are a multiple of BLOCK_M that
     fits). Beside it: the expert of each block and the number of used blocks (a device tensor); blocks past
     that number are launched but return at once, and only experts that got tokens have blocks, so at batch 1
     only the k routed experts' weights are read.
  2. gate_up (`_gate_up_kernel`): one program per (block, tile of BLOCK_N intermediate columns) gathers its
     BLOCK_M rows of x by token id (a // k), multiplies them by the expert's gate and up tiles (two fp32
     accumulators over H, + the biases), and writes round(round(silu(round(g))) * round(u)) (or the clamped
     SwiGLU, its glu and u + 1 each rounded) into the row of the intermediate buffer [blocks*BLOCK_M, I] at
     the assignment's sorted position (padding rows are neither written nor read).
  3. down (`_down_kernel`): per (block, tile of BLOCK_N hidden columns), that buffer's rows times w2[e].T
     (+ the down bias), rounded to x's dtype, times the routing weight of the row's assignment, rounded again,
     stored at row a of the per-assignment output [M, H]; a torch sum over the k slots of each token gives
     [T, H].
Matrix products accumulate in fp32: float32 inputs use IEEE fp32 products, bf16/fp16 the tensor cores. Every
rounding of the reference is repeated, so the paths differ only by summation order (float32: ~1e-6 relative;
bf16: ~4e-3 relative in norm, about one bf16 step, mostly because the k slots are summed in fp32 and rounded
once here, where the reference rounds after each of its k index_adds).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from spruce.ops.fused import _use_triton
from spruce.ops.triton_support import tl, triton


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's activation: g = min(gate, limit), u = up clamped to [-limit, limit], (u + 1) * g * sigmoid(alpha g)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                        topk_weights: torch.Tensor, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                        swiglu_limit: float | None = None, swiglu_alpha: float = 1.702) -> torch.Tensor:
    """The expert loop of transformers' DeepseekV3Experts (reads which experts are hit back to the host); with
    biases b13 [E, 2I] / b2 [E, H] and the clamped SwiGLU (swiglu_limit set), GptOssExperts'."""
    out = torch.zeros_like(x)  # [T, H]
    for e in topk_ids.unique().tolist():
        token, slot = torch.where(topk_ids == e)  # [n] each
        gate, up = F.linear(x[token], w13[e], None if b13 is None else b13[e]).chunk(2, dim=-1)  # [n, I] each
        act = F.silu(gate) * up if swiglu_limit is None else clamped_swiglu(gate, up, swiglu_limit, swiglu_alpha)
        h = F.linear(act, w2[e], None if b2 is None else b2[e])  # [n, H]
        out.index_add_(0, token, (h * topk_weights[token, slot, None]).to(x.dtype))
    return out


class _Config(NamedTuple):
    block_m: int  # assignments per block (all of one expert)
    block_n: int  # output columns per program
    block_k: int  # reduction step
    num_warps: int
    num_stages: int


def _config(num_assign: int, num_experts: int) -> _Config:
    """Block sizes by the mean number of assignments per expert (measured on an H100 in bf16 at the
    DeepSeek-V2-Lite and V3 shapes). Under 16 (decode): 16-row blocks, and the weight reads dominate; then
    64 rows; from 64 (prefill), 128 x 128 tiles, which reach 400+ TFLOP/s on long prompts."""
    per_expert = num_assign // num_experts
    if per_expert < 16:
        return _Config(16, 64, 128, num_warps=4, num_stages=4)
    if per_expert < 64:
        return _Config(64, 64, 64, num_warps=4, num_stages=3)
    return _Config(128, 128, 64, num_warps=8, num_stages=3)


# assignments up to which one Triton program aligns; past it the chunked launches are faster on an H200
# (bench/results/moe-*-h200.json: one program / chunked 5.4 / 10.2 us at 64 assignments, 12.0 / 15.3 at 128,
# 11.9 / 10.5 at 256, 33.4 / 17.3 at 512, 54.8 / 10.6 at 1536)
ALIGN_KERNEL_MAX = 128
ALIGN_CHUNK = 64  # assignments per step of that program
ALIGN_CHUNKED_CHUNK = 128  # assignments per program of `_align_chunked`
ALIGN_CHUNKED_TILE = 32768  # its offsets program holds [chunks, expert bins] counts: at most this many


def align_chunked_max_chunks(num_experts: int) -> int:
    """The most chunks `_align_chunked` takes for `num_experts` (a power of two: the offsets program's tile), e.g.
    128 for 8 to 255 experts (16384 assignments), 64 for 256 (DeepSeek-V3: 8192); torch ops align above."""
    return min(128, ALIGN_CHUNKED_TILE // triton.next_power_of_2(num_experts + 1))


def align_chunked_fits(num_assign: int, num_experts: int) -> bool:
    """Whether `_align_chunked` takes `num_assign` assignments over `num_experts` experts."""
    return triton.cdiv(num_assign, ALIGN_CHUNKED_CHUNK) <= align_chunked_max_chunks(num_experts)


@triton.jit
def _store_block_experts(ends, offs_e, block_expert_ptr, num_block_slots, E: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_B: tl.constexpr):
    """block_expert[b] = the expert whose padded segment holds sorted position b * BLOCK_M, from `ends` [BLOCK_E]
    (one past each expert's padded segment); E for blocks past the used ones."""
    for b0 in range(0, num_block_slots, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        first = b * BLOCK_M  # [BLOCK_B] sorted position of each block's first entry
        expert = tl.sum(((ends[None, :] <= first[:, None]) & (offs_e[None, :] < E)).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, expert.to(tl.int64), mask=b < num_block_slots)


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_blocks_ptr, m, num_block_slots,
                  E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCK_B: tl.constexpr):
    """`_align` in one program: histogram, padded exclusive prefix sum, then a stable scatter chunk by chunk
    (rank inside a chunk = earlier equal ids in it); `sorted_ptr` arrives filled with the sentinel m."""
    offs_e = tl.arange(0, BLOCK_E)  # expert bins; bin E collects masked lanes
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, m, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < m, other=E).to(tl.int32)
        counts += tl.sum((ids[:, None] == offs_e[None, :]).to(tl.int32), axis=0)
    counts = tl.where(offs_e < E, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [BLOCK_E]
    ends = tl.cumsum(padded, axis=0)  # one past each expert's padded segment
    base = ends - padded  # [BLOCK_E] first sorted position of each expert
    for start in range(0, m, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        valid = offs < m
        ids = tl.load(ids_ptr + offs, mask=valid, other=E).to(tl.int32)
        onehot = (ids[:, None] == offs_e[None, :]).to(tl.int32)  # [CHUNK, BLOCK_E]
        j = tl.arange(0, CHUNK)
        earlier = tl.sum(((ids[:, None] == ids[None, :]) & (j[None, :] < j[:, None])).to(tl.int32), axis=1)
        pos = tl.sum(onehot * base[None, :], axis=1) + earlier  # [CHUNK]
        tl.store(sorted_ptr + pos, offs.to(tl.int64), mask=valid)
        base += tl.sum(onehot, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(num_blocks_ptr, (total // BLOCK_M).to(tl.int64))
    _store_block_experts(ends, offs_e, block_expert_ptr, num_block_slots, E, BLOCK_M, BLOCK_B)


def align_blocks(num_assign: int, num_experts: int, block_m: int) -> int:
    """Blocks of the aligned buffer: every assignment and at most min(E, M) * (block_m - 1) pad entries (module
    doc, 1)."""
    return (num_assign + min(num_experts, num_assign) * (block_m - 1)) // block_m


def _align_outputs(m: int, num_experts: int, block_m: int, device):
    """The Triton aligns' outputs before they run: sorted_ids [blocks*block_m] filled with the sentinel m,
    block_expert [blocks] and num_blocks [1] (int64)."""
    blocks = align_blocks(m, num_experts, block_m)
    return (torch.full((blocks * block_m,), m, dtype=torch.long, device=device),
            torch.empty(blocks, dtype=torch.long, device=device), torch.empty(1, dtype=torch.long, device=device))


def _align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """`_align` as two launches (a fill and one program): what a decode step pays instead of ~12 torch ops."""
    m = topk_ids.numel()
    sorted_ids, block_expert, num_blocks = _align_outputs(m, num_experts, block_m, topk_ids.device)
    _align_kernel[(1,)](topk_ids.reshape(-1).contiguous(), sorted_ids, block_expert, num_blocks, m,
                        block_expert.shape[0],
                        E=num_experts, BLOCK_E=triton.next_power_of_2(num_experts + 1), BLOCK_M=block_m,
                        CHUNK=ALIGN_CHUNK, BLOCK_B=64, num_warps=4)
    return sorted_ids, block_expert, num_blocks


@triton.jit(do_not_specialize=["m"])
def _align_count_kernel(ids_ptr, counts_ptr, m, E: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """counts[c, e] ([chunks, BLOCK_E] int32) = the assignments of chunk c routed to expert e (bins from E on:
    the chunk's lanes past m)."""
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < m, other=E).to(tl.int32)
    tl.store(counts_ptr + c * BLOCK_E + tl.arange(0, BLOCK_E), tl.histogram(ids, BLOCK_E))


@triton.jit(do_not_specialize=["num_chunks", "num_block_slots"])
def _align_offsets_kernel(counts_ptr, chunk_base_ptr, block_expert_ptr, num_blocks_ptr, num_chunks, num_block_slots,
                          E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, MAX_CHUNKS: tl.constexpr,
                          BLOCK_B: tl.constexpr):
    """One program: each expert's padded segment (as `_align_kernel`), chunk_base[c, e] = the sorted position of
    chunk c's first assignment to expert e (the segment's start + the earlier chunks' assignments to e), the used
    blocks and each block's expert."""
    offs_c = tl.arange(0, MAX_CHUNKS)
    offs_e = tl.arange(0, BLOCK_E)
    tile = offs_c[:, None] * BLOCK_E + offs_e[None, :]
    ok = (offs_c[:, None] < num_chunks) & (offs_e[None, :] < E)
    counts = tl.load(counts_ptr + tile, mask=ok, other=0)  # [MAX_CHUNKS, BLOCK_E]
    total = tl.sum(counts, axis=0)  # [BLOCK_E]
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)  # one past each expert's padded segment
    earlier = tl.cumsum(counts, axis=0) - counts  # [MAX_CHUNKS, BLOCK_E] the earlier chunks' assignments
    tl.store(chunk_base_ptr + tile, (ends - padded)[None, :] + earlier, mask=ok)
    tl.store(num_blocks_ptr, (tl.sum(padded, axis=0) // BLOCK_M).to(tl.int64))
    _store_block_experts(ends, offs_e, block_expert_ptr, num_block_slots, E, BLOCK_M, BLOCK_B)


@triton.jit(do_not_specialize=["m"])
def _align_scatter_kernel(ids_ptr, chunk_base_ptr, sorted_ptr, m, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """sorted[chunk_base[c, e] + rank] = a for chunk c's assignments a (rank: earlier equal ids in the chunk): a
    stable sort by expert."""
    c = tl.program_id(0)
    j = tl.arange(0, CHUNK)
    offs = c * CHUNK + j
    valid = offs < m
    ids = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32)
    rank = tl.sum(((ids[:, None] == ids[None, :]) & (j[None, :] < j[:, None])).to(tl.int32), axis=1)  # [CHUNK]
    base = tl.load(chunk_base_ptr + c * BLOCK_E + ids, mask=valid, other=0)
    tl.store(sorted_ptr + base + rank, offs.to(tl.int64), mask=valid)


def _align_chunked(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """`_align` in three launches over chunks of ALIGN_CHUNKED_CHUNK assignments (and a fill): per-chunk expert
    counts, one program for the segments and each chunk's place in them, a per-chunk stable scatter; for M past
    ALIGN_KERNEL_MAX (a decode of 32 requests x top-8 is 256, a verify of 64 requests x 6 tokens x top-4 1536),
    where one program would walk the chunks in turn, up to `align_chunked_max_chunks` chunks."""
    if not align_chunked_fits(topk_ids.numel(), num_experts):
        raise ValueError(f"_align_chunked: {topk_ids.numel()} assignments over {num_experts} experts need more "
                         f"than {align_chunked_max_chunks(num_experts)} chunks of {ALIGN_CHUNKED_CHUNK}")
    m = topk_ids.numel()
    dev = topk_ids.device
    chunks = triton.cdiv(m, ALIGN_CHUNKED_CHUNK)
    block_e = triton.next_power_of_2(num_experts + 1)
    ids = topk_ids.reshape(-1).contiguous()
    sorted_ids, block_expert, num_blocks = _align_outputs(m, num_experts, block_m, dev)
    counts = torch.empty(chunks, block_e, dtype=torch.int32, device=dev)
    chunk_base = torch.empty(chunks, block_e, dtype=torch.int32, device=dev)
    _align_count_kernel[(chunks,)](ids, counts, m, E=num_experts, BLOCK_E=block_e, CHUNK=ALIGN_CHUNKED_CHUNK)
    _align_offsets_kernel[(1,)](counts, chunk_base, block_expert, num_blocks, chunks, block_expert.shape[0],
                                E=num_experts, BLOCK_E=block_e, BLOCK_M=block_m,
                                MAX_CHUNKS=align_chunked_max_chunks(num_experts), BLOCK_B=64, num_warps=8)
    _align_scatter_kernel[(chunks,)](ids, chunk_base, sorted_ids, m, BLOCK_E=block_e, CHUNK=ALIGN_CHUNKED_CHUNK)
    return sorted_ids, block_expert, num_blocks


def align_path(num_assign: int, num_experts: int) -> str:
    """Which align sorts `num_assign` assignments on the GPU (a key of ALIGNS): one program up to ALIGN_KERNEL_MAX,
    then the chunked launches up to their most chunks, then torch ops."""
    if num_assign <= ALIGN_KERNEL_MAX:
        return "one_program"
    if align_chunked_fits(num_assign, num_experts):
        return "chunked"
    return "torch"


def _align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Sort the assignments by expert, each expert's segment padded to a multiple of block_m (module doc, 1).

    Returns sorted_ids [blocks*block_m] (assignment ids t*k + j, padding = M), block_expert [blocks] (the
    expert of each block; num_experts past the used blocks) and num_blocks [1] (used blocks), all int64.
    Small batches pay in kernel launches, not in work: the steps are few and their shapes static."""
    m = topk_ids.numel()
    dev = topk_ids.device
    blocks = align_blocks(m, num_experts, block_m)
    iota = torch.arange(max(m, num_experts + 1, blocks), device=dev)  # one arange, sliced three ways
    expert, order = topk_ids.reshape(-1).long().sort(stable=True)  # [M] each: experts ascending, assignment ids
    first = torch.searchsorted(expert, iota[:num_experts + 1])  # [E+1] sorted position of each expert's first
    expert_blocks = (first[1:] - first[:-1] + block_m - 1) // block_m  # [E] blocks of each expert
    block_end = expert_blocks.cumsum(0)  # [E] one past each expert's last block
    shift = (block_end - expert_blocks) * block_m - first[:-1]  # [E] padding entries before each expert
    sorted_ids = torch.full((blocks * block_m,), m, dtype=torch.long, device=dev)
    sorted_ids.scatter_(0, iota[:m] + shift[expert], order)
    block_expert = torch.searchsorted(block_end, iota[:blocks], right=True)  # [blocks]
    return sorted_ids, block_expert, block_end[-1:]


ALIGNS = {"one_program": _align_triton, "chunked": _align_chunked, "torch": _align}  # align_path's choices


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b: exact fp32 products for float32 inputs, tensor cores (tf32, bf16, fp16) otherwise."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _mma_w(a, w, s_ptrs, k0, acc, IEEE: tl.constexpr, FP8: tl.constexpr, GROUP_K: tl.constexpr, mask_n):
    """acc + a @ w; an FP8 tile `w` is widened to a's dtype and its product scaled per column by the scale of
    its K group (`s_ptrs` [BLOCK_N]: the rows' scale rows; BLOCK_K divides GROUP_K, ops/fp8.py's layout)."""
    if FP8:  # if/else, not an early return: Triton compiles a statement after a constexpr-true `return` too
        s = tl.load(s_ptrs + k0 // GROUP_K, mask=mask_n, other=0.0)  # [BLOCK_N]
        out = acc + _mma(a, w.to(a.dtype), tl.zeros(acc.shape, dtype=tl.float32), IEEE) * s[None, :]
    else:
        out = _mma(a, w, acc, IEEE)
    return out


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, num_blocks_ptr, num_assign,
                    stride_we, stride_wn, stride_wk, bias_ptr, swiglu_limit, swiglu_alpha, s_ptr, stride_se,
                    stride_sn, TOP_K: tl.constexpr,
                    H: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, IEEE: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr,
                    FP8: tl.constexpr = False, GROUP_K: tl.constexpr = 1):
    pid = tl.program_id(0)
    block = pid // tl.cdiv(INTER, BLOCK_N)
    if block >= tl.load(num_blocks_ptr):
        return
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    offs_m = block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # positions in the sorted buffer
    ids = tl.load(sorted_ids_ptr + offs_m)  # assignment ids, num_assign = padding
    valid = ids < num_assign
    tokens = (ids // TOP_K).to(tl.int64)
    offs_n = (pid % tl.cdiv(INTER, BLOCK_N)) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * H + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BK, BN]
    u_ptrs = g_ptrs + INTER * stride_wn
    sg_ptrs = s_ptr + expert * stride_se + offs_n * stride_sn  # FP8: the gate rows' scales, then the up rows'
    su_ptrs = sg_ptrs + INTER * stride_sn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        mask_k = offs_k < H - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
        w_mask = mask_k[:, None] & mask_n[None, :]
        acc_g = _mma_w(a, tl.load(g_ptrs, mask=w_mask, other=0.0), sg_ptrs, k0, acc_g, IEEE, FP8, GROUP_K, mask_n)
        acc_u = _mma_w(a, tl.load(u_ptrs, mask=w_mask, other=0.0), su_ptrs, k0, acc_u, IEEE, FP8, GROUP_K, mask_n)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    dt = out_ptr.dtype.element_ty
    if HAS_BIAS:  # rounded like F.linear's output: (x @ w.T + b) in x's dtype
        b_ptrs = bias_ptr + expert * (2 * INTER) + offs_n
        acc_g += tl.load(b_ptrs, mask=mask_n, other=0.0).to(tl.float32)
        acc_u += tl.load(b_ptrs + INTER, mask=mask_n, other=0.0).to(tl.float32)
    g = acc_g.to(dt).to(tl.float32)
    u = acc_u.to(dt).to(tl.float32)
    if CLAMPED:  # gpt-oss: (clamp(u, -L, L) + 1) * g * sigmoid(alpha g), g = min(gate, L)
        g = tl.minimum(g, swiglu_limit)
        u = tl.minimum(tl.maximum(u, -swiglu_limit), swiglu_limit)
        glu = (g * (1.0 / (1.0 + tl.exp(-g * swiglu_alpha)))).to(dt).to(tl.float32)
        y = ((u + 1.0).to(dt).to(tl.float32) * glu).to(dt)
    else:
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        y = (s * u).to(dt)
    tl.store(out_ptr + offs_m[:, None] * INTER + offs_n[None, :], y, mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, out_ptr, topk_w_ptr, sorted_ids_ptr, block_expert_ptr, num_blocks_ptr, num_assign,
                 stride_we, stride_wn, stride_wk, bias_ptr, s_ptr, stride_se, stride_sn, H: tl.constexpr,
                 INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 IEEE: tl.constexpr, HAS_BIAS: tl.constexpr, FP8: tl.constexpr = False, GROUP_K: tl.constexpr = 1):
    pid = tl.program_id(0)
    block = pid // tl.cdiv(H, BLOCK_N)
    if block >= tl.load(num_blocks_ptr):
        return
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    offs_m = block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + offs_m)
    valid = ids < num_assign
    offs_n = (pid % tl.cdiv(H, BLOCK_N)) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + offs_m[:, None] * INTER + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BK, BN]
    s_ptrs = s_ptr + expert * stride_se + offs_n * stride_sn  # FP8: the rows' scales
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        mask_k = offs_k < INTER - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = _mma_w(a, w, s_ptrs, k0, acc, IEEE, FP8, GROUP_K, mask_n)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    dt = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * H + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    weight = tl.load(topk_w_ptr + ids, mask=valid, other=0.0).to(tl.float32)  # [BLOCK_M]
    y = acc.to(dt).to(tl.float32) * weight[:, None]
    tl.store(out_ptr + ids.to(tl.int64)[:, None] * H + offs_n[None, :], y.to(dt), mask=valid[:, None] & mask_n[None, :])


def _fused_moe_triton(x, w13, w2, topk_ids, topk_weights, cfg: _Config, b13=None, b2=None,
                      swiglu_limit: float | None = None, swiglu_alpha: float = 1.702, scales=None) -> torch.Tensor:
    """`scales` (FP8 banks): (w13_scale [E, 2I, G13], w2_scale [E, H, G2], group_k or None), ops/fp8.py's layout."""
    t, h = x.shape
    k = topk_ids.shape[1]
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    m = t * k
    if m == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    sorted_ids, block_expert, num_blocks = ALIGNS[align_path(m, num_experts)](topk_ids, num_experts, cfg.block_m)
    blocks = block_expert.shape[0]
    ieee = x.dtype == torch.float32
    launch = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, IEEE=ieee,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    act = torch.empty(blocks * cfg.block_m, inter, dtype=x.dtype, device=x.device)  # [blocks*BLOCK_M, I]
    clamped = swiglu_limit is not None
    s13, s2, group_k = scales if scales is not None else (x, x, None)
    fp8 = scales is not None
    _gate_up_kernel[(blocks * triton.cdiv(inter, cfg.block_n),)](
        x, w13, act, sorted_ids, block_expert, num_blocks, m, w13.stride(0), w13.stride(1), w13.stride(2),
        w13 if b13 is None else b13.contiguous(), float(swiglu_limit) if clamped else 0.0, float(swiglu_alpha),
        s13, s13.stride(0) if fp8 else 0, s13.stride(1) if fp8 else 0,
        TOP_K=k, H=h, INTER=inter, HAS_BIAS=b13 is not None, CLAMPED=clamped, FP8=fp8, GROUP_K=group_k or h,
        **launch)
    out = torch.empty(m, h, dtype=x.dtype, device=x.device)  # [M, H] weighted output of each assignment
    _down_kernel[(blocks * triton.cdiv(h, cfg.block_n),)](
        act, w2, out, topk_weights.contiguous(), sorted_ids, block_expert, num_blocks, m, w2.stride(0),
        w2.stride(1), w2.stride(2), w2 if b2 is None else b2.contiguous(), s2, s2.stride(0) if fp8 else 0,
        s2.stride(1) if fp8 else 0, H=h, INTER=inter, HAS_BIAS=b2 is not None, FP8=fp8, GROUP_K=group_k or inter,
        **launch)
    return out.view(t, k, h).sum(dim=1)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
              swiglu_limit: float | None = None, swiglu_alpha: float = 1.702) -> torch.Tensor:
    """Routed experts: x [T, H], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], topk_ids [T, k]
    (int32/int64), topk_weights [T, k] float32 -> [T, H] in x's dtype.

    Optional (gpt-oss): biases b13 [E, 2I] / b2 [E, H] and the clamped SwiGLU (`clamped_swiglu`, when
    swiglu_limit is set), in both paths."""
    same = all(t is None or t.dtype == x.dtype for t in (w13, w2, b13, b2))
    if _use_triton(x) and same:
        return _fused_moe_triton(x, w13, w2, topk_ids, topk_weights, _config(topk_ids.numel(), w13.shape[0]),
                                 b13, b2, swiglu_limit, swiglu_alpha)
    return fused_moe_reference(x, w13, w2, topk_ids, topk_weights, b13, b2, swiglu_limit, swiglu_alpha)
