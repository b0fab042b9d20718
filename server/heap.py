"""Give the C heap's free pages back to the OS now and then, so a long-lived server's RSS
follows what it holds rather than the most it ever held.

glibc's malloc keeps freed memory in its arenas (one per thread that allocated: the
event loop, the engine, XLA's and aiohttp's workers), fragmented between live blocks;
it returns a page to the OS only when the top of an arena is free. Under mixed load
(bursts, long prompts, disconnects) the soak saw the RSS floor creep up ~11 MiB a
minute with no live object growing (bench/results/NOTES.md). `malloc_trim(0)` walks
every arena and releases (madvise) each whole free page in it, not just the top; it
takes a few milliseconds, on a worker thread, every `interval_s`.
"""

import asyncio
import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)


def _malloc_trim():
    """glibc's malloc_trim, or None on a C library without it (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


async def trim_periodically(interval_s: float) -> None:
    """Trim the heap every `interval_s` seconds until cancelled (no-op without glibc)."""
    trim = _malloc_trim()
    if trim is None or interval_s <= 0:
        return
    log.info("returning free heap pages to the OS every %g s (--heap-trim-interval-s)",
             interval_s)
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(interval_s)
        await loop.run_in_executor(None, trim, 0)
