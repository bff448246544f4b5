"""Request-to-page table: one row per running-request slot, plus the dummy row used by padding."""

from __future__ import annotations

import torch

from spruce.errors import InvariantError
from spruce.limits import DUMMY_PAGE, Limits


class PageTable:
    """`table[row, i]` is the page holding positions [i*page_size, (i+1)*page_size) of the request in `row`.

    Unused entries point at the dummy page, so a stray read never leaves the pool. Rows are handed out
    host-side; the device tensor is updated only where pages are appended.
    """

    def __init__(self, limits: Limits, device: torch.device):
        self.limits = limits
        self.table = torch.full(
            (limits.num_rows, limits.max_pages_per_request), DUMMY_PAGE, dtype=torch.int32, device=device
        )  # [rows, max_pages_per_request]
        self._free_rows = list(range(limits.max_running_requests - 1, -1, -1))
        self._pages: dict[int, list[int]] = {}

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int | None:
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self._pages[row] = []
        return row

    def pages(self, row: int) -> list[int]:
        return self._pages[row]

    def append_pages(self, row: int, pages: list[int]) -> None:
        held = self._pages[row]
        if len(held) + len(pages) > self.limits.max_pages_per_request:
            raise InvariantError(
                f"row {row} would hold {len(held) + len(pages)} pages > max_pages_per_request="
                f"{self.limits.max_pages_per_request} (context_length={self.limits.context_length}, "
                f"page_size={self.limits.page_size})"
            )
        if pages:
            start = len(held)
            new = torch.tensor(pages, dtype=torch.int32)  # staged at once: no wait for the device's queued work
            self.table[row, start:start + len(pages)].copy_(new, non_blocking=True)
            held.extend(pages)

    def release_row(self, row: int) -> list[int]:
        """Frees the row; returns its pages for the allocator. The row is reset to the dummy page."""
        pages = self._pages.pop(row)
        if pages:
            self.table[row, : len(pages)] = DUMMY_PAGE
        self._free_rows.append(row)
        return pages

    def check_covers(self, row: int, num_positions: int, what: str) -> None:
        """Always-on host check before a launch writes positions [0, num_positions) of `row` into pages."""
        held = len(self._pages[row])
        cap = held * self.limits.page_size
        if num_positions > cap:
            raise InvariantError(
                f"{what} writes up to position {num_positions - 1} of row {row} but its {held} pages x "
                f"page_size {self.limits.page_size} hold {cap} positions (lookahead={self.limits.lookahead}, "
                f"S={self.limits.num_steps})"
            )

    def check_covers_rows(self, rows: list[int], ends: list[int], what: str) -> None:
        """`check_covers` for a batch: row rows[i] must cover positions [0, ends[i])."""
        cap = self.limits.page_size
        pages = self._pages
        for row, end in zip(rows, ends):
            if end > len(pages[row]) * cap:
                self.check_covers(row, end, f"{what} of row {row}")

    def pages_in_use(self) -> int:
        return sum(len(p) for p in self._pages.values())
