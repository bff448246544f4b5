"""Small statistics helpers for tests that must be able to fail."""

from __future__ import annotations

import math


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper critical value of chi-square(df) at p ~ 1e-4 (z = 3.719), Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_statistic(counts: list[int], probs: list[float]) -> tuple[float, int]:
    """Pearson statistic over cells with expected count >= 5 (the rest pooled); returns (stat, df)."""
    n = sum(counts)
    cells, pooled_obs, pooled_exp = [], 0, 0.0
    for c, p in zip(counts, probs):
        e = n * p
        if e >= 5:
            cells.append((c, e))
        else:
            pooled_obs += c
            pooled_exp += e
    if pooled_obs and pooled_exp == 0:
        return math.inf, max(len(cells), 1)  # outcomes the distribution cannot produce
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return stat, max(len(cells) - 1, 1)


def matches_distribution(counts: list[int], probs: list[float]) -> bool:
    stat, df = chi2_statistic(counts, probs)
    return stat < chi2_critical(df)
