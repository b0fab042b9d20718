"""The host-side page allocator and prefix cache: the one record of every KV page's state.

Plain Python, no jax. Page 0 is the reserved null page and is never handed out.
Every other page is in exactly one state:

- free: on the free list;
- owned: held by one or more sequences (shared pages are a cached prefix);
- cached: owned by nobody but holding a full page of known content; kept in an
  LRU and evicted only when the free list runs dry.

A full page's content is named by a key chained from its parent's key, so equal
keys mean equal whole prefixes (`page_keys`). Allocation and freeing are O(1) per
page, and every misuse (double free, freeing a page one does not hold) raises.
"""

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence

NULL_PAGE = 0  # reserved: padding reads and writes it, no sequence owns it


class PageAllocationError(RuntimeError):
    """A page was freed twice, by a non-owner, or more pages were asked for than exist."""


def page_keys(
    token_ids: Sequence[int], page_size: int, salt: str = "", parent: bytes | None = None
) -> list[bytes]:
    """Keys of the full pages of `token_ids`: each hashes its tokens and its parent's key.

    A `salt` (the tenant) gives each tenant its own key space, so no tenant can
    learn by timing whether another tenant sent a prompt. `parent`, the key of the
    page before `token_ids` (whose salt it carries), continues a chain.
    """
    keys = []
    if parent is None:
        parent = salt.encode()
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        digest = hashlib.blake2b(parent, digest_size=16)
        # the ids as 8-byte integers: a third of the time of joining their digits
        digest.update(array("q", token_ids[start : start + page_size]).tobytes())
        parent = digest.digest()
        keys.append(parent)
    return keys


class PageAllocator:
    """Free list, owners, and the LRU of cached pages over pages 1..num_pages-1."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"need at least 2 pages (one is the null page), got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, NULL_PAGE, -1))  # pop() gives 1 first
        self._owners: list[set[Hashable]] = [set() for _ in range(num_pages)]
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages, oldest first
        self._key_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self.num_evictions = 0  # cached pages reclaimed for new allocations, ever

    # ------------------------------------------------------------------ counts

    @property
    def num_usable(self) -> int:
        """Pages that can ever be handed out (all but the null page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages on the free list (cached pages are not counted)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Pages nobody owns that hold cached content (evictable)."""
        return len(self._lru)

    @property
    def num_used(self) -> int:
        """Pages owned by at least one sequence."""
        return self.num_usable - self.num_free - self.num_cached

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free) + len(self._lru)

    def owners_of(self, page: int) -> frozenset:
        return frozenset(self._owners[page])

    # ------------------------------------------------------------------ verbs

    def allocate(self, owner: Hashable, n: int) -> list[int]:
        """Hand `n` pages to `owner`: free ones first, then the least recently used cached."""
        if not self.can_allocate(n):
            raise PageAllocationError(
                f"asked for {n} pages, {len(self._free)} free and {len(self._lru)} cached"
            )
        pages = []
        for _ in range(n):
            page = self._free.pop() if self._free else self._evict()
            self._owners[page].add(owner)
            pages.append(page)
        return pages

    def share(self, owner: Hashable, pages: Sequence[int]) -> None:
        """Let `owner` hold cached or owned pages too (a reused prefix)."""
        for page in pages:
            if page not in self._key_of:
                raise PageAllocationError(f"page {page} holds no cached content to share")
            if owner in self._owners[page]:
                raise PageAllocationError(f"{owner!r} already holds page {page}")
        for page in pages:
            self._lru.pop(page, None)
            self._owners[page].add(owner)

    def free(self, owner: Hashable, pages: Sequence[int]) -> None:
        """Drop `owner`'s hold on its pages; all are checked before any is released.

        A page nobody holds any more goes to the cached LRU if its content is
        registered, else back to the free list.
        """
        if len(set(pages)) != len(pages):
            raise PageAllocationError(f"pages {list(pages)} name a page twice (double free)")
        for page in pages:
            if not NULL_PAGE < page < self.num_pages:
                raise PageAllocationError(f"page {page} is not an allocatable page")
            holders = self._owners[page]
            if not holders:
                raise PageAllocationError(f"page {page} is not held by anyone (double free)")
            if owner not in holders:
                raise PageAllocationError(
                    f"page {page} belongs to {sorted(map(repr, holders))}, not {owner!r}"
                )
        for page in pages:
            holders = self._owners[page]
            holders.discard(owner)
            if holders:
                continue
            if page in self._key_of:
                self._lru[page] = None
            else:
                self._free.append(page)

    # ------------------------------------------------------------------ prefix cache

    def register(self, page: int, key: bytes) -> None:
        """Record that owned `page` holds the full page named `key` (first writer wins)."""
        if not self._owners[page]:
            raise PageAllocationError(f"page {page} is not owned: only written pages register")
        if key in self._page_of or page in self._key_of:
            return
        self._page_of[key] = page
        self._key_of[page] = key

    def match_prefix(self, keys: Sequence[bytes]) -> list[int]:
        """Pages holding the longest run of leading `keys` (touched as recently used)."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
            if page in self._lru:
                self._lru.move_to_end(page)
        return pages

    def _evict(self) -> int:
        page, _ = self._lru.popitem(last=False)
        del self._page_of[self._key_of.pop(page)]
        self.num_evictions += 1
        return page
