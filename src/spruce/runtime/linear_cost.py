"""A cost that grows linearly with a size, fitted online: seconds ~ fixed + per_unit * n (prefill batching's launch:
fixed + per chunk, runtime/prefill_batching.py). Pure Python."""

from __future__ import annotations


class LinearCost:
    """seconds ~ fixed + per_unit * n, fitted online by exponentially weighted least squares (forgetting factor
    `alpha`: a new sample's weight). With one distinct n seen so far it predicts the mean; before any sample, 0."""

    def __init__(self, alpha: float):
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"a LinearCost's forgetting factor must be in (0, 1], got {alpha!r}")
        self.alpha = alpha
        self._sums = None  # weighted means of (n, n^2, y, n*y)

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
