"""FP8 (e4m3) weights: quantization, dequantization, and the one place an FP8 linear (and the FP8 experts) runs.

spruce's in-memory layout, whatever the checkpoint's:
    weight  [N, K] float8_e4m3fn
    scale   [N, G] float32, G = ceil(K / group_k): w[n, k] = weight[n, k] * scale[n, k // group_k]
group_k None (G == 1) is per-channel (per-tensor: every row holds the tensor's scale); group_k == 128 holds a
128x128 block checkpoint (DeepSeek-V3, Qwen3-FP8), each block's scale on each of its 128 rows, so that fused
parameters (q/k/v, gate/up, experts) take any row split; e.g. a [300, 200] q_proj with scale_inv [3, 2] becomes
scale [300, 2], rows 0..127 holding scale_inv[0], rows 256..299 scale_inv[2].

Which kernel runs `fp8_linear` (x [T, K] in the compute dtype):
    CUDA, T <= 16, the linear's kernels measured at load (ops/fp8_select.py): the fastest correct candidate of
        T's bucket (split-K GEMV, tiled GEMM, torch's row-wise or block-scaled matmul)
    CUDA, bf16, G == 1, at least SCALED_MM_MIN_TOKENS tokens, torch._scaled_mm on an SM 8.9+ GPU, N and K
        multiples of 16: x quantized per token (dynamic scale amax / 448), or with the checkpoint's static
        `input_scale`; the scaled matmul's fp32 accumulate, output in x's dtype
    CUDA otherwise (block scales, decode-sized batches): the Triton group-scaled GEMM (ops/fp8_gemm.py),
        weight-only: x is not quantized
    CPU, or no kernel: emulation, the weight dequantized to float32 and multiplied in float32 (x quantized first
        when a static input scale is set, as the kernels do)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spruce.ops.triton_support import HAS_TRITON

from spruce.ops.fp8_gemm import FP8_DTYPE, FP8_MAX  # float8_e4m3fn; 448.0, its largest finite value
BLOCK = 128  # block-scaled checkpoints: 128 x 128 weight blocks
_FORCE_TRITON = [False]  # tests flip this to run the Triton GEMM on CPU tensors through the interpreter
# batches below this many tokens run the Triton GEMM even where the scaled matmul fits: one launch, no per-token
# activation quantization (a decode step's linears are bound by their weight reads either way)
SCALED_MM_MIN_TOKENS = 16


def num_groups(k: int, group_k: int | None) -> int:
    """G: scale columns of a [N, K] weight with `group_k`-wide K groups (1 for None: per-channel)."""
    return 1 if group_k is None else -(-k // group_k)


def expand_groups(scale: torch.Tensor, group_k: int | None, k: int) -> torch.Tensor:
    """scale [..., N, G] -> [..., N, K] (or [..., N, 1] per-channel): each group's scale on its columns."""
    return scale if group_k is None else scale.repeat_interleave(group_k, dim=-1)[..., :k]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, group_k: int | None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight [..., N, K] fp8, scale [..., N, G] -> [..., N, K] in `dtype` (products in float32)."""
    return (weight.float() * expand_groups(scale.float(), group_k, weight.shape[-1])).to(dtype)


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """Saturating cast: values beyond +-448 become +-448 (whatever the cast does with overflow)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_rows(w: torch.Tensor, group_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (fp8 [..., N, K], scale [..., N, G]): each (row, K group) scaled so its amax is 448
    (group_k None: per-channel, one scale per row)."""
    k = w.shape[-1]
    g = num_groups(k, group_k)
    group_k = k if group_k is None else group_k
    pad = g * group_k - k
    wf = F.pad(w.float(), (0, pad)).unflatten(-1, (g, group_k))  # [..., N, G, group_k]
    scale = (wf.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)  # [..., N, G]
    q = to_fp8(wf / scale[..., None]).flatten(-2)[..., :k]
    return q.contiguous(), scale


def quantize_blocks(w: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)) -> tuple[torch.Tensor, torch.Tensor]:
    """The checkpoint layout of block-scaled FP8: w [N, K] -> (fp8 [N, K], scale_inv [ceil(N/bn), ceil(K/bk)]),
    w ~= fp8 * scale_inv of its block (a block's amax maps to 448)."""
    bn, bk = block
    n, k = w.shape
    gn, gk = num_groups(n, bn), num_groups(k, bk)
    wf = F.pad(w.float(), (0, gk * bk - k, 0, gn * bn - n)).view(gn, bn, gk, bk)
    scale = (wf.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # [gn, gk]
    q = to_fp8(wf / scale[:, None, :, None]).view(gn * bn, gk * bk)[:n, :k]
    return q.contiguous(), scale


def block_scale_rows(scale_inv: torch.Tensor, rows: int, block_n: int = BLOCK) -> torch.Tensor:
    """A checkpoint's block scales [ceil(rows/bn), G] -> spruce's per-row [rows, G] (block b on rows b*bn..)."""
    return scale_inv.float().repeat_interleave(block_n, dim=0)[:rows]


def fake_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x rounded through fp8 with a static per-tensor scale: to_fp8(x / s) * s, in x's dtype."""
    s = scale.float()
    return (to_fp8(x.float() / s).float() * s).to(x.dtype)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation scales: x [T, K] -> (fp8 [T, K], scale [T, 1] float32), each row's amax -> 448."""
    scale = (x.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return to_fp8(x.float() / scale), scale


def scaled_mm_fits(x: torch.Tensor, weight: torch.Tensor, group_k: int | None) -> bool:
    """Whether torch's row-wise scaled matmul runs this linear: CUDA, bf16 activations, per-channel scales, SM 8.9+,
    and N, K multiples of 16."""
    if not x.is_cuda or x.dtype != torch.bfloat16 or group_k is not None or not hasattr(torch, "_scaled_mm"):
        return False
    n, k = weight.shape
    return torch.cuda.get_device_capability(x.device) >= (8, 9) and n % 16 == 0 and k % 16 == 0


def _scaled_mm_linear(x, weight, scale, bias, input_scale):
    """x [T, K] -> [T, N] through torch._scaled_mm: per-token (or static per-tensor) x scales, per-row w scales."""
    if input_scale is None and HAS_TRITON:
        from spruce.ops.fp8_gemm import quantize_activations

        xq, x_scale = quantize_activations(x)  # one launch, the values of quantize_per_token
    elif input_scale is None:
        xq, x_scale = quantize_per_token(x)
    else:
        x_scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
        xq = to_fp8(x.float() / x_scale)
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.float().reshape(1, -1),
                           out_dtype=x.dtype)
    return out if bias is None else out + bias


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_k: int | None,
               bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None,
               kernels: dict | None = None, block_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize(weight, scale, group_k).T (+ bias) -> [..., N] in x's dtype (module doc: kernels).

    `input_scale` (a static per-tensor activation scale from the checkpoint) quantizes x through fp8 first.
    `kernels`: M bucket -> the measured choice (ops/fp8_select.py) for CUDA batches of at most 16 tokens;
    `block_scale`: the weight's scales in the block-scaled matmul's layout, when a choice needs them."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    m = x2.shape[0]
    if kernels and x2.is_cuda and 0 < m <= GEMV_BUCKETS[-1] and (choice := kernels.get(gemv_bucket(m))) is not None:
        if input_scale is not None:
            x2 = fake_quantize(x2, input_scale)
        out = choice.run(x2, weight, scale, group_k, bias, block_scale)
    elif m >= SCALED_MM_MIN_TOKENS and scaled_mm_fits(x2, weight, group_k):
        out = _scaled_mm_linear(x2, weight, scale, bias, input_scale)
    else:
        if input_scale is not None:
            x2 = fake_quantize(x2, input_scale)
        if HAS_TRITON and (x2.is_cuda or _FORCE_TRITON[0]):
            from spruce.ops.fp8_gemm import fp8_gemm

            out = fp8_gemm(x2, weight, scale, group_k, bias)
        else:
            out = emulated_linear(x2, weight, scale, group_k, bias)
    return out.reshape(*shape[:-1], weight.shape[0])


GEMV_BUCKETS = (1, 2, 4, 8, 16)  # batch sizes (tokens) whose kernels are measured; a batch runs its bucket's


def gemv_bucket(m: int) -> int:
    """The bucket of a batch of 0 < m <= 16 tokens: the smallest power of two >= m (3 -> 4)."""
    return 1 << (m - 1).bit_length()


def emulated_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_k: int | None,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: float32 x @ float32 dequantized weight (+ bias), cast to x's dtype."""
    out = F.linear(x.float(), dequantize(weight, scale, group_k), None if bias is None else bias.float())
    return out.to(x.dtype)


def fp8_moe(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
            w2_scale: torch.Tensor, group_k: int | None, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            b13=None, b2=None, swiglu_limit: float | None = None, swiglu_alpha: float = 1.702) -> torch.Tensor:
    """Routed experts with FP8 banks (w13 [E, 2I, H], w2 [E, H, I], scales [E, rows, G]) -> [T, H] in x's dtype.

    CUDA (Triton): the fused MoE kernels read the FP8 tiles and scale each K group's products (ops/moe.py).
    Otherwise (CPU), few assignments (T*k <= E: decode): only the chosen experts are dequantized, one copy per
    assignment, each assignment a batched matmul in float32 (no host synchronisation); more: every expert is
    dequantized to x's dtype once and the fused MoE runs (weight-only like the dense path: x is not quantized)."""
    from spruce.ops.moe import _config, _fused_moe_triton, clamped_swiglu, fused_moe

    t, k = topk_ids.shape
    if HAS_TRITON and (x.is_cuda or _FORCE_TRITON[0]):
        cfg = _config(topk_ids.numel(), w13.shape[0])
        if group_k is not None:  # a K step inside one scale group
            cfg = cfg._replace(block_k=min(cfg.block_k, group_k))
        return _fused_moe_triton(x, w13, w2, topk_ids, topk_weights, cfg, b13, b2, swiglu_limit, swiglu_alpha,
                                 scales=(w13_scale, w2_scale, group_k))
    if t * k > w13.shape[0]:
        return fused_moe(x, dequantize(w13, w13_scale, group_k, x.dtype), dequantize(w2, w2_scale, group_k, x.dtype),
                         topk_ids, topk_weights, b13, b2, swiglu_limit, swiglu_alpha)
    ids = topk_ids.reshape(-1).long()  # [A] assignment a = t*k + j
    xa = x.float().repeat_interleave(k, dim=0)  # [A, H]
    g13 = dequantize(w13[ids], w13_scale[ids], group_k)  # [A, 2I, H]
    h = torch.bmm(g13, xa[:, :, None])[:, :, 0]  # [A, 2I]
    if b13 is not None:
        h = h + b13[ids].float()
    gate, up = h.chunk(2, dim=-1)
    act = F.silu(gate) * up if swiglu_limit is None else clamped_swiglu(gate, up, swiglu_limit, swiglu_alpha)
    out = torch.bmm(dequantize(w2[ids], w2_scale[ids], group_k), act[:, :, None])[:, :, 0]  # [A, H]
    if b2 is not None:
        out = out + b2[ids].float()
    out = out * topk_weights.reshape(-1, 1).float()
    return out.view(t, k, -1).sum(dim=1).to(x.dtype)


# --- FP8 KV cache -----------------------------------------------------------------------------------------
# A cache in float8_e4m3fn holds k / k_scale and v / v_scale (torch's cast saturates at +-448), so the attention
# kernels only widen what they read: scores q . k = (q * k_scale) . (k / k_scale), and the output
# sum_j p_j v_j = v_scale * sum_j p_j (v_j / v_scale). The layer scales q before and the output after the backend
# runs (`fp8_cache_inputs` / `fp8_cache_output`); with the default scales of 1.0 both are the identity and only the
# cast remains.


def fp8_cache_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, k_scale: float, v_scale: float):
    """(q * k_scale, k / k_scale, v / v_scale) in their dtypes, the backend then casting k and v as it stores them
    (v None: MLA's latent, whose value is part of its key and shares k_scale)."""
    if k_scale != 1.0:
        q, k = q * k_scale, k / k_scale
    if v is not None and v_scale != 1.0:
        v = v / v_scale
    return q, k, v


def fp8_cache_output(out: torch.Tensor, v_scale: float) -> torch.Tensor:
    """The attention output over an FP8 cache, rescaled by the values' scale."""
    return out if v_scale == 1.0 else out * v_scale
