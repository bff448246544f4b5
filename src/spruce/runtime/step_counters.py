"""Where the engine's steps and its host time go: cumulative counts of prefill and decode steps, the rows decoded,
and the wall seconds of `Engine.step` split into its parts. Every engine keeps them (a few clock reads per step);
`Engine.stats()["steps"]` carries them and /metrics exposes them, so a benchmark reads per level, for any server,
how many prefills it launched per request, how full its decode batches were and what a step cost the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PARTS = ("launch", "wait", "resolve", "outputs")  # plan + launch; blocked on the device; applying results;
# building the step's outputs


@dataclass
class StepCounters:
    """Counts and seconds since the engine started (module docstring)."""

    prefills: int = 0  # prefill launches (one batch of prompt chunks each)
    decodes: int = 0  # decode launches (plain steps and speculative rounds)
    rounds: int = 0  # ... of which speculative rounds
    mixed: int = 0  # ... of which mixed steps: prompt chunks ran in the same forward (runtime/mixed_step.py); the
    # target's forwards (weight reads) are prefills + decodes
    decode_rows: int = 0  # requests over all decode launches (their mean batch: decode_rows / decodes)
    prefill_launch: float = 0.0  # wall seconds of the prefill launches (within "launch"): their mean is the P by
    # which prefill batching holds arrivals back (runtime/prefill_batching.py)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))

    def launched(self, decode: bool, rows: int, speculative: bool, seconds: float = 0.0, mixed: bool = False) -> None:
        """A launch: a decode step over `rows` decoding requests (a round if `speculative`, with prompt chunks if
        `mixed`), or a prefill that took `seconds` to launch."""
        if decode:
            self.decodes += 1
            self.decode_rows += rows
            self.rounds += speculative
            self.mixed += mixed
        else:
            self.prefills += 1
            self.prefill_launch += seconds

    def add(self, part: str, seconds: float) -> None:
        self.seconds[part] += seconds

    def as_dict(self) -> dict:
        return {"prefills": self.prefills, "decodes": self.decodes, "rounds": self.rounds, "mixed": self.mixed,
                "decode_rows": self.decode_rows, "prefill_launch": self.prefill_launch, "seconds": dict(self.seconds)}
