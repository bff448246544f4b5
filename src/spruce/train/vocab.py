"""Draft vocabulary: the most frequent target tokens of the training data, as EAGLE-3's d2t / t2d tensors."""

from __future__ import annotations

import torch


def build_draft_vocab(tokens: torch.Tensor, target_vocab: int, size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [Vd] int64, t2d [V] bool) for the training tokens `tokens` (any shape, target ids).

    Draft id i stands for target id i + d2t[i]; draft ids are in increasing target-id order. t2d[t] says
    whether target id t is in the draft vocabulary. size None (or >= the target vocab): the full vocabulary
    (d2t all zeros). Otherwise the `size` most frequent ids (ties, and unseen ids when the data has fewer
    distinct tokens than `size`, go to the lower id)."""
    if size is None or size >= target_vocab:
        return torch.zeros(target_vocab, dtype=torch.int64), torch.ones(target_vocab, dtype=torch.bool)
    if size < 1:
        raise ValueError(f"draft vocabulary size must be >= 1, got {size}")
    counts = torch.bincount(tokens.reshape(-1).to(torch.int64), minlength=target_vocab)[:target_vocab]  # [V]
    ranked = torch.sort(-counts, stable=True).indices[:size]  # most frequent first, ties by id
    keep = torch.sort(ranked).values  # [Vd] target id of each draft id
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[keep] = True
    return keep - torch.arange(size), t2d


def draft_ids(d2t: torch.Tensor) -> torch.Tensor:
    """[Vd] target id of every draft id."""
    return torch.arange(d2t.shape[0], device=d2t.device) + d2t
