"""Which cached positions a request's queries can still read, when every layer's attention is windowed.

A sliding-window layer's query at position p reads positions (p - W, p]; a chunked layer's (chunk C) reads
[C * floor(p / C), p]. Every query a request will still run (prefill chunks, decode steps, a round's tree and
draft tokens, the step in flight under overlap) sits at or past its host-known committed length c, so when
every target layer is windowed no query reads before `first_read(c)` and the pages wholly before it can go back
to the allocator (`Scheduler.free_behind_windows`). One full-attention layer reads everything: then nothing is
freed (gpt-oss and Llama 4 mix both kinds, and one page table serves all layers).

A draft (EAGLE heads, draft LMs) attends to all its cached positions as trained; its KV shares the target's
pages, so when pages are freed its attention gets a sliding window too (`draft_window`): the widest target
layer's reach, W or C. Worked example: Mistral, W = 4096, c = 10000: first_read = 10000 - 4096 + 1 = 5905;
with page_size 16 pages 0 .. 368 (positions < 5904) are freed. All-chunked, C = 8192, c = 10000: the target reads
from 8192, the draft (window 8192) from 1809: pages before 1809 go.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WindowReach:
    """How far back a model's queries read: its target layers' sliding windows and chunk sizes, and the sliding
    window its draft is held to (None: no draft, or nothing is freed)."""

    windows: tuple[int, ...]  # the distinct sliding windows W of the target's sliding layers
    chunks: tuple[int, ...]  # the distinct chunk sizes C of its chunked layers
    full_layers: int  # layers that attend to every position
    draft_window: int | None = None

    @staticmethod
    def of_model(cfg) -> "WindowReach":
        """The reach of a ModelConfig's layers (`layer_window` / `layer_chunk`)."""
        windows, chunks, full = set(), set(), 0
        for i in range(cfg.num_layers):
            w, c = cfg.layer_window(i), cfg.layer_chunk(i)
            if w is not None:
                windows.add(w)
            elif c is not None:
                chunks.add(c)
            else:
                full += 1
        return WindowReach(tuple(sorted(windows)), tuple(sorted(chunks)), full)

    @property
    def frees(self) -> bool:
        """Whether pages behind the windows are freed: every layer is windowed."""
        return self.full_layers == 0 and bool(self.windows or self.chunks)

    @property
    def widest(self) -> int:
        """The widest reach of a windowed layer: its window W or chunk C (the window a draft gets)."""
        return max(self.windows + self.chunks)

    def with_draft(self) -> "WindowReach":
        """This reach with a draft attending over the last `widest` positions (only where pages are freed)."""
        if not self.frees:
            return self
        return WindowReach(self.windows, self.chunks, self.full_layers, self.widest)

    def first_read(self, committed: int) -> int:
        """The oldest position any query at or past position `committed` reads, target and draft (0 where
        nothing is freed). E.g. W = 8, committed 20: 13; C = 8, committed 20: 16."""
        if not self.frees:
            return 0
        first = committed
        if self.windows:
            first = committed - self.windows[-1] + 1
        for c in self.chunks:
            first = min(first, committed - committed % c)
        if self.draft_window is not None:
            first = min(first, committed - self.draft_window + 1)
        return max(first, 0)
