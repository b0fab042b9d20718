"""The host-side page allocator: the single record of which KV page belongs to whom.

Plain Python, no jax. Page 0 is the reserved null page and is never handed out.
Allocation and freeing are O(1) per page (a stack of free pages and an owner
array), and every misuse (double free, freeing another owner's page) raises.
"""

from collections.abc import Hashable, Sequence

NULL_PAGE = 0  # reserved: padding reads and writes it, no sequence owns it
_FREE = None


class PageAllocationError(RuntimeError):
    """A page was freed twice, by a non-owner, or more pages were asked for than are free."""


class PageAllocator:
    """Free list over pages 1..num_pages-1 with an owner for every page in use."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"need at least 2 pages (one is the null page), got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, NULL_PAGE, -1))  # pop() gives 1 first
        self._owner: list[Hashable | None] = [_FREE] * num_pages

    @property
    def num_usable(self) -> int:
        """Pages that can ever be handed out (all but the null page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, owner: Hashable, n: int) -> list[int]:
        """Hand `n` free pages to `owner`."""
        if owner is _FREE:
            raise ValueError("owner must not be None")
        if n > len(self._free):
            raise PageAllocationError(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for page in pages:
            self._owner[page] = owner
        return pages

    def free(self, owner: Hashable, pages: Sequence[int]) -> None:
        """Return `owner`'s pages to the free list; all are checked before any is freed."""
        for page in pages:
            if not NULL_PAGE < page < self.num_pages:
                raise PageAllocationError(f"page {page} is not an allocatable page")
            holder = self._owner[page]
            if holder is _FREE:
                raise PageAllocationError(f"page {page} is already free (double free)")
            if holder != owner:
                raise PageAllocationError(f"page {page} belongs to {holder!r}, not {owner!r}")
        if len(set(pages)) != len(pages):
            raise PageAllocationError(f"pages {list(pages)} name a page twice (double free)")
        for page in pages:
            self._owner[page] = _FREE
            self._free.append(page)

    def owner_of(self, page: int) -> Hashable | None:
        """Who holds `page` (None when free)."""
        return self._owner[page]
