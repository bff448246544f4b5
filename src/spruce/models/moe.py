"""Mixture of experts: the router (softmax or sigmoid scores, group-limited top-k, bias correction), the routed
experts' stacked weights, run by the fused MoE op, and shared experts (DeepSeek's plain ones; Qwen2-MoE's one
shared expert behind a sigmoid gate).

Routing follows transformers' DeepseekV2TopkRouter / DeepseekV3TopkRouter step by step in float32:
    V2 (softmax):  scores = softmax(logits); greedy top-k, or ("group_limited_greedy") top-k inside the
                   topk_groups groups with the best single score
    V3 (sigmoid):  scores = sigmoid(logits); choice = scores + e_score_correction_bias; groups ranked by the sum
                   of their two best choices; top-k of choice inside the best topk_groups groups; weights are
                   the unbiased scores of the chosen experts
    Qwen2-MoE / Qwen3-MoE / Mixtral: V2's softmax and greedy top-k
    gpt-oss ("topk_softmax"): top-k of the (biased) logits, weights = softmax over those k logits
    Llama 4 ("topk_sigmoid"): top-k of the logits, weights = their sigmoids (applied to the expert's input)
    then weights /= sum (norm_topk_prob; at top_k 1 only with norm_single), weights *= routed_scaling_factor.
"""

from __future__ import annotations

import torch
from torch import nn

from spruce.distributed.layers import mark_shard
from spruce.models.hf_config import MoEConfig
from spruce.models.layers import GatedMLP
from spruce.ops.moe import fused_moe
from spruce.ops.router import route


def select_experts(logits: torch.Tensor, bias: torch.Tensor | None, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (float32, or the model dtype) -> (weights [T, k] float32, expert ids [T, k] int64),
    scored in float32. On the device an ungrouped router runs as one kernel (ops/router.py); this torch code is its
    reference."""
    t, e = logits.shape
    grouped = cfg.topk_method != "greedy" and cfg.num_groups > 1
    if not grouped:
        topk_scoring = cfg.scoring in ("topk_softmax", "topk_sigmoid")
        norm = not topk_scoring and cfg.norm_topk_prob and (cfg.top_k > 1 or cfg.norm_single)
        fused = route(logits, bias, cfg.scoring, cfg.top_k, norm, 1.0 if topk_scoring else cfg.routed_scaling_factor)
        if fused is not None:
            return fused
    logits = logits.float()
    if cfg.scoring == "topk_softmax":  # gpt-oss: the top-k logits, then a softmax over those k only
        top, ids = logits.topk(cfg.top_k, dim=-1)  # [T, k] each
        return top.softmax(dim=-1), ids
    if cfg.scoring == "topk_sigmoid":  # Llama 4: the top-k logits, each through a sigmoid
        top, ids = logits.topk(cfg.top_k, dim=-1)
        return top.sigmoid(), ids
    if cfg.scoring == "sigmoid":
        scores = logits.sigmoid()
    else:
        scores = logits.softmax(dim=-1)
    choice = scores if bias is None else scores + bias.float()  # [T, E]
    if grouped:
        by_group = choice.view(t, cfg.num_groups, e // cfg.num_groups)  # [T, G, E/G]
        if cfg.topk_method == "noaux_tc":
            group_scores = by_group.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        else:
            group_scores = by_group.max(dim=-1).values
        best_groups = group_scores.topk(cfg.topk_groups, dim=-1, sorted=False)[1]  # [T, topk_groups]
        keep = torch.zeros_like(group_scores).scatter_(1, best_groups, 1.0).bool()  # [T, G]
        keep = keep[:, :, None].expand_as(by_group).reshape(t, e)
        # V3 ranks excluded experts at -inf; V2 zeroes their (non-negative) scores
        choice = choice.masked_fill(~keep, float("-inf") if cfg.topk_method == "noaux_tc" else 0.0)
    ids = choice.topk(cfg.top_k, dim=-1, sorted=False)[1]  # [T, k]
    weights = scores.gather(1, ids)  # [T, k]
    if cfg.norm_topk_prob and (cfg.top_k > 1 or cfg.norm_single):
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return weights, ids


def router_bias_name(name: str) -> str:
    """Checkpoints keep the router bias on the gate (`mlp.gate.e_score_correction_bias`); MoE holds it itself."""
    return name.replace("mlp.gate.e_score_correction_bias", "mlp.e_score_correction_bias")


class RoutedExperts(nn.Module):
    """E gated MLPs stacked: w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I] (down).

    Checkpoints store them per expert (`experts.{i}.gate_proj/up_proj/down_proj.weight`); the loader writes
    each into its rows (`expert_rows`). With a tensor-parallel group `tp`, every rank holds every expert with
    I / tp of its intermediate (gate/up rows, down columns: `intermediate` is then this rank's share), and the
    output is a partial sum the caller all-reduces (DESIGN §18: why not experts split across ranks).

    Biases (gpt-oss), tensor-parallel: b13 holds this rank's gate and up columns (loaded from the rank-major
    layout `gate_up_by_rank` writes); b2 is whole on every rank and added by rank 0 only, so that the
    all-reduced sum holds it once."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp=None, bias: bool = False,
                 swiglu_limit: float | None = None, swiglu_alpha: float = 1.702):
        super().__init__()
        if tp is not None:
            intermediate = tp.shard(intermediate, "moe_intermediate_size")
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.swiglu_limit, self.swiglu_alpha = swiglu_limit, swiglu_alpha
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))  # [E, 2I, H]
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate))  # [E, H, I]
        # gpt-oss: b13 [E, 2I] (gate, then up) and b2 [E, H]
        self.b13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate)) if bias else None
        self.b2 = nn.Parameter(torch.empty(num_experts, hidden)) if bias else None
        self.adds_b2 = tp is None or tp.rank == 0
        if tp is not None:  # rows of each expert's gate / up, columns of its down
            mark_shard(self.w13, 0, tp)
            mark_shard(self.w2, 1, tp)
            if bias:
                mark_shard(self.b13, 1, tp)
        # FP8 banks (models/quantization.py): w13 / w2 float8_e4m3fn, their per-row scales w13_scale [E, 2I, G13]
        # and w2_scale [E, H, G2] (ops/fp8.py's layout)
        self.group_k: int | None = None
        self.w13_scale = self.w2_scale = None

    @property
    def is_fp8(self) -> bool:
        return self.w13_scale is not None

    def make_fp8(self, group_k: int | None) -> None:
        """Replace both banks by empty FP8 ones with unit scales (a checkpoint writes them next)."""
        from spruce.ops.fp8 import FP8_DTYPE, num_groups

        self.group_k = group_k
        for name in ("w13", "w2"):
            bank = getattr(self, name)
            setattr(self, name, nn.Parameter(torch.empty_like(bank, dtype=FP8_DTYPE), requires_grad=False))
            rows = bank.shape[:2]
            setattr(self, f"{name}_scale", nn.Parameter(torch.ones(*rows, num_groups(bank.shape[2], group_k),
                                                                   device=bank.device), requires_grad=False))

    def quantize_fp8(self, group_k: int | None = None) -> None:
        """Quantize the loaded banks to FP8 in place, one scale per row of each expert and K group (None: one
        per row; load-time quantization)."""
        from spruce.ops.fp8 import quantize_rows

        self.group_k = group_k
        for name in ("w13", "w2"):
            q, scale = quantize_rows(getattr(self, name).data, group_k)
            setattr(self, name, nn.Parameter(q, requires_grad=False))
            setattr(self, f"{name}_scale", nn.Parameter(scale, requires_grad=False))


    def expert_rows(self, expert: int, proj: str) -> tuple[str, tuple[int, int]]:
        """(parameter, row range of its [E * rows, cols] flattening) holding expert `expert`'s `proj` weight."""
        i, h = self.intermediate, self.hidden
        if proj == "gate":
            return "w13", (expert * 2 * i, expert * 2 * i + i)
        if proj == "up":
            return "w13", (expert * 2 * i + i, (expert + 1) * 2 * i)
        return "w2", (expert * h, (expert + 1) * h)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], routing weights / ids [T, k] -> [T, H]."""
        b2 = self.b2 if self.adds_b2 else None
        if self.is_fp8:
            from spruce.ops.fp8 import fp8_moe

            return fp8_moe(x, self.w13, self.w13_scale, self.w2, self.w2_scale, self.group_k, ids, weights,
                           self.b13, b2, self.swiglu_limit, self.swiglu_alpha)
        return fused_moe(x, self.w13, self.w2, ids, weights, self.b13, b2, self.swiglu_limit, self.swiglu_alpha)


def gate_up_by_rank(b13: torch.Tensor, ranks: int) -> torch.Tensor:
    """[E, 2I] columns gate then up -> [E, 2I] in `ranks` equal parts, part r = (gate columns of rank r, up
    columns of rank r): cut contiguously, part r is rank r's b13. Example, I = 4, ranks 2:
    g0 g1 g2 g3 u0 u1 u2 u3 -> g0 g1 u0 u1 | g2 g3 u2 u3 (identity at ranks 1)."""
    e, width = b13.shape
    gate, up = b13.view(e, 2, ranks, width // (2 * ranks)).unbind(1)  # [E, ranks, I/ranks] each
    return torch.cat([gate, up], dim=-1).reshape(e, width)


class MoE(nn.Module):
    """Routed experts (top-k per token) plus shared experts (every token), the shared output optionally scaled
    per token by sigmoid(x @ shared_expert_gate.T) (Qwen2-MoE).

    Tensor-parallel (`tp`): the router and the shared gate are replicated (every rank routes every token
    alike), routed and shared experts hold I / tp of their intermediate, and their partial sums are all-reduced
    once (the gate scales each rank's partial shared output alike, so the sum is scaled too)."""

    def __init__(self, hidden: int, cfg: MoEConfig, tp=None):
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        # in float32 where transformers computes the router so (DeepSeek: loaded once, never cast again), else in
        # the model dtype; the scores and the choice are float32 either way (select_experts)
        self.gate = nn.Linear(hidden, cfg.num_experts, bias=cfg.router_bias,
                              dtype=torch.float32 if cfg.router_float32 else None)
        if cfg.scoring == "sigmoid":
            # kept in float32 whatever the model dtype (transformers keeps it so)
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None
        self.experts = RoutedExperts(cfg.num_experts, hidden, cfg.intermediate_size, tp, cfg.expert_bias,
                                     cfg.swiglu_limit, cfg.swiglu_alpha)
        shared = cfg.shared_size
        self.shared_experts = GatedMLP(hidden, shared, tp, reduce=False) if shared else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if cfg.shared_expert_gate and shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, H]."""
        logits = nn.functional.linear(x.to(self.gate.weight.dtype), self.gate.weight, self.gate.bias)  # [T, E]
        weights, ids = select_experts(logits, self.e_score_correction_bias, self.cfg)
        if self.cfg.weight_input:  # Llama 4 (top-1): expert(x * w) instead of w * expert(x)
            out = self.experts(x * weights.to(x.dtype), torch.ones_like(weights), ids)
        else:
            out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)  # [T, H]
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared  # [T, 1] * [T, H]
            out = out + shared
        return out if self.tp is None else self.tp.all_reduce(out)
