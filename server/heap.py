"""Keep a long-lived server's RSS following what it holds rather than the most it ever
held: few malloc arenas, and their free pages given back to the OS now and then.

glibc's malloc keeps freed memory in its arenas (one per thread that allocated: the
event loop, the engine, XLA's and aiohttp's workers), fragmented between live blocks;
it returns a page to the OS only when the top of an arena is free. Under mixed load
(bursts, long prompts, disconnects) the soak saw the RSS floor creep up ~11 MiB a
minute with no live object growing (bench/results/NOTES.md). `malloc_trim(0)` walks
every arena and releases (madvise) each whole free page in it, and the main arena's top;
it takes a few milliseconds, on a worker thread, every `interval_s`. A thread arena's top
stays resident until a free leaves it over the trim threshold: the few MiB by which the
soak's RSS still moves between quiet points.

Trimming alone still let the 5-minute soak's RSS floor creep up 1.6 MiB a minute: each
of the ~20 threads that allocate (XLA's pool, aiohttp's executor) gets an arena of its
own, up to 8 per core, each with its own fragments and high-water mark. Two arenas
(`limit_arenas`, glibc's M_ARENA_MAX, as MALLOC_ARENA_MAX=2 would) kept it flat (0.03
MiB/min in the same soak, bench/results/NOTES.md) at no cost in step time: the engine's
step allocates little on the host; XLA's buffers are large and few. One arena (everything
trimmable) kept the RSS flatter still but cost ~8 % of a served c=16 run's throughput.
"""

import asyncio
import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)


M_ARENA_MAX = -8  # glibc's mallopt parameter
ARENAS = 2


def _glibc(name: str):
    """A glibc function, or None on a C library without it (musl, macOS)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def limit_arenas(arenas: int = ARENAS) -> None:
    """Cap glibc's malloc arenas for threads started from now on (a no-op without glibc,
    or when MALLOC_ARENA_MAX is set: the operator's choice stands)."""
    mallopt = _glibc("mallopt")
    if mallopt is None or "MALLOC_ARENA_MAX" in os.environ:
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mallopt(M_ARENA_MAX, arenas)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def heap_bytes() -> dict[str, int] | None:
    """glibc malloc's bytes: in use in its arenas, free there (trimmed pages included, so
    not all of it resident) and mmapped (blocks too large for an arena); None without
    mallinfo2 (glibc < 2.33, musl, macOS). An RSS step that in_use and mmapped do not
    take is not a live malloc block: fragments, or memory malloc does not own (Python's
    own arenas, XLA's)."""
    mallinfo2 = _glibc("mallinfo2")
    if mallinfo2 is None:
        return None
    mallinfo2.argtypes, mallinfo2.restype = [], _Mallinfo2
    m = mallinfo2()
    return {"in_use": m.uordblks, "free": m.fordblks, "mmapped": m.hblkhd}


def _malloc_trim():
    """glibc's malloc_trim, or None on a C library without it."""
    trim = _glibc("malloc_trim")
    if trim is not None:
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
