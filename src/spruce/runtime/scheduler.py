"""Continuous batching: admission, page reservation, preemption and release.

Policy: FIFO admission while a request row and pages for its whole prompt (+ `Limits.lookahead`) are free;
with the prefix cache, the longest cached run of full pages is shared instead of computed (of pages cached without
the draft's KV, only by a request that decodes plainly for its life: memory/prefix_cache.py), and unreferenced
cached pages are evicted (least recently used) before anything waits or is preempted for memory.
While requests decode and others prefill, a mixed step (`mixed_steps`, plain decoding) runs every decoding
request's next token and prompt chunks together in one forward under one token budget (`chunked_prefill_size`,
vLLM's max_num_batched_tokens: decode rows count one token each, the chunks take the rest), so the weights are
read once for both. Otherwise (speculative decoding, mixing off, or decode rows filling the budget) prefill
(chunked) and decode steps alternate while both have work, so a long prompt never stalls the running requests
for more than one chunk. Decode steps reserve `lookahead` positions past each request's
host-known committed length (under overlap, that covers the step still in flight too) and, when pages run
out, the engine preempts the youngest running request (its cache is dropped and it is recomputed later).
Running out of pages therefore queues work; it never crashes or corrupts. With prefill batching
(`scheduler_delay_factor`, runtime/prefill_batching.py) a busy engine holds arrivals back briefly so that several
share one prefill launch.

A finished or aborted request leaves the running set at once, but keeps its row and pages until every
launched step that includes it has completed (`Request.inflight` == 0): only then are they released.

When every layer of the model is windowed (sliding windows or chunked attention: memory/window.py), each plan frees
the pages of every running request that lie wholly before the oldest position its queries can still read
(`free_behind_windows`), so a request holds about a window's worth of pages however long it runs. Pages it shares
with the prefix cache (its matched path) stay until it releases them; a request that freed pages adds none of its
own to the cache (a cached path must hold every page from the first).
"""

from __future__ import annotations

import bisect
from collections import deque

from spruce.errors import InvariantError
from spruce.limits import Limits
from spruce.memory.page_allocator import PageAllocator
from spruce.memory.page_table import PageTable
from spruce.memory.prefix_cache import PrefixCache
from spruce.memory.window import WindowReach
from spruce.runtime.prefill_batching import PrefillBatching
from spruce.runtime.request import Request, Status


class Scheduler:
    def __init__(self, limits: Limits, page_table: PageTable, allocator: PageAllocator,
                 prefix_cache: PrefixCache | None = None, batching: PrefillBatching | None = None,
                 reach: WindowReach | None = None):
        self.limits = limits
        self.reach = reach if reach is not None and reach.frees else None  # None: pages stay until release
        self.batching = batching if batching is not None else PrefillBatching(0.0)
        self.page_table = page_table
        self.allocator = allocator
        self.prefix_cache = prefix_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.retiring: list[Request] = []  # finished, with a launched step still holding their row
        self._prefill_turn = True
        self.mixed_steps = False  # the engine turns it on for plain decoding (EngineConfig.mixed_steps)
        self.num_preemptions = 0

    # --- queue -----------------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.queued_at = self.batching.queued_at()
        self.waiting.append(req)

    def finish(self, req: Request, reason: str) -> None:
        """Mark the request finished and take it out of the queues; its row and pages go back now, or once
        the last launched step that includes it has completed."""
        was = req.status
        req.status = Status.FINISHED
        req.finish_reason = reason
        if was is Status.WAITING:
            self.waiting.remove(req)
            return
        self.running.remove(req)
        if req.inflight and "release_after_inflight" not in self.limits.reverted_fixes:
            self.retiring.append(req)
        else:
            self._release(req)

    def release_settled(self) -> None:
        """Release the rows and pages of finished requests whose launched steps have all completed."""
        if not self.retiring:
            return
        settled = [r for r in self.retiring if r.inflight == 0]
        for req in settled:
            self.retiring.remove(req)
            self._release(req)

    def _release(self, req: Request) -> None:
        if req.inflight:
            raise InvariantError(
                f"releasing row {req.row} and its pages of request {req.request_id} while {req.inflight} launched "
                f"step(s) that write them have not completed"
            )
        if req.row is not None:
            pages = self.page_table.release_row(req.row)  # its live pages: the matched path's first
            if self.prefix_cache is not None:
                # positions whose KV matches the host's tokens (tokens past a stop are dropped); none past the
                # matched path once some of its own pages were freed
                valid = min(req.committed, req.num_tokens - 1)
                if req.freed_to:
                    valid = len(req.cached_path) * self.limits.page_size
                pages = self.prefix_cache.release(req.cached_path, req.token_ids, pages, valid)
            self.allocator.free(pages)
            req.row = None
            req.reserved = 0
            req.freed_to = 0
            req.cached_path = []

    @property
    def has_work(self) -> bool:
        """Anything queued, running, or waiting for its last step to complete."""
        return bool(self.waiting or self.running or self.retiring)

    # --- pages -----------------------------------------------------------------------------------------------
    def free_behind_windows(self) -> None:
        """Free each running request's own pages that lie wholly before the oldest position its queries can
        still read (`WindowReach.first_read` of its host-known committed length, a lower bound of every launched
        or future query's position, the step in flight included). Nothing when some layer attends to all
        positions. E.g. W = 8, page_size 4, committed 20: first read 13, columns 0..2 (positions 0..11) go."""
        reach = self.reach
        if reach is None:
            return
        ps = self.limits.page_size
        with self.page_table.batched():  # one device write for every request's freed columns
            for req in self.running:
                stop = reach.first_read(req.committed) // ps
                start = max(len(req.cached_path), req.freed_to)
                if stop > start:
                    self.allocator.free(self.page_table.free_columns(req.row, start, stop))
                    req.freed_to = stop

    def _reserve(self, req: Request, num_positions: int) -> bool:
        """Make the request's pages cover positions [0, num_positions). False if the pool is short."""
        if req.reserved >= num_positions:
            return True
        held = len(self.page_table.pages(req.row))
        pages = self.alloc_pages(self.limits.pages_for(num_positions) - held)
        if pages is None:
            return False
        self.page_table.append_pages(req.row, pages)
        req.reserved = (held + len(pages)) * self.limits.page_size
        return True

    def alloc_pages(self, n: int) -> list[int] | None:
        """n pages, evicting unreferenced cached pages if the free list is short; None if still short."""
        short = n - self.allocator.num_free
        if short > 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(short)
        return self.allocator.alloc(n)

    def admit(self) -> None:
        """Move waiting requests (oldest first) into the running set while rows and pages allow."""
        with self.page_table.batched():  # one device write for every admitted request's pages
            self._admit()

    def _admit(self) -> None:
        cache = self.prefix_cache
        if self.waiting and self._hold():
            return
        while self.waiting:
            req = self.waiting[0]
            if len(self.running) >= self.limits.max_running_requests or self.page_table.num_free_rows == 0:
                return
            # a request that wants prompt logprobs computes its whole prompt (vLLM's rule too): no cache hit
            path = cache.match(req.token_ids) if cache is not None and not req.prompt_logprobs_pending else []
            if cache is not None:
                cache.lock(path)  # before any eviction, so the path stays
            need = self.limits.pages_for(req.num_tokens + self.limits.lookahead) - len(path)
            if need > self.allocator.num_free and cache is not None:
                cache.evict(need - self.allocator.num_free)
            if need > self.allocator.num_free:
                if cache is not None:
                    cache.unlock(path)
                return
            row = self.page_table.alloc_row()
            self.waiting.popleft()
            req.row = row
            req.status = Status.PREFILL
            req.cached_tokens = len(path) * self.limits.page_size
            if path:  # the cached prefix: shared pages, already computed
                self.page_table.append_pages(row, [node.page for node in path])
                req.cached_path = path
                req.committed = req.reserved = req.cached_tokens
            if cache is not None:
                cache.count_lookup(req.cached_tokens, req.num_tokens)
            if not self._reserve(req, req.num_tokens + self.limits.lookahead):
                raise InvariantError(f"admission of {req.request_id}: {need} pages checked free but not allocated")
            bisect.insort(self.running, req, key=_arrival)  # running stays oldest first

    def _hold(self) -> bool:
        """Prefill batching: leave the waiting requests queued for now (runtime/prefill_batching.py)."""
        free = min(self.limits.max_running_requests - len(self.running), self.page_table.num_free_rows)
        return self.batching.hold(self.waiting, self.running, free, self.limits.chunked_prefill_size)

    # --- what the next step runs -----------------------------------------------------------------------------
    def next_step(self) -> tuple[str, list[Request]] | None:
        """("prefill", the prefilling requests), ("decode" or "mixed", the decoding requests), or None when there is
        nothing to run. While both have work: "mixed" (`mixed_steps`, and the decode rows leave some of the token
        budget to prompt chunks: `mixed_prefill_budget`), else the kinds alternate. A mixed step's prompt chunks
        are the engine's to pick (`prefill_requests`, `prefill_spans`) once its decode rows' pages are reserved:
        a preemption for them may take a prefilling request."""
        self.free_behind_windows()
        prefill, decode = self.prefill_requests(), self.decode_requests()
        if prefill and decode and self.mixed_steps and self.mixed_prefill_budget(len(decode)) > 0:
            return "mixed", decode
        if prefill and decode:
            kind = "prefill" if self._prefill_turn else "decode"
        elif prefill or decode:
            kind = "prefill" if prefill else "decode"
        else:
            return None
        self._prefill_turn = kind == "decode"
        return kind, prefill if kind == "prefill" else decode

    def mixed_prefill_budget(self, decode_rows: int) -> int:
        """Prompt tokens a mixed step with `decode_rows` decoding requests may add: the token budget
        (`chunked_prefill_size`) less one token per decode row. E.g. budget 2048, 64 decode rows: 1984."""
        return self.limits.chunked_prefill_size - decode_rows

    def prefill_spans(self, reqs: list[Request], budget: int) -> list[tuple[Request, int, int]]:
        """The prompt chunks of one step: (request, first position, tokens) for the prefilling `reqs`, oldest
        first, each continuing from its committed length, until `budget` tokens are taken. E.g. budget 100,
        prompts of 60 and 70 tokens: (a, 0, 60), (b, 0, 40)."""
        spans = []
        for q in reqs:
            take = min(q.num_tokens - q.committed, budget)
            if take <= 0:
                break
            spans.append((q, q.committed, take))
            budget -= take
        return spans

    def prefill_requests(self) -> list[Request]:
        """Requests whose prompt is not fully in the cache yet, oldest first."""
        prefill = Status.PREFILL
        return [r for r in self.running if r.status is prefill]

    def decode_requests(self) -> list[Request]:
        """Decoding requests a step can still add tokens to, oldest first.

        A request whose in-flight steps will surely finish it (each commits at least one token) is left out:
        its result arrives with the step in flight, and a further step would only compute dropped tokens."""
        decode = Status.DECODE
        return [r for r in self.running
                if r.status is decode and len(r.prompt_ids) + len(r.output_ids) + r.inflight < r.token_limit]

    def reserve_decode(self, reqs: list[Request]) -> Request | None:
        """Reserve `lookahead` positions past each request's committed length; the first one short of pages,
        or None when all are covered."""
        lookahead = self.limits.lookahead
        short = [r for r in reqs if r.committed + lookahead > r.reserved]  # most steps: none
        if not short:
            return None
        with self.page_table.batched():  # one device write for the step's new pages
            return next((r for r in short if not self._reserve(r, r.committed + lookahead)), None)

    def preempt_youngest(self) -> None:
        """Drop the youngest running request's cache and queue it (first in line) for recomputation."""
        req = self.running.pop()  # the running set is kept oldest first
        self._release(req)
        req.reset_for_recompute()
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    @property
    def cached_pages(self) -> int:
        """Pages the prefix cache holds (some may be shared with running requests)."""
        return self.prefix_cache.num_pages if self.prefix_cache is not None else 0

    def flush_cache(self) -> int:
        """Evict every cached page no running request holds; returns how many."""
        return self.prefix_cache.evict(self.prefix_cache.num_pages) if self.prefix_cache is not None else 0

    def check_accounting(self) -> None:
        """Leak check: pages held by running and retiring requests, and by the prefix cache, == pages the
        allocator counts as used (a shared page counted once)."""
        rows = [self.page_table.live_pages(r.row) for r in self.running + self.retiring]
        held = sum(len(p) for p in rows)
        if self.page_table.pages_in_use() != held:
            raise InvariantError(
                f"page table holds {self.page_table.pages_in_use()} pages, running requests {held}"
            )
        cached = self.prefix_cache.held_pages() if self.prefix_cache is not None else set()
        live = {p for pages in rows for p in pages}
        shared = sum(len(r.cached_path) for r in self.running + self.retiring)
        if self.prefix_cache is None and len(live) != held:
            raise InvariantError(f"a page is held by two rows without a prefix cache ({held} held, {len(live)} distinct)")
        if self.prefix_cache is not None and held - len(live) > shared:
            raise InvariantError(f"{held - len(live)} pages are shared between rows but only {shared} come from "
                                 f"the prefix cache")
        self.allocator.check_accounting(len(live | cached))


def _arrival(req: Request) -> int:
    return req.arrival
