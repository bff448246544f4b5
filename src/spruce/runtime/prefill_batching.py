"""Prefill batching (`scheduler_delay_factor`, vLLM's option of that name): while requests decode, hold new
arrivals back for a short while so that several join in one prefill launch.

Why: part of a prefill step's cost is paid once whatever it holds, while it is launch-bound. On the H100
(pycode-19m) one prefill of a 128-token prompt with its draft extend took ~7.7 ms of eager launches, during which
every running request waits. A server whose requests end at different steps (speculative rounds commit different
numbers of tokens) gets one prefill per arrival: offline at concurrency 64 a fixed EAGLE-3 engine spent 13.1 s of
18.5 s in 1,693 prefill launches for 4,096 requests, a plain one 1.3 s in 192, because its requests end together.

Rule (with f > 0): while B requests decode, one more prefill launch would stall them for P seconds, the part of a
launch that does not grow with the chunks it holds (the launches measured, fitted online as P + p * chunks:
runtime/linear_cost.py): B * P request-seconds. Holding the waiting requests costs the seconds they wait. So they
are held until their waits add up to B * P (rent until it equals the price of buying: the classic 2-competitive
rule), and never longer than f * P for the oldest (the TTFT bound, vLLM's delay). They are admitted at once when
no request decodes (an idle engine: concurrency 1 pays nothing), or when they fill every free running slot or a
whole prefill chunk (nothing more could join). A burst of arrivals (a plain server's requests that ended together)
thus goes in at once after its first prefill, and arrivals that trickle in one by one behind a large batch are
grouped. Each held request's TTFT grows by at most f * P. f = 0 (the default) admits at once.

Why the fixed part: a chunk's own share (p) is paid whether it joins a batch or launches alone, so holding saves
only P per launch avoided. Served with a 1k shared prefix at concurrency 32-64 a launch is mostly per chunk
(pycode-19m on the H100: ~0.31-0.37 ms a chunk over a fixed 0.17-0.47 ms; a fixed EAGLE-3 server's fixed part
~2.5-3.5 ms, its draft extend's). The mean launch would price the holds by the chunks they gather: a batch of k
chunks would hold as if batching saved (k - 1) chunks' worth more than it does, and an engine whose chunks cost
more would hold longer, gather more chunks and hold longer still. With one chunk count seen the fit is their mean
launch.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from spruce.config import check_delay_factor
from spruce.runtime.linear_cost import LinearCost
from spruce.runtime.request import Status

PREFILL_ALPHA = 0.05  # a new prefill launch's weight in the fit (a fit of two coefficients wants ~20 launches)


class PrefillBatching:
    """Whether admission waits for more arrivals (module docstring). `clock`: seconds (tests pass a fake one)."""

    def __init__(self, delay_factor: float, clock: Callable[[], float] = time.monotonic):
        check_delay_factor(delay_factor)
        self.delay_factor = float(delay_factor)
        self.clock = clock
        self.launch_cost = LinearCost(PREFILL_ALPHA)  # prefill launch seconds ~ fixed + per chunk x chunks
        self.held = 0  # admission rounds held back (for stats)

    def queued_at(self) -> float:
        """The time stamp a newly queued request carries."""
        return self.clock()

    def launched(self, seconds: float, chunks: int) -> None:
        """A prefill step of `chunks` chunks took `seconds` to launch."""
        self.launch_cost.add(chunks, seconds)

    @property
    def prefill_seconds(self) -> float:
        """P: what one more prefill launch costs beside its chunks' own share (the module docstring); 0 until a
        prefill was measured (nothing is held)."""
        return self.launch_cost.coefficients()[0]

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
        price = self.prefill_seconds
        if now - waiting[0].queued_at >= self.delay_factor * price:  # the oldest waited its bound
            return False
        if sum(now - r.queued_at for r in waiting) >= decoding * price:  # the waits outweigh a stall
            return False
        self.held += 1
        return True
