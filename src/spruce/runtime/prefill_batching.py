"""Prefill batching (`scheduler_delay_factor`, vLLM's option of that name): while requests decode, hold new
arrivals back for a short while so that several join in one prefill launch.

Why: a prefill step costs about the same whatever it holds while it is launch-bound. On the H100 (pycode-19m,
2026-11-23) one prefill of a 128-token prompt with its draft extend took ~7.7 ms of eager launches, during which
every running request waits. A server whose requests end at different steps (speculative rounds commit different
numbers of tokens) gets one prefill per arrival: offline at concurrency 64 a fixed EAGLE-3 engine spent 13.1 s of
18.5 s in 1,693 prefill launches for 4,096 requests, a plain one 1.3 s in 192, because its requests end together.

Rule (with f > 0): while B requests decode, a prefill launch would stall them for about P seconds (the EMA of the
engine's measured prefill launches): B * P request-seconds. Holding the waiting requests costs the seconds they
wait. So they are held until their waits add up to B * P (rent until it equals the price of buying: the classic
2-competitive rule), and never longer than f * P for the oldest (the TTFT bound, vLLM's delay). They are admitted
at once when no request decodes (an idle engine: concurrency 1 pays nothing), or when they fill every free running
slot or a whole prefill chunk (nothing more could join). A burst of arrivals (a plain server's requests that ended
together) thus goes in at once after its first prefill, and arrivals that trickle in one by one behind a large
batch are grouped. Each held request's TTFT grows by at most f * P. f = 0 (the default) admits at once.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from spruce.config import check_delay_factor
from spruce.runtime.request import Status

PREFILL_ALPHA = 0.2  # EMA weight of a new prefill launch time


class PrefillBatching:
    """Whether admission waits for more arrivals (module docstring). `clock`: seconds (tests pass a fake one)."""

    def __init__(self, delay_factor: float, clock: Callable[[], float] = time.monotonic):
        check_delay_factor(delay_factor)
        self.delay_factor = float(delay_factor)
        self.clock = clock
        self.prefill_seconds = 0.0  # EMA of prefill launch seconds (0 until the first: nothing is held)
        self.held = 0  # admission rounds held back (for stats)

    def queued_at(self) -> float:
        """The time stamp a newly queued request carries."""
        return self.clock()

    def launched(self, seconds: float) -> None:
        """A prefill step took `seconds` to launch."""
        old = self.prefill_seconds
        self.prefill_seconds = seconds if old == 0.0 else old + PREFILL_ALPHA * (seconds - old)

    def hold(self, waiting: Sequence, running: Sequence, free_slots: int, chunk_tokens: int) -> bool:
        """True: leave the `waiting` requests (oldest first; each with `queued_at` and `num_tokens`) queued for now,
        beside the `running` ones (each with a `status`), with `free_slots` running slots free. The cheap checks
        come first: with f = 0, or a queue that fills the free slots, nothing is walked."""
        if self.delay_factor == 0.0 or len(waiting) >= free_slots:
            return False
        decoding = sum(r.status is Status.DECODE for r in running)
        if not decoding or sum(r.num_tokens for r in waiting) >= chunk_tokens:
            return False
        now = self.clock()
        if now - waiting[0].queued_at >= self.delay_factor * self.prefill_seconds:  # the oldest waited its bound
            return False
        if sum(now - r.queued_at for r in waiting) >= decoding * self.prefill_seconds:  # the waits outweigh a stall
            return False
        self.held += 1
        return True
