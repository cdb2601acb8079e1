"""Page bookkeeping of the pool: which pages are live, who shares them, what was reused.

Pages are handed out lowest id first at the start and last-freed-first afterwards (a
stack), so a run is deterministic and freed pages are reused while they are warm.
Every call validates its whole argument before changing anything.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from .errors import PageAlreadyFree, PoolExhausted, ServingError


@dataclass(frozen=True)
class PoolStats:
    """Counters of a pool; `reuses` counts allocations of a page that had been freed."""

    num_pages: int
    live: int
    free: int
    peak_live: int
    allocations: int
    frees: int
    reuses: int
    pages_copied: int


class PageAllocator:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._refs = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() yields page 0 first
        self._ever_used = [False] * num_pages
        self._peak_live = 0
        self._allocations = self._frees = self._reuses = self.pages_copied = 0
        self.version = 0  # bumped by every change of a reference count

    # -- queries -----------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_live(self) -> int:
        return self.num_pages - len(self._free)

    def ref_count(self, page: int) -> int:
        return self._refs[self.check_page(page)]

    def is_live(self, page: int) -> bool:
        return self.ref_count(page) > 0

    def stats(self) -> PoolStats:
        return PoolStats(self.num_pages, self.num_live, self.num_free, self._peak_live,
                         self._allocations, self._frees, self._reuses, self.pages_copied)

    def snapshot(self) -> tuple:
        """Everything that defines the allocator's state, for whole-state assertions."""
        return (tuple(self._refs), tuple(self._free), self.stats())

    def check_page(self, page) -> int:
        try:
            p = operator.index(page)
        except TypeError:
            raise ServingError("page_id", f"page id must be an int, got {page!r}") from None
        if isinstance(page, bool) or not 0 <= p < self.num_pages:
            raise ServingError("page_id", f"page id {page!r} is outside the pool [0, {self.num_pages})")
        return p

    # -- changes -----------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """`n` fresh pages, each with reference count 1; all or nothing."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ServingError("capacity", f"a page count must be an int >= 0, got {n!r}")
        if n > len(self._free):
            raise PoolExhausted(f"need {n} free pages, the pool has {len(self._free)} of "
                                f"{self.num_pages} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
            self._reuses += self._ever_used[p]
            self._ever_used[p] = True
        self._allocations += n
        self.version += 1
        self._peak_live = max(self._peak_live, self.num_live)
        return pages

    def share(self, pages) -> None:
        """One more holder for each page (a fork); every page must be live."""
        pages = [self.check_page(p) for p in pages]
        for p in pages:
            if self._refs[p] == 0:
                raise PageAlreadyFree(f"page {p} is free; only a live page can be shared")
        for p in pages:
            self._refs[p] += 1
        self.version += 1

    def free(self, pages) -> list[int]:
        """Drops one reference per listed page; returns the pages that became free.

        A page listed more times than it has references is an "already free" error,
        and then no reference at all is dropped.
        """
        pages = [self.check_page(p) for p in pages]
        drops: dict[int, int] = {}
        for p in pages:
            drops[p] = drops.get(p, 0) + 1
            if drops[p] > self._refs[p]:
                raise PageAlreadyFree(f"page {p} is already free" if self._refs[p] == 0 else
                                      f"page {p} has {self._refs[p]} reference(s) but is freed {drops[p]} times")
        freed = []
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
                freed.append(p)
        self._frees += len(freed)
        self.version += 1
        return freed
