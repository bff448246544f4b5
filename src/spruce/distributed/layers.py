"""Tensor-parallel layers (Megatron's split): each rank holds a slice of a weight and the ranks combine
their partial results with one collective where the split needs it.

    column-parallel  y_r = x W_r^T, W_r = rows r of W ([out/tp, in]): each rank computes its own output columns
                     (its attention heads, its slice of the MLP's intermediate); no collective
    row-parallel     y = sum_r x_r W_r^T, W_r = columns r of W ([out, in/tp]): reads the column-parallel
                     layer's local output and all-reduces the partial sums (one all-reduce per block)
    vocab-parallel   embedding rows [V/tp, H] per rank: ids outside the rank's rows give zeros, all-reduced;
                     the lm head computes its V/tp logits and the ranks' logits are all-gathered for sampling

A sharded parameter carries `tp_shard = (dim, rank, size)`: dimension `dim` of its checkpoint tensor (of the
[rows, cols] view the loader writes) is cut into `size` equal parts and this rank holds part `rank`
(models/weights.py reads only that part from the safetensors file). Parameters without it are replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spruce.distributed.group import TPGroup
from spruce.errors import ConfigError


def mark_shard(param: torch.Tensor, dim: int, tp: TPGroup) -> torch.Tensor:
    """Record that `param` holds part tp.rank of tp.size along checkpoint dimension `dim`."""
    param.tp_shard = (dim, tp.rank, tp.size)
    return param


def column_parallel_linear(in_features: int, out_features: int, tp: TPGroup | None, what: str,
                           bias: bool = False) -> nn.Linear:
    """nn.Linear holding this rank's out_features / tp output rows (the whole layer when tp is None)."""
    if tp is None:
        return nn.Linear(in_features, out_features, bias=bias)
    layer = nn.Linear(in_features, tp.shard(out_features, what), bias=bias)
    mark_shard(layer.weight, 0, tp)
    if bias:
        mark_shard(layer.bias, 0, tp)
    return layer


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W_r^T) + bias: x_local [T, in/tp] (a column-parallel layer's output) -> [T, out].

    `reduce=False` leaves the partial sum (a caller adding several partials reduces them once)."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, what: str, bias: bool = False,
                 reduce: bool = True):
        super().__init__()
        self.tp = tp
        self.reduce = reduce
        self.in_features, self.out_features = in_features, out_features
        self.weight = mark_shard(nn.Parameter(torch.empty(out_features, tp.shard(in_features, what))), 1, tp)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None  # replicated: added once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)  # [T, out] partial sum
        if self.reduce:
            self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


def row_parallel_linear(in_features: int, out_features: int, tp: TPGroup | None, what: str,
                        bias: bool = False, reduce: bool = True) -> nn.Module:
    """RowParallelLinear, or a plain nn.Linear when tp is None."""
    if tp is None:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, tp, what, bias=bias, reduce=reduce)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows [V/tp, H] of this rank's vocabulary range; forward(ids [n]) -> [n, H] on every rank."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        rows = tp.shard(num_embeddings, "vocab_size")
        self.start, self.stop = tp.rank * rows, (tp.rank + 1) * rows
        self.weight = mark_shard(nn.Parameter(torch.empty(rows, embedding_dim)), 0, tp)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.stop)  # [n]
        local = torch.where(outside, 0, ids - self.start)
        x = F.embedding(local, self.weight).masked_fill(outside[:, None], 0.0)  # [n, H], zeros off this rank
        return self.tp.all_reduce(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The embedding used as an lm head: hidden [n, H] -> [n, V] float32 (tied weights)."""
        return vocab_parallel_logits(hidden, self.weight, self.tp)


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """hidden [n, H] and this rank's head rows [V/tp, H] -> every rank's logits [n, V] float32."""
    return tp.all_gather_last(F.linear(hidden, weight)).float()


def check_divisible(cfg, tp_size: int) -> None:
    """Refuse, before any process starts, a tp_size that does not divide every dimension the ranks split
    (`cfg` a ModelConfig): heads (and KV heads, unless MLA), the MLP, expert and shared-expert intermediates, the
    vocabulary."""
    dims = {"num_attention_heads": cfg.num_heads, "intermediate_size": cfg.intermediate_size,
            "vocab_size": cfg.vocab_size}
    if cfg.mla is None:
        dims["num_key_value_heads"] = cfg.num_kv_heads
    if cfg.moe is not None:
        dims["moe_intermediate_size"] = cfg.moe.intermediate_size
        if cfg.moe.shared_intermediate_size:  # Qwen2-MoE's shared expert
            dims["shared_expert_intermediate_size"] = cfg.moe.shared_intermediate_size
    bad = [f"{name}={value}" for name, value in dims.items() if value % tp_size]
    if bad:
        raise ConfigError(f"tp_size={tp_size} does not divide {', '.join(bad)}; choose a tp_size that divides "
                          f"every split dimension ({', '.join(f'{k}={v}' for k, v in dims.items())})")
