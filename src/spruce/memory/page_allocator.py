"""Host-side page allocator. Page 0 (the dummy page) is never handed out."""

from __future__ import annotations

from spruce.errors import InvariantError
from spruce.limits import DUMMY_PAGE, Limits


class PageAllocator:
    """Hands out KV pages 1..num_pages-1. `alloc` returns None (never raises) when too few pages are free,
    so the scheduler can queue or preempt; double frees and foreign pages fail loudly."""

    def __init__(self, limits: Limits):
        self.num_pages = limits.num_pages
        self._free: list[int] = list(range(self.num_pages - 1, DUMMY_PAGE, -1))  # pop() yields low pages first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    @property
    def capacity(self) -> int:
        """Pages that can ever be handed out (all but the dummy page)."""
        return self.num_pages - 1

    def alloc(self, n: int) -> list[int] | None:
        if n < 0:
            raise InvariantError(f"alloc of {n} pages (expected n >= 0)")
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._used:
                raise InvariantError(f"free of page {p} that is not allocated (num_pages={self.num_pages})")
            self._used.remove(p)
            self._free.append(p)

    def check_accounting(self, expected_used: int) -> None:
        """Leak check: every page is either free or held by a live request, never both or neither."""
        if len(self._used) != expected_used or len(self._used) + len(self._free) != self.capacity:
            raise InvariantError(
                f"KV page leak: {len(self._used)} pages used, live requests hold {expected_used}, "
                f"{len(self._free)} free, capacity {self.capacity}"
            )
