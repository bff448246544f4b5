"""Request-to-page table: one row per running-request slot, plus the dummy row used by padding."""

from __future__ import annotations

import contextlib

import torch

from spruce.errors import InvariantError
from spruce.limits import DUMMY_PAGE, Limits


class PageTable:
    """`table[row, i]` is the page holding positions [i*page_size, (i+1)*page_size) of the request in `row`.

    Unused entries point at the dummy page, so a stray read never leaves the pool; so do the columns whose pages
    were given back because no query of the row reads them again (`free_columns`: every layer's window has passed
    them), which keeps a request's columns in place. Rows are handed out
    host-side; the device tensor is updated only where pages are appended. Inside `batched()` appends are written
    to the device together when the block ends, one copy and one scatter for all of them: a decode step reserves
    pages for many requests, and one small copy each cost the engine thread ~0.8 ms apiece under a loaded server
    on the H100 (yappi: 40% of its time at concurrency 64). `check_written` (always on, before a forward reads the
    table) fails if an append is still pending.
    """

    def __init__(self, limits: Limits, device: torch.device):
        self.limits = limits
        self.table = torch.full(
            (limits.num_rows, limits.max_pages_per_request), DUMMY_PAGE, dtype=torch.int32, device=device
        )  # [rows, max_pages_per_request]
        self._free_rows = list(range(limits.max_running_requests - 1, -1, -1))
        self._pages: dict[int, list[int]] = {}
        self._pending: list[tuple[int, int, list[int]]] | None = None  # inside batched(): (row, start, pages)

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
        """The row's columns: its page per page_size positions (the dummy page where one was freed)."""
        return self._pages[row]

    def live_pages(self, row: int) -> list[int]:
        """The pages the row holds (its columns less the freed ones)."""
        return [p for p in self._pages[row] if p != DUMMY_PAGE]

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
            if self._pending is not None:
                self._pending.append((row, start, list(pages)))
            else:
                self._write([(row, start, pages)])
            held.extend(pages)

    @contextlib.contextmanager
    def batched(self):
        """Appends inside the block reach the device when it ends (also when it raises: the host's pages and
        the device's must agree), in one host-to-device copy and one scatter. Not reentrant."""
        if self._pending is not None:
            raise InvariantError("PageTable.batched() entered twice")
        self._pending = []
        try:
            yield
        finally:
            pending, self._pending = self._pending, None
            self._write(pending)

    def _write(self, pending: list[tuple[int, int, list[int]]]) -> None:
        """Write runs of pages (row, first column, pages) into the device table: one copy and one scatter."""
        if not pending:
            return
        rows = [row for row, _, pages in pending for _ in pages]
        cols = [start + i for _, start, pages in pending for i in range(len(pages))]
        values = [page for _, _, pages in pending for page in pages]
        host = torch.tensor([rows, cols, values], dtype=torch.int64)  # [3, n]
        rows_d, cols_d, values_d = host.to(self.table.device, non_blocking=True).unbind(0)
        self.table[rows_d, cols_d] = values_d.to(self.table.dtype)

    def check_written(self, what: str) -> None:
        """Always-on: no append is waiting for the end of a `batched()` block when `what` reads the table."""
        if self._pending:
            raise InvariantError(f"{what} reads the page table while {len(self._pending)} appended page runs "
                                 f"are not on the device yet (inside PageTable.batched())")

    def free_columns(self, row: int, start: int, stop: int) -> list[int]:
        """Give back columns [start, stop) of `row` (positions start*page_size .. stop*page_size - 1): the host's
        entries and the device's become the dummy page (inside `batched()`, at its end), so no later read of the
        row reaches a page another request may hold by then. Returns the pages that were there, for the
        allocator. E.g. page_size 16, columns [0, 3): positions 0..47."""
        held = self._pages[row]
        if not 0 <= start <= stop <= len(held):
            raise InvariantError(f"free of columns [{start}, {stop}) of row {row}, which holds {len(held)} columns")
        pages = [p for p in held[start:stop] if p != DUMMY_PAGE]
        if len(pages) != stop - start:
            raise InvariantError(f"free of columns [{start}, {stop}) of row {row}: some are freed already ({held})")
        held[start:stop] = [DUMMY_PAGE] * (stop - start)
        run = (row, start, [DUMMY_PAGE] * (stop - start))
        if self._pending is not None:
            self._pending.append(run)
        else:
            self._write([run])
        return pages

    def release_row(self, row: int) -> list[int]:
        """Frees the row; returns its pages (the live ones) for the allocator. The row is reset to the dummy
        page."""
        pages = self._pages.pop(row)
        if pages:
            self.table[row, : len(pages)] = DUMMY_PAGE
        self._free_rows.append(row)
        return [p for p in pages if p != DUMMY_PAGE]

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

    def slots(self, row: int, start: int, n: int) -> list[int]:
        """The KV cache slot of each of positions start .. start + n - 1 of `row`, from the pages the host knows it
        holds, as the device table maps them (positions past its pages, or of a row not handed out: the dummy page,
        as the table's unused entries). One range per page, so a prompt chunk costs the host a few calls a page."""
        ps = self.limits.page_size
        pages = self._pages.get(row, ())
        out: list[int] = []
        pos, end = start, start + n
        while pos < end:
            index = pos // ps
            stop = min(end, (index + 1) * ps)
            first = (pages[index] if index < len(pages) else DUMMY_PAGE) * ps + pos % ps
            out.extend(range(first, first + stop - pos))
            pos = stop
        return out

    def pages_in_use(self) -> int:
        """Pages the rows hold (freed columns not counted)."""
        return sum(len(p) - p.count(DUMMY_PAGE) for p in self._pages.values())
