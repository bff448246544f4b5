"""Continuous batching: admission, page reservation, preemption and release.

Policy: FIFO admission while a request row and pages for its whole prompt (+ one round of lookahead) are
free; prefill-first steps (chunked); decode rounds reserve `lookahead` positions past each request's
committed length and, when pages run out, preempt the youngest running request (its cache is dropped and it
is recomputed later). Running out of pages therefore queues work; it never crashes or corrupts.
"""

from __future__ import annotations

from collections import deque

from spruce.errors import InvariantError
from spruce.limits import Limits
from spruce.memory.page_allocator import PageAllocator
from spruce.memory.page_table import PageTable
from spruce.runtime.request import Request, Status


class Scheduler:
    def __init__(self, limits: Limits, page_table: PageTable, allocator: PageAllocator):
        self.limits = limits
        self.page_table = page_table
        self.allocator = allocator
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # --- queue -----------------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Drop a request wherever it is and give back its row and pages at once."""
        if req in self.running:
            self.running.remove(req)
            self._release(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def _release(self, req: Request) -> None:
        if req.row is not None:
            self.allocator.free(self.page_table.release_row(req.row))
            req.row = None

    # --- pages -----------------------------------------------------------------------------------------------
    def _reserve(self, req: Request, num_positions: int) -> bool:
        """Make the request's pages cover positions [0, num_positions). False if the pool is short."""
        held = len(self.page_table.pages(req.row))
        need = self.limits.pages_for(num_positions) - held
        if need <= 0:
            return True
        pages = self.allocator.alloc(need)
        if pages is None:
            return False
        self.page_table.append_pages(req.row, pages)
        return True

    def admit(self) -> None:
        """Move waiting requests (oldest first) into the running set while rows and pages allow."""
        while self.waiting:
            req = self.waiting[0]
            if len(self.running) >= self.limits.max_running_requests:
                return
            need = self.limits.pages_for(req.num_tokens + self.limits.lookahead)
            if need > self.allocator.num_free:
                return
            row = self.page_table.alloc_row()
            if row is None:
                return
            self.waiting.popleft()
            req.row = row
            req.status = Status.PREFILL
            if not self._reserve(req, req.num_tokens + self.limits.lookahead):
                raise InvariantError(f"admission of {req.request_id}: {need} pages checked free but not allocated")
            self.running.append(req)

    def prefill_requests(self) -> list[Request]:
        return [r for r in self.running if r.status == Status.PREFILL]

    def prepare_decode(self) -> list[Request]:
        """Reserve lookahead pages for every decoding request, preempting the youngest when short."""
        lookahead = self.limits.lookahead
        while True:
            decoding = sorted((r for r in self.running if r.status == Status.DECODE), key=lambda r: r.arrival)
            short = next((r for r in decoding if not self._reserve(r, r.committed + lookahead)), None)
            if short is None:
                return decoding
            self.preempt(max(self.running, key=lambda r: r.arrival))

    def preempt(self, req: Request) -> None:
        """Drop the request's cache and queue it (first in line) for recomputation."""
        self.running.remove(req)
        self._release(req)
        req.reset_for_recompute()
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.remove(req)

    def check_accounting(self) -> None:
        """Leak check: pages held by running requests == pages the allocator counts as used."""
        held = sum(len(self.page_table.pages(r.row)) for r in self.running)
        self.allocator.check_accounting(held)
        if self.page_table.pages_in_use() != held:
            raise InvariantError(
                f"page table holds {self.page_table.pages_in_use()} pages, running requests {held}"
            )
