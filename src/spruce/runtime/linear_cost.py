"""A cost that grows linearly with a size, fitted online: seconds ~ fixed + per_unit * n.

Used where a price must tell the part a step pays once from the part it pays per unit: adaptive speculation's
catch-up (fixed + per lagging position, speculative/adaptive_policy.py) and prefill batching's launch (fixed + per
chunk, runtime/prefill_batching.py). Pure Python."""

from __future__ import annotations


class LinearCost:
    """seconds ~ fixed + per_unit * n, fitted online by exponentially weighted least squares (forgetting factor
    `alpha`: a new sample's weight). With one distinct n seen so far it predicts the mean; before any sample, 0.

    `seed`: (n, seconds) points that stand for the fit's state before its first sample (their mean), such as the
    start-up measurement at a small and a large n: the slope then rests on two sizes far apart until online
    samples outweigh them ((1 - alpha)^k after k samples). Unseeded, the first few samples fix the slope alone, and
    catch-ups in a level's first pass come in a few sizes close together: on the H200 (2026-11-23, 128-token
    prompts) the fit read 25-66 us per position after 3-5 catch-ups, while a catch-up over 4096 positions cost
    5.2 ms against 2.9 ms over 512 (0.6 us per position), and a round that needed one was priced out."""

    def __init__(self, alpha: float, seed: list[tuple[int, float]] | None = None):
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"a LinearCost's forgetting factor must be in (0, 1], got {alpha!r}")
        self.alpha = alpha
        self._sums = None  # weighted means of (n, n^2, y, n*y)
        for k, (n, seconds) in enumerate(seed or ()):  # their plain mean
            x = (float(n), float(n) ** 2, seconds, n * seconds)
            self._sums = x if self._sums is None else tuple(a + (b - a) / (k + 1) for a, b in zip(self._sums, x))

    def add(self, n: int, seconds: float) -> None:
        x = (float(n), float(n) ** 2, seconds, n * seconds)
        s = self._sums
        self._sums = x if s is None else tuple(a + self.alpha * (b - a) for a, b in zip(s, x))

    def coefficients(self) -> tuple[float, float]:
        """(fixed seconds, seconds per unit), both >= 0."""
        if self._sums is None:
            return 0.0, 0.0
        n, nn, y, ny = self._sums
        var = nn - n * n
        if var <= 1e-9 * max(1.0, n * n):
            return y, 0.0
        slope = max((ny - n * y) / var, 0.0)
        return max(y - slope * n, 0.0), slope

    def predict(self, n: int) -> float:
        fixed, per = self.coefficients()
        return fixed + per * n
