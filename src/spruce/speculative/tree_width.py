"""The verify width of adaptive rounds (`speculative_adaptive_widths`): per cost bucket, the tree of N' nodes (one of
Limits.tree_widths) whose rounds are expected to commit the most tokens per second.

    tokens/s(w) = (1 + a_w) / t_w(b)

- a_w, the mean drafts a round at width w accepts, per request-round, over about the last WIDTH_WINDOW of them. A
  round at width W tells a_w exactly for every w <= W (the narrower tree is a sub-tree: speculative/tree.py's
  `accepted_within`; the round's result row carries them), nothing about wider trees. So until the widest tree has
  been measured every round runs it, and while a narrower one is chosen, REFRESH_ROUNDS of every REFRESH_EVERY
  rounds run the widest again (a_N would otherwise keep the value it had when the narrower one took over).
- t_w(b) = D_w(b) (+) H(b): the device seconds of a round at width w over a batch of bucket b, from the start-up
  table (padding rows: they read no context, but the widths differ only in the verify's tree, which they hold), and
  the host seconds of a round there as the policy measures them (AdaptivePolicy.host_seconds: the host work of
  launching, resolving and serving a round, which the tree's width hardly changes). (+) is the policy's: max when
  host and device overlap.

The choice between rounds and plain steps stays the policy's (speculative/adaptive_policy.py), made for rounds of
whatever width runs: its acceptance and cost figures are those of the rounds it saw.
"""

from __future__ import annotations

from collections.abc import Callable

WIDTH_WINDOW = 512  # request-rounds the acceptance means weigh (an EMA once a width has that many)
REFRESH_EVERY = 256  # rounds at a narrower width before the widest runs again ...
REFRESH_ROUNDS = 8  # ... for this many rounds


class WidthChooser:
    """Keeps each width's acceptance and picks a width per cost bucket (module docstring).

    widths: Limits.tree_widths (ascending, N last); device_seconds: {(width, bucket): D} for every pair; host_seconds:
    the host seconds of a round at a bucket (AdaptivePolicy.host_seconds); join: the policy's (+)."""

    def __init__(self, widths: tuple[int, ...], device_seconds: dict[tuple[int, int], float],
                 host_seconds: Callable[[int], float], join: Callable[[float, float], float]):
        if len(widths) < 2 or list(widths) != sorted(set(widths)):
            raise ValueError(f"widths {widths}: need two or more, ascending")
        self.widths = widths
        self.widest = widths[-1]
        self.device_seconds = device_seconds
        self.host_seconds = host_seconds
        self.join = join
        self.accept: dict[int, float] = {}  # width -> mean drafts accepted per request-round
        self.samples: dict[int, int] = dict.fromkeys(widths, 0)  # request-rounds behind each mean
        self.rounds = dict.fromkeys(widths, 0)  # rounds run at each width
        self.chosen: dict[int, int] = {}  # bucket -> the width its last choice took
        self._narrow_rounds = 0  # rounds at a narrower width since the widest last ran
        self._refresh_left = 0  # rounds the widest still runs to re-measure its acceptance

    def add(self, width: int, totals: list[int], requests: int) -> None:
        """One round at `width` over `requests` requests: `totals`, per width (Limits.tree_widths' order), the drafts
        its requests together would have accepted at that width (entries for widths above `width` are ignored). Each
        width's mean moves by the round's mean, weighted by its requests over the samples behind the mean (at most
        WIDTH_WINDOW): the running mean, then an EMA."""
        self.rounds[width] += 1
        if width < self.widest:
            self._narrow_rounds += 1
        elif self._refresh_left:
            self._refresh_left -= 1
        if not requests:
            return
        for w, total in zip(self.widths, totals):
            if w > width:
                break
            seen = self.samples[w] = self.samples[w] + requests
            mean = self.accept.get(w, 0.0)
            self.accept[w] = mean + (total / requests - mean) * min(requests / min(seen, WIDTH_WINDOW), 1.0)

    def tokens_per_second(self, width: int, bucket: int) -> float:
        """Expected committed tokens per second per request of rounds at `width` over a batch of `bucket`."""
        seconds = self.join(self.device_seconds[(width, bucket)], self.host_seconds(bucket))
        return (1.0 + self.accept[width]) / seconds

    def choose(self, bucket: int) -> int:
        """The width for rounds over a batch of cost bucket `bucket`: the widest until its acceptance is measured
        and while it is re-measured, else the best expected tokens per second."""
        if self.widest not in self.accept or self._refresh_left:
            width = self.widest
        else:
            width = max(self.widths, key=lambda w: (self.tokens_per_second(w, bucket), w))
            if width < self.widest and self._narrow_rounds >= REFRESH_EVERY:
                self._narrow_rounds, self._refresh_left = 0, REFRESH_ROUNDS
                width = self.widest
        self.chosen[bucket] = width
        return width

    def snapshot(self) -> dict:
        """For /metrics: each width's acceptance and rounds, and each bucket's last width."""
        return {"accept": dict(self.accept), "rounds": dict(self.rounds), "chosen": dict(self.chosen)}
