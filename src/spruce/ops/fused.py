"""Fused decoder ops: one Triton kernel each on CUDA tensors, the torch reference elsewhere (and everywhere
without Triton installed).

Rounding follows the unfused torch code (and transformers) step by step, so that the two paths agree to
the last bit in float32 and to bf16 rounding in bf16:
  add_rms_norm: s = round(x + r); y = round(w * round(s * rsqrt(mean(s^2) + eps)))
  rotary:       computed in float32 from the float32 cos/sin tables, rounded once
  silu_and_mul: round(round(silu(g)) * u)
"""

from __future__ import annotations

import torch

from spruce.ops.triton_support import HAS_TRITON, tl, triton


def _use_triton(x: torch.Tensor) -> bool:
    """Run the Triton kernel for x: on CUDA tensors (or when tests force it), and only with Triton installed."""
    return HAS_TRITON and (x.is_cuda or _FORCE_TRITON[0])


_FORCE_TRITON = [False]  # tests flip this to run the kernels on CPU tensors through the interpreter


# --- RMSNorm (+ residual add) ------------------------------------------------------------------------------
def rms_norm_reference(x, weight, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, eps, H: tl.constexpr, BLOCK: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * H + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * H + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * H + offs, x, mask=mask)
    h = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / H + eps)
    normed = (h * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _rms_launch(x, residual, weight, eps):
    h = x.shape[-1]
    x2 = x.reshape(-1, h).contiguous()
    out = torch.empty_like(x2)
    res_out = torch.empty_like(x2) if residual is not None else out
    if x2.shape[0]:
        r2 = residual.reshape(-1, h).contiguous() if residual is not None else x2
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, out, res_out, eps, H=h, BLOCK=triton.next_power_of_2(h),
                                         HAS_RESIDUAL=residual is not None)
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., H]."""
    if _use_triton(x) and weight.dtype == x.dtype:
        return _rms_launch(x, None, weight, eps)[0]
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual): the pre-norm residual stream update in one pass."""
    if _use_triton(x) and weight.dtype == x.dtype:
        return _rms_launch(x, residual, weight, eps)
    s = x + residual
    return rms_norm_reference(s, weight, eps), s


# --- rotary -------------------------------------------------------------------------------------------------
def rotary_reference(x, cos, sin, positions):
    c = cos[positions][:, None, :]  # [T, 1, D/2]
    s = sin[positions][:, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


@triton.jit
def _rope_row(cos_ptr, sin_ptr, pos_ptr, t, num_positions, offs_d, HALF: tl.constexpr):
    """cos, sin [1, BLOCK_D] of token t's position; a position past the table reads row 0 and turns NaN."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    in_table = (pos >= 0) & (pos < num_positions)
    row = tl.where(in_table, pos, 0)
    c = tl.load(cos_ptr + row * HALF + offs_d, mask=offs_d < HALF, other=0.0)
    s = tl.load(sin_ptr + row * HALF + offs_d, mask=offs_d < HALF, other=0.0)
    return tl.where(in_table, c, float("nan"))[None, :], tl.where(in_table, s, float("nan"))[None, :]


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, pos_ptr, stride_t, num_positions, NUM_HEADS: tl.constexpr,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HALF)
    c, s = _rope_row(cos_ptr, sin_ptr, pos_ptr, t, num_positions, offs_d, HALF)
    base = x_ptr + t * stride_t + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(base, (x1 * c - x2 * s).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + HALF, (x2 * c + x1 * s).to(x_ptr.dtype.element_ty), mask=mask)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] (rotate-half convention) at positions [T] of the tables cos, sin [P, D/2]; in place on the
    Triton path. Positions lie below P (Limits.rope_positions); one that does not reads nothing: the torch path
    raises IndexError, the kernel fills its token's row with NaN."""
    if not _use_triton(x):
        return rotary_reference(x, cos, sin, positions)
    t, h, d = x.shape
    if t and x.stride(2) == 1 and x.stride(1) == d:
        _rotary_kernel[(t,)](x, cos, sin, positions, x.stride(0), cos.shape[0], NUM_HEADS=h, HALF=d // 2,
                             BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d // 2))
        return x
    return rotary_reference(x, cos, sin, positions)


@triton.jit
def _qk_rotary_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, stride_q, stride_k, num_positions,
                      eps, Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_D: tl.constexpr, NORM: tl.constexpr):
    """Program (token, 0) rotates the token's q heads, (token, 1) its k heads, each head RMSNorm'd first with NORM."""
    t = tl.program_id(0).to(tl.int64)
    which = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    c, s = _rope_row(cos_ptr, sin_ptr, pos_ptr, t, num_positions, offs_d, HALF)
    row_ptr = tl.where(which == 0, q_ptr + t * stride_q, k_ptr + t * stride_k)
    heads = tl.where(which == 0, Q_HEADS, K_HEADS)
    base = row_ptr + offs_h[:, None] * (2 * HALF) + offs_d[None, :]  # [BLOCK_H, BLOCK_D]
    mask = (offs_h[:, None] < heads) & (offs_d[None, :] < HALF)
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_D]
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:  # rms_norm's roundings: y = round(w * round(x * rsqrt(mean(x^2) + eps)))
        inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)  # [BLOCK_H]
        dmask = offs_d < HALF
        w_ptr = tl.where(which == 0, qw_ptr, kw_ptr)  # this program's norm weight [2 * HALF]
        w1 = tl.load(w_ptr + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
        dtype = q_ptr.dtype.element_ty
        x1 = (w1 * (x1 * inv[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * inv[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    tl.store(base, (x1 * c - x2 * s).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(base + HALF, (x2 * c + x1 * s).to(q_ptr.dtype.element_ty), mask=mask)


def qk_rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
               q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
               eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] and k [T, Hkv, D] rotated as `rotary_` does, each head RMSNorm'd over D first where weights are
    given (Qwen3's q/k norm: `rms_norm(q, q_weight, eps)`). On the Triton path one launch for both, in place (q and
    k may be views of one qkv row, e.g. the fused projection's output); elsewhere the separate ops."""
    t, hq, d = q.shape
    norm = q_weight is not None
    fused = (_use_triton(q) and t and k.dtype == q.dtype and d % 2 == 0
             and all(x.stride(2) == 1 and x.stride(1) == d for x in (q, k))
             and (not norm or q_weight.dtype == k_weight.dtype == q.dtype))
    if not fused:
        if norm:
            q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
        return rotary_(q, cos, sin, positions), rotary_(k, cos, sin, positions)
    hk = k.shape[1]
    _qk_rotary_kernel[(t, 2)](q, k, q_weight if norm else q, k_weight if norm else k, cos, sin, positions,
                              q.stride(0), k.stride(0), cos.shape[0], float(eps), Q_HEADS=hq, K_HEADS=hk,
                              HALF=d // 2, BLOCK_H=triton.next_power_of_2(max(hq, hk)),
                              BLOCK_D=triton.next_power_of_2(d // 2), NORM=norm)
    return q, k


# --- SiLU and mul -------------------------------------------------------------------------------------------
def silu_and_mul_reference(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, INTER: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < INTER
    g = tl.load(x_ptr + row * 2 * INTER + col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * INTER + INTER + col, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * INTER + col, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> silu(gate) * up, [T, I]."""
    if not _use_triton(gate_up):
        return silu_and_mul_reference(gate_up)
    t, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(t, inter, dtype=gate_up.dtype, device=gate_up.device)
    if t:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(t, triton.cdiv(inter, block))](gate_up.contiguous(), out, INTER=inter, BLOCK=block)
    return out
