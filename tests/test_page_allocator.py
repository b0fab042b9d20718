"""The page allocator under random use, and its errors."""

import random

import pytest

from jaxserve.page_allocator import NULL_PAGE, PageAllocationError, PageAllocator


def test_random_allocate_free_keeps_the_books_for_10000_steps():
    rng = random.Random(0)
    alloc = PageAllocator(257)
    owned: dict[int, list[int]] = {}
    for step in range(10_000):
        if owned and (rng.random() < 0.45 or not alloc.can_allocate(1)):
            owner = rng.choice(list(owned))
            alloc.free(owner, owned.pop(owner))
        else:
            n = rng.randint(0, 40)
            if alloc.can_allocate(n):
                owned[step] = alloc.allocate(step, n)
            else:
                with pytest.raises(PageAllocationError):
                    alloc.allocate(step, n)
        held = [p for pages in owned.values() for p in pages]
        assert len(held) == len(set(held)), "a page is owned twice"
        assert NULL_PAGE not in held
        assert alloc.num_free == alloc.num_usable - len(held)
        assert alloc.num_used == len(held)
    for owner, pages in owned.items():
        alloc.free(owner, pages)
    assert alloc.num_free == alloc.num_usable == 256


def test_double_free_and_foreign_free_are_errors():
    alloc = PageAllocator(8)
    a = alloc.allocate("a", 3)
    b = alloc.allocate("b", 2)
    with pytest.raises(PageAllocationError, match="belongs to 'a', not 'b'"):
        alloc.free("b", a[:1])
    alloc.free("a", a)
    with pytest.raises(PageAllocationError, match="already free"):
        alloc.free("a", a[:1])
    with pytest.raises(PageAllocationError, match="twice"):
        alloc.free("b", [b[0], b[0]])
    with pytest.raises(PageAllocationError, match="not an allocatable page"):
        alloc.free("b", [NULL_PAGE])
    assert alloc.num_free == 5  # the failed frees changed nothing
    with pytest.raises(PageAllocationError, match="asked for 6 pages, 5 free"):
        alloc.allocate("c", 6)


def test_null_page_is_never_handed_out():
    alloc = PageAllocator(5)
    assert sorted(alloc.allocate("x", 4)) == [1, 2, 3, 4]
    assert not alloc.can_allocate(1)
