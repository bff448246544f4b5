"""Page-table writes in one launch on the GPU: (row, column, page) triples staged in pinned host memory, copied to the
device in one transfer and scattered into the table by one Triton kernel.

The torch write in `PageTable._write` (a tensor from Python lists, a pageable copy, an int32 cast and a 2-D
advanced-index assignment) is the reference and the CPU path. On the H100's host (2026-11-25, in process) it took
~240 us of host time per call for three pages, and py-spy put `PageTable._write` first by own time in every
server's engine process at concurrency 8 with the 1k shared prefix (8% of the plain engine's samples). Here the
host fills a pinned slot with the triples, issues one pinned copy and one kernel.

A slot is reused only after the copy that read it has run: each slot keeps the event recorded after its copy, and a
write that comes back to a slot waits for that event (slots are taken round-robin, so it is STAGING_SLOTS writes
old: done long before, unless the stream is that far behind).
"""

from __future__ import annotations

import torch

from spruce.ops.triton_support import HAS_TRITON, missing_triton_error, tl, triton

STAGING_SLOTS = 4  # pinned slots in rotation
STAGING_PAGES = 4096  # triples a slot holds; a larger write takes the torch path


@triton.jit
def _write_pages_kernel(table_ptr, triples_ptr, n, row_stride, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    row = tl.load(triples_ptr + i, mask=m, other=0)
    col = tl.load(triples_ptr + n + i, mask=m, other=0)
    page = tl.load(triples_ptr + 2 * n + i, mask=m, other=0)
    tl.store(table_ptr + row * row_stride + col, page.to(tl.int32), mask=m)


def scatter_pages(table: torch.Tensor, triples: torch.Tensor) -> None:
    """table[triples[0, i], triples[1, i]] = triples[2, i] for every i (triples [3, n] int64 on the table's device,
    contiguous; a (row, column) pair at most once)."""
    if not HAS_TRITON:
        raise missing_triton_error("the one-launch page-table write (PageTable on CUDA)")
    n = triples.shape[1]
    if n:
        block = 256
        _write_pages_kernel[(triton.cdiv(n, block),)](table, triples, n, table.stride(0), BLOCK=block)


class PageWriter:
    """Stages (row, column, page) triples in pinned slots and writes them into a CUDA `table` [rows, columns]."""

    def __init__(self, table: torch.Tensor):
        self.table = table
        self._host = torch.zeros(STAGING_SLOTS, 3 * STAGING_PAGES, dtype=torch.int64, pin_memory=True)
        self._device = torch.zeros(STAGING_SLOTS, 3 * STAGING_PAGES, dtype=torch.int64, device=table.device)
        self._done: list[torch.cuda.Event | None] = [None] * STAGING_SLOTS  # after each slot's last copy
        self._next = 0

    def fits(self, n: int) -> bool:
        return n <= STAGING_PAGES

    def write(self, rows: list[int], cols: list[int], pages: list[int]) -> None:
        """table[rows[i], cols[i]] = pages[i], queued on the current stream after the work already queued there."""
        n = len(rows)
        slot = self._next
        self._next = (slot + 1) % STAGING_SLOTS
        done = self._done[slot]
        if done is not None:
            done.synchronize()  # the copy that last read this slot has run (STAGING_SLOTS writes ago)
        host = self._host[slot, :3 * n]
        host.copy_(torch.tensor([rows, cols, pages], dtype=torch.int64).view(-1))
        device = self._device[slot, :3 * n]
        device.copy_(host, non_blocking=True)
        event = done if done is not None else torch.cuda.Event()
        event.record()
        self._done[slot] = event
        scatter_pages(self.table, device.view(3, n))
