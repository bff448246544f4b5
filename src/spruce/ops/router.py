"""A MoE router's expert choice in one launch: router logits [T, E] -> (weights [T, k] float32, ids [T, k] int64).

The reference is `spruce.models.moe.select_experts` (torch: softmax or sigmoid, the bias-corrected top-k, gather,
renormalise, scale: five to eight launches per layer, which at batch 1 cost more than the math). Here one program
per token row holds the row's E logits in registers (E <= MAX_EXPERTS) and does all of it:

    scores = softmax(x) | sigmoid(x) | x (SCORING "topk_softmax" / "topk_sigmoid": the raw logits)
    choice = scores + bias                                      (the correction bias, where the model has one)
    k rounds: pick the best choice (lowest expert id among equals), mask it out; w_i = scores[pick]
    "topk_softmax": w = softmax(w); "topk_sigmoid": w = sigmoid(w)
    norm: w = w / (sum(w) + 1e-20);  w = w * scale

E.g. Qwen3-30B-A3B (softmax, 128 experts, top 8, norm): the 8 largest softmax scores, divided by their sum.
Group-limited routing (DeepSeek-V2/V3's groups) stays on the reference. The ids come out best first; the fused
MoE kernel does not depend on their order.
"""

from __future__ import annotations

import torch

from spruce.ops.fused import _use_triton
from spruce.ops.triton_support import tl, triton

MAX_EXPERTS = 1024
MAX_TOP_K = 16
SCORINGS = {"softmax": 0, "sigmoid": 1, "topk_softmax": 2, "topk_sigmoid": 3}
_NO_EXPERT = tl.constexpr(2147483647)  # a global a kernel reads must be a constexpr


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, num_experts, stride, scale, K: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, SCORING: tl.constexpr, HAS_BIAS: tl.constexpr,
                  NORM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < num_experts
    x = tl.load(logits_ptr + row * stride + offs, mask=valid, other=float("-inf")).to(tl.float32)  # [BLOCK_E]
    if SCORING == 0:
        p = tl.exp(x - tl.max(x, axis=0))
        scores = p / tl.sum(p, axis=0)
    elif SCORING == 1:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        scores = x
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))
    k_offs = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    for i in tl.static_range(K):
        best = tl.max(choice, axis=0)
        pick = tl.min(tl.where(choice == best, offs, _NO_EXPERT), axis=0)  # the lowest id among equals
        pick = tl.minimum(pick, num_experts - 1)  # a NaN row matches nothing: still an expert the MoE can read
        w = tl.where(k_offs == i, tl.sum(tl.where(offs == pick, scores, 0.0), axis=0), w)
        ids = tl.where(k_offs == i, pick.to(tl.int64), ids)
        choice = tl.where(offs == pick, float("-inf"), choice)
    in_k = k_offs < K
    if SCORING == 2:
        e = tl.where(in_k, tl.exp(w - tl.max(tl.where(in_k, w, float("-inf")), axis=0)), 0.0)
        w = e / tl.sum(e, axis=0)
    elif SCORING == 3:
        w = 1.0 / (1.0 + tl.exp(-w))
    if NORM:
        w = w / (tl.sum(tl.where(in_k, w, 0.0), axis=0) + 1e-20)
    tl.store(w_ptr + row * K + k_offs, w * scale, mask=in_k)
    tl.store(ids_ptr + row * K + k_offs, ids, mask=in_k)


def route(logits: torch.Tensor, bias: torch.Tensor | None, scoring: str, top_k: int, norm: bool,
          scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The fused choice of the module docstring for an ungrouped router's logits [T, E] (any float dtype), or None
    where the reference must run: not on the device, a scoring outside SCORINGS, E > MAX_EXPERTS or k outside
    [1, min(E, MAX_TOP_K)]."""
    t, e = logits.shape
    if (not _use_triton(logits) or scoring not in SCORINGS or e > MAX_EXPERTS or not 1 <= top_k <= min(e, MAX_TOP_K)
            or logits.stride(1) != 1):
        return None
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t:
        _route_kernel[(t,)](logits, bias if bias is not None else logits, weights, ids, e, logits.stride(0),
                            float(scale), K=top_k, BLOCK_E=triton.next_power_of_2(e),
                            BLOCK_K=triton.next_power_of_2(top_k), SCORING=SCORINGS[scoring],
                            HAS_BIAS=bias is not None, NORM=norm)
    return weights, ids
