"""Sampling: reproducible per seed, and distributed as softmax(logits/T) cut to top-k / top-p."""

import math

import torch

from spruce.runtime.sampler import SamplingTensors, select_tokens, target_probs
from spruce.sampling_params import SamplingParams
from stats import matches_distribution

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def naive_probs(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """Textbook version: scale, keep the k best, keep the smallest prefix reaching mass top_p."""
    z = [x / temperature for x in logits]
    order = sorted(range(len(z)), key=lambda i: -z[i])[: top_k if top_k > 0 else len(z)]
    m = max(z[i] for i in order)
    w = {i: math.exp(z[i] - m) for i in order}
    total = sum(w.values())
    kept, mass = [], 0.0
    for i in order:
        if mass >= top_p and kept:
            break
        kept.append(i)
        mass += w[i] / total
    s = sum(w[i] for i in kept)
    return [w[i] / s if i in kept else 0.0 for i in range(len(logits))]


def draw(params: SamplingParams, seed: int, n: int) -> list[int]:
    st = SamplingTensors.build([params] * n, [seed] * n, LOGITS.numel(), "cpu")
    positions = torch.arange(n)
    return select_tokens(LOGITS.expand(n, -1), st, positions).tolist()


def test_processed_distribution_matches_naive():
    for t, k, p in [(1.0, -1, 1.0), (0.7, 5, 1.0), (1.3, -1, 0.8), (0.5, 3, 0.6)]:
        params = SamplingParams(temperature=t, top_k=k, top_p=p)
        st = SamplingTensors.build([params], [0], LOGITS.numel(), "cpu")
        got = target_probs(LOGITS[None], st)[0].tolist()
        want = naive_probs(LOGITS.tolist(), t, k, p)
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-6, (t, k, p, got, want)


def test_sampled_frequencies_match_softmax():
    n = 40000
    for t, k, p in [(1.0, -1, 1.0), (0.7, 5, 0.9)]:
        tokens = draw(SamplingParams(temperature=t, top_k=k, top_p=p), seed=123, n=n)
        counts = [tokens.count(i) for i in range(LOGITS.numel())]
        assert matches_distribution(counts, naive_probs(LOGITS.tolist(), t, k, p)), counts


def test_statistical_test_rejects_a_wrong_distribution():
    tokens = draw(SamplingParams(temperature=0.7), seed=5, n=40000)
    counts = [tokens.count(i) for i in range(LOGITS.numel())]
    assert not matches_distribution(counts, naive_probs(LOGITS.tolist(), 1.0, -1, 1.0))


def test_seeded_sampling_is_reproducible():
    params = SamplingParams(temperature=1.0)
    assert draw(params, 7, 200) == draw(params, 7, 200)
    assert draw(params, 7, 200) != draw(params, 8, 200)


def test_greedy_rows_ignore_randomness():
    params = [SamplingParams(), SamplingParams(temperature=1.0)]
    st = SamplingTensors.build(params, [1, 2], LOGITS.numel(), "cpu")
    out = select_tokens(LOGITS.expand(2, -1), st, torch.tensor([0, 0]))
    assert out[0].item() == 0
