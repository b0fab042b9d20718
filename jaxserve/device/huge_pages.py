"""The KV pool and the weights on 2 MiB pages, on a CPU under Linux.

Why: a decode step reads each row's KV pages scattered over a pool of hundreds of MB, and
a 4 KiB page of memory holds two of them: the TLB's few thousand entries cover a few MB.
Linux gives 2 MiB pages to memory asked for them (`madvise(MADV_HUGEPAGE)`, where the
machine's transparent huge pages are `madvise`, the common default) and collapses memory
already written into them (`MADV_COLLAPSE`, Linux 6.1+). XLA's CPU buffers are plain
heap memory, asked for nothing. So backed, a 16-row decode step took 0.985x as long at
context 512 and 0.992x at 264 (AMD Zen 4; bench/results/NOTES.md). Where the kernel
refuses (older Linux, THP `never`) the buffers stay as they were: this is only a hint.
"""

import ctypes
import sys

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


def back_with_huge_pages(arrays) -> int:
    """Ask that the 2 MiB-aligned spans of the CPU `arrays`' buffers be 2 MiB pages; returns
    the bytes the kernel collapsed into them (0 off Linux, or where it refused)."""
    if not sys.platform.startswith("linux"):
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    collapsed = 0
    for array in arrays:
        for shard in array.addressable_shards:
            if shard.device.platform != "cpu":
                continue
            address, size = shard.data.unsafe_buffer_pointer(), shard.data.nbytes
            start = -(-address // HUGE_PAGE) * HUGE_PAGE
            end = (address + size) // HUGE_PAGE * HUGE_PAGE
            if end <= start:  # no whole 2 MiB span inside (every buffer under 2 MiB)
                continue
            libc.madvise(start, end - start, MADV_HUGEPAGE)  # later growth, and khugepaged
            if libc.madvise(start, end - start, MADV_COLLAPSE) == 0:
                collapsed += end - start
    return collapsed
