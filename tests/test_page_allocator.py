"""The page allocator and prefix cache under random use, and their errors."""

import random

import pytest

from jaxserve.host.page_allocator import NULL_PAGE, PageAllocationError, PageAllocator, page_keys


def check_states(alloc: PageAllocator, held: dict[str, list[int]]) -> None:
    """Every page is free, owned or cached, never two at once; owner sets match `held`."""
    free, cached = set(alloc._free), set(alloc._lru)
    owned = {p for p in range(1, alloc.num_pages) if alloc.owners_of(p)}
    assert len(free) == len(alloc._free), "a page is on the free list twice"
    assert not (free & cached) and not (free & owned) and not (cached & owned)
    assert free | cached | owned == set(range(1, alloc.num_pages))
    assert NULL_PAGE not in free | cached | owned
    for owner, pages in held.items():
        assert all(owner in alloc.owners_of(p) for p in pages)
    refcounts = {p: len(alloc.owners_of(p)) for p in owned}
    assert sum(refcounts.values()) == sum(len(p) for p in held.values())
    assert alloc.num_free + alloc.num_cached + alloc.num_used == alloc.num_usable


def test_random_allocate_share_register_free_evict_for_10000_steps():
    rng = random.Random(0)
    alloc = PageAllocator(65)
    held: dict[str, list[int]] = {}
    prompts = [[rng.randrange(50) for _ in range(rng.randint(4, 40))] for _ in range(12)]
    for step in range(10_000):
        if held and (rng.random() < 0.4 or not alloc.can_allocate(1)):
            owner = rng.choice(list(held))
            alloc.free(owner, held.pop(owner))
        else:
            prompt = rng.choice(prompts)  # shared prompts make prefix hits
            keys = page_keys(prompt, 4)
            shared = alloc.match_prefix(keys)
            owner = f"s{step}"
            alloc.share(owner, shared)
            need = rng.randint(0, 6) + len(keys) - len(shared)
            if alloc.can_allocate(need):
                pages = shared + alloc.allocate(owner, need)
                for page, key in zip(pages, keys):
                    alloc.register(page, key)  # pages become cached content once written
                held[owner] = pages
            else:
                with pytest.raises(PageAllocationError):
                    alloc.allocate(owner, need)
                alloc.free(owner, shared)
        check_states(alloc, held)
    for owner, pages in held.items():
        alloc.free(owner, pages)
    assert alloc.num_used == 0 and alloc.num_free + alloc.num_cached == alloc.num_usable


def test_shared_prefix_is_reused_and_evicted_last_recently_used_first():
    alloc = PageAllocator(5)  # 4 usable pages
    keys = page_keys(list(range(8)), 4)
    a = alloc.allocate("a", 2)
    for page, key in zip(a, keys):
        alloc.register(page, key)
    assert alloc.match_prefix(keys) == a
    alloc.share("b", a)
    alloc.free("a", a)
    assert alloc.num_used == 2  # b still holds them
    alloc.free("b", a)
    assert (alloc.num_free, alloc.num_cached) == (2, 2)
    alloc.match_prefix(keys[:1])  # a[0] touched: a[1] is now the oldest cached page
    got = alloc.allocate("c", 3)  # 2 free, then evict a[1]
    assert a[1] in got and a[0] not in got
    assert alloc.match_prefix(keys) == [a[0]]  # the chain stops at the evicted page


def test_page_keys_chain_prefixes_and_salt_separates_tenants():
    a = page_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = page_keys([1, 2, 3, 4, 9, 9, 9, 9], 4)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert page_keys([5, 6, 7, 8], 4)[0] != a[1]  # same tokens, different prefix
    assert page_keys([1, 2, 3, 4], 4, salt="tenant-a") != page_keys([1, 2, 3, 4], 4, salt="b")


def test_double_free_and_foreign_free_are_errors():
    alloc = PageAllocator(8)
    a = alloc.allocate("a", 3)
    b = alloc.allocate("b", 2)
    with pytest.raises(PageAllocationError, match=r"belongs to \[\"'a'\"\], not 'b'"):
        alloc.free("b", a[:1])
    alloc.free("a", a)
    with pytest.raises(PageAllocationError, match="double free"):
        alloc.free("a", a[:1])
    with pytest.raises(PageAllocationError, match="twice"):
        alloc.free("b", [b[0], b[0]])
    with pytest.raises(PageAllocationError, match="not an allocatable page"):
        alloc.free("b", [NULL_PAGE])
    assert alloc.num_free == 5  # the failed frees changed nothing
    with pytest.raises(PageAllocationError, match="asked for 6 pages, 5 free and 0 cached"):
        alloc.allocate("c", 6)
    with pytest.raises(PageAllocationError, match="no cached content"):
        alloc.share("c", b[:1])


def test_null_page_is_never_handed_out():
    alloc = PageAllocator(5)
    assert sorted(alloc.allocate("x", 4)) == [1, 2, 3, 4]
    assert not alloc.can_allocate(1)


def test_page_keys_chain_from_a_parent():
    """Keys computed page by page from the previous key equal the whole prefix's keys (the
    scheduler hashes only newly filled pages)."""
    tokens = list(range(40, 72))
    whole = page_keys(tokens, 4, "tenant")
    head = page_keys(tokens[:12], 4, "tenant")
    assert head + page_keys(tokens[12:], 4, "tenant", parent=head[-1]) == whole
    assert page_keys(tokens, 4, "other") != whole
