"""Token selection: greedy or temperature / min-p / top-k / top-p sampling, batched, with no host syncs.

The same function serves plain decode (one row per request) and tree verification (one row per tree node):
each row carries its own sampling parameters, logit processors and (seed, position) random key. The logit
processors (logit_bias; min_tokens, which masks stop tokens before a position) see only the row's parameters
and the position being chosen, so a tree node is processed exactly as plain decoding processes that position.
Penalties also count the tokens generated before that position, and bad words match its last ones: the caller
passes a `TokenHistory` (runtime/penalties.py: the request's committed output, plus a tree node's own path).
Token restrictions (allowed_token_ids, bad_words: runtime/token_restrictions.py) come first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spruce.errors import InvariantError
from spruce.runtime.penalties import PenaltyParams, TokenHistory, apply_penalties
from spruce.runtime.rng import uniform
from spruce.runtime.token_restrictions import BadWords, allowed_mask, restrict_tokens


@dataclass
class SamplingTensors:
    """Per-row sampling parameters on the device. Rows with temperature 0 are greedy."""

    temperature: torch.Tensor  # [n] float32
    top_p: torch.Tensor  # [n] float32
    top_k: torch.Tensor  # [n] int64 (vocab size when unlimited)
    seeds: torch.Tensor  # [n] int64
    all_greedy: bool  # host-side: skip the sampling path entirely (greedy rows, no logit processors)
    min_p: torch.Tensor | None = None  # [n] float32 (None: no row uses it)
    bias_ids: torch.Tensor | None = None  # [n, B] int64 logit_bias token ids (padding: id 0, bias 0)
    bias_values: torch.Tensor | None = None  # [n, B] float32
    suppress_ids: torch.Tensor | None = None  # [n, B2] int64 stop tokens min_tokens masks (padding: id 0)
    suppress_valid: torch.Tensor | None = None  # [n, B2] bool
    min_positions: torch.Tensor | None = None  # [n] int64: positions below it may not choose a stop token
    penalties: PenaltyParams | None = None  # presence / frequency / repetition (runtime/penalties.py)
    allowed: torch.Tensor | None = None  # [b, V] bool per request, not per row: allowed_token_ids
    bad_words: BadWords | None = None  # per request (runtime/token_restrictions.py)

    @staticmethod
    def greedy() -> "SamplingTensors":
        """For a batch of greedy requests only: no per-row tensors are made (select_tokens takes the argmax)."""
        empty = torch.zeros(0)
        return SamplingTensors(empty, empty, empty.long(), empty.long(), all_greedy=True)

    @staticmethod
    def build(params: list, seeds: list[int], vocab_size: int, device, repeat: int = 1,
              prompt_lens: list[int] | None = None, stop_ids: list | None = None,
              bad_words: list | None = None) -> "SamplingTensors":
        """From per-request SamplingParams; `repeat` duplicates each request's row (tree nodes). `prompt_lens`
        and `stop_ids` (each request's stop token set) are needed by min_tokens, `bad_words` (each request's
        SamplingParams.bad_words_token_ids) by bad_words."""

        def t(values, dtype):
            return torch.tensor(values, dtype=dtype).repeat_interleave(repeat, dim=0).to(device, non_blocking=True)

        def padded(lists, fill):
            width = max(1, max(len(x) for x in lists))
            return [list(x) + [fill] * (width - len(x)) for x in lists]

        st = SamplingTensors(
            temperature=t([p.temperature for p in params], torch.float32),
            top_p=t([p.top_p for p in params], torch.float32),
            top_k=t([p.top_k if p.top_k > 0 else vocab_size for p in params], torch.int64),
            seeds=t(seeds, torch.int64),
            all_greedy=all(p.temperature == 0.0 and not p.has_logit_processors for p in params),
        )
        if any(p.min_p > 0 for p in params):
            st.min_p = t([p.min_p for p in params], torch.float32)
        if any(p.logit_bias for p in params):
            st.bias_ids = t(padded([[i for i, _ in p.logit_bias] for p in params], 0), torch.int64)
            st.bias_values = t(padded([[b for _, b in p.logit_bias] for p in params], 0.0), torch.float32)
        if any(p.min_tokens > 0 for p in params):
            masked = [sorted(s) if p.min_tokens else [] for p, s in zip(params, stop_ids)]
            st.suppress_ids = t(padded(masked, 0), torch.int64)
            st.suppress_valid = t(padded([[True] * len(m) for m in masked], False), torch.bool)
            st.min_positions = t([n + p.min_tokens for p, n in zip(params, prompt_lens)], torch.int64)
        st.penalties = PenaltyParams.build(params, t)
        st.allowed = allowed_mask([p.allowed_token_ids for p in params], vocab_size, device)
        if any(p.bad_words for p in params):
            if bad_words is None or len(bad_words) != len(params):
                raise InvariantError("bad_words were requested but their token ids were not given")
            st.bad_words = BadWords.build(bad_words, device)
        return st


def process_logits(logits: torch.Tensor, st: SamplingTensors, positions: torch.Tensor,
                   history: TokenHistory | None = None) -> torch.Tensor:
    """Token restrictions (bad words match `history`'s recent tokens), logit_bias, min_tokens, then penalties
    (which count `history`) applied to float32 logits [n, V] for the tokens chosen at `positions` [n]."""
    logits = logits.float()
    if st.allowed is not None or st.bad_words is not None:
        logits = restrict_tokens(logits, st.allowed, st.bad_words, None if history is None else history.recent)
    if st.bias_ids is not None:
        logits = logits.scatter_add(-1, st.bias_ids, st.bias_values)
    if st.suppress_ids is not None:
        active = st.suppress_valid & (positions < st.min_positions)[:, None]  # [n, B2]
        logits = logits.scatter_add(-1, st.suppress_ids, torch.where(active, float("-inf"), 0.0))
    if st.penalties is not None:
        logits = apply_penalties(logits, st.penalties, history)
    return logits


def target_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The distribution sampling draws from: softmax(logits / T) cut by min-p, top-k and top-p, renormalised
    (logits already processed: `process_logits`).

    logits [n, V] -> probs [n, V] float32. Greedy rows get a one-hot on the argmax.
    """
    logits = logits.float()
    greedy = st.temperature == 0
    temp = torch.where(greedy, torch.ones_like(st.temperature), st.temperature)
    scaled = logits / temp[:, None]
    if st.min_p is not None:  # below min_p x the top probability: out (before top-k / top-p, as vLLM)
        probs = scaled.softmax(dim=-1)
        floor = st.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        scaled = scaled.masked_fill(probs < floor, float("-inf"))
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


def select_tokens(logits: torch.Tensor, st: SamplingTensors, positions: torch.Tensor,
                  history: TokenHistory | None = None) -> torch.Tensor:
    """One token per row. positions [n]: position of the token being chosen (the random key with the seed);
    `history`: what penalties count and bad words match at each row (needed when `st.penalties` or
    `st.bad_words` is set).

    Greedy rows take the argmax; others sample target_probs with uniform(seed, position): the
    same uniform whichever tree node (or plain decode step) chooses the token at that position.
    """
    if st.all_greedy:
        return logits.argmax(dim=-1)
    logits = process_logits(logits, st, positions, history)
    greedy_tokens = logits.argmax(dim=-1)
    u = uniform(st.seeds, positions)
    sampled = sample_from_probs(target_probs(logits, st), u)
    return torch.where(st.temperature == 0, greedy_tokens, sampled)
