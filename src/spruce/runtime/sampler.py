"""Token selection: greedy or temperature / top-k / top-p sampling, batched, with no host syncs.

The same function serves plain decode (one row per request) and tree verification (one row per tree node):
each row carries its own sampling parameters and its own (seed, position, node) random key.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spruce.runtime.rng import uniform


@dataclass
class SamplingTensors:
    """Per-row sampling parameters on the device. Rows with temperature 0 are greedy."""

    temperature: torch.Tensor  # [n] float32
    top_p: torch.Tensor  # [n] float32
    top_k: torch.Tensor  # [n] int64 (vocab size when unlimited)
    seeds: torch.Tensor  # [n] int64
    all_greedy: bool  # host-side: skip the sampling path entirely

    @staticmethod
    def greedy() -> "SamplingTensors":
        """For a batch of greedy requests only: no per-row tensors are made (select_tokens takes the argmax)."""
        empty = torch.zeros(0)
        return SamplingTensors(empty, empty, empty.long(), empty.long(), all_greedy=True)

    @staticmethod
    def build(params: list, seeds: list[int], vocab_size: int, device, repeat: int = 1) -> "SamplingTensors":
        """From per-request SamplingParams; `repeat` duplicates each request's row (tree nodes)."""

        def t(values, dtype):
            return torch.tensor(values, dtype=dtype).repeat_interleave(repeat).to(device, non_blocking=True)

        return SamplingTensors(
            temperature=t([p.temperature for p in params], torch.float32),
            top_p=t([p.top_p for p in params], torch.float32),
            top_k=t([p.top_k if p.top_k > 0 else vocab_size for p in params], torch.int64),
            seeds=t(seeds, torch.int64),
            all_greedy=all(p.temperature == 0.0 for p in params),
        )


def target_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The distribution sampling draws from: softmax(logits / T) cut to top-k and top-p, renormalised.

    logits [n, V] -> probs [n, V] float32. Greedy rows get a one-hot on the argmax.
    """
    logits = logits.float()
    greedy = st.temperature == 0
    temp = torch.where(greedy, torch.ones_like(st.temperature), st.temperature)
    scaled = logits / temp[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [n, V]
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(rank >= st.top_k[:, None], float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # probability of strictly better tokens
    sorted_probs = sorted_probs.masked_fill((mass_before >= st.top_p[:, None]) & (rank > 0), 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    probs = torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: the first token whose cumulative probability exceeds u. [n, V], [n] -> [n]."""
    cdf = probs.cumsum(dim=-1)
    idx = (cdf <= (u * cdf[:, -1])[:, None]).sum(dim=-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def select_tokens(logits: torch.Tensor, st: SamplingTensors, positions: torch.Tensor) -> torch.Tensor:
    """One token per row. positions [n]: position of the token being chosen (the random key with the seed).

    Greedy rows take the argmax; others sample target_probs with uniform(seed, position): the
    same uniform whichever tree node (or plain decode step) chooses the token at that position.
    """
    greedy_tokens = logits.argmax(dim=-1)
    if st.all_greedy:
        return greedy_tokens
    u = uniform(st.seeds, positions)
    sampled = sample_from_probs(target_probs(logits, st), u)
    return torch.where(st.temperature == 0, greedy_tokens, sampled)
