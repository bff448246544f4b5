"""Draft vocabulary: the most frequent target tokens of the data, as EAGLE-3's d2t / t2d tensors."""

from __future__ import annotations

from collections import Counter

import torch


def build_draft_vocab(chunks: list[list[int]], target_vocab: int, size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [Vd] int64 offsets with target id = draft id + d2t[draft id], t2d [V] bool membership).

    size None (or >= the target vocab): the full vocabulary, d2t all zeros. Otherwise the `size` most frequent
    tokens of the data (ties: lower id), topped up with the lowest unused ids if the data has fewer.
    """
    if size is None or size >= target_vocab:
        return torch.zeros(target_vocab, dtype=torch.int64), torch.ones(target_vocab, dtype=torch.bool)
    counts = Counter(t for c in chunks for t in c)
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    chosen = set(ranked)
    for t in range(target_vocab):
        if len(chosen) >= size:
            break
        chosen.add(t)
    keep = torch.tensor(sorted(chosen), dtype=torch.int64)  # draft id i <-> target id keep[i]
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[keep] = True
    return keep - torch.arange(size), t2d
