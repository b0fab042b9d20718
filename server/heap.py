"""Keep a long-lived server's RSS following what it holds rather than the most it ever
held: few malloc arenas, and their free pages given back to the OS now and then.

glibc's malloc keeps freed memory in its arenas (one per thread that allocated: the
event loop, the engine, XLA's and aiohttp's workers), fragmented between live blocks;
it returns a page to the OS only when the top of an arena is free. Under mixed load
(bursts, long prompts, disconnects) the soak saw the RSS floor creep up ~11 MiB a
minute with no live object growing (bench/results/NOTES.md). `malloc_trim(0)` walks
every arena and releases (madvise) each whole free page in it, and the main arena's top;
it takes a few milliseconds, on a worker thread, every `interval_s`.

A thread arena's top it leaves resident: glibc trims that only when a free in the arena
leaves the top over the trim threshold, which its dynamic scheme raises to 64 MiB, as
large as a thread arena's heap, so never. The soak's RSS moved by that top's few MiB
from one quiet point to the next (up to 4.8 MiB, each move in that heap). A fixed 2 MiB
threshold cost ~10 % of a served c=16 run (each step faulted its buffers in again), so
the threshold is lowered only for a moment, every `interval_s`: a fresh thread, which
malloc attaches to one of the arenas in turn, frees a block there (`_free_in_an_arena`),
and that free trims its arena's top.

Trimming alone still let the 5-minute soak's RSS floor creep up 1.6 MiB a minute: each
of the ~20 threads that allocate (XLA's pool, aiohttp's executor) gets an arena of its
own, up to 8 per core, each with its own fragments and high-water mark. Two arenas
(`configure_malloc`, glibc's M_ARENA_MAX, as MALLOC_ARENA_MAX=2 would) kept it flat (0.03
MiB/min in the same soak, bench/results/NOTES.md) at no cost in step time: the engine's
step allocates little on the host; XLA's buffers are large and few. One arena (everything
trimmable) kept the RSS flatter still but cost ~8 % of a served c=16 run's throughput.

Each step XLA allocates its temporary buffers afresh (tens of MiB, under the mmap
threshold, so from the executing thread's arena). Where that arena's heap (64 MiB at most)
had no room, malloc mapped a new heap for them, and the free that emptied it unmapped it
again (glibc keeps an empty heap only while the heap before it has less than M_TOP_PAD
free): a served c=16 run did so ~200-600 times, and its steps faulted 150-580 thousand
pages back in, ~5 % of its throughput (bench/results/NOTES.md). A 64 MiB top pad keeps
such a heap mapped; `release_free_pages` lowers it for a moment, as it does the trim
threshold.
"""

import asyncio
import ctypes
import ctypes.util
import functools
import logging
import os
import threading

log = logging.getLogger(__name__)

# glibc's mallopt parameters, the environment variables that set them, and the values
# the server sets where the operator set none: two arenas, the mmap and trim thresholds
# fixed at the ceilings glibc's dynamic scheme reaches on a 64-bit machine within the
# first steps (setting one fixes both; served c=16 against the dynamic scheme without the
# top's release: 0.975, median of 8 alternated rounds, 0.91-1.02: noise here), and a top
# pad that keeps a thread arena's emptied heap mapped (the module's docstring).
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -2, -3, -8
SETTINGS = (
    (M_ARENA_MAX, "MALLOC_ARENA_MAX", 2),
    (M_MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_", 32 << 20),
    (M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_", 64 << 20),
    (M_TOP_PAD, "MALLOC_TOP_PAD_", 64 << 20),
)
# a block freed to trim its arena's top: past glibc's 64 KiB consolidation threshold,
# below which a free does not trim, and under the mmap threshold, past which it is no
# arena's
PROBE_BYTES = 96 << 10


@functools.cache
def _glibc(name: str):
    """A glibc function, or None on a C library without it (musl, macOS). Looked up once:
    find_library runs `ldconfig -p` (~2 ms, a process), and each heap trim needs four."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def _setting(param: int) -> int:
    """The value of a mallopt parameter: the operator's environment's, else SETTINGS'."""
    _, name, value = next(s for s in SETTINGS if s[0] == param)
    return int(os.environ.get(name, value))


def _mallopt():
    mallopt = _glibc("mallopt")
    if mallopt is not None:
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def configure_malloc() -> None:
    """Cap glibc's malloc arenas for threads started from now on and fix its thresholds
    (a no-op without glibc; a setting the environment makes stands)."""
    mallopt = _mallopt()
    if mallopt is None:
        return
    for param, name, value in SETTINGS:
        if name not in os.environ:
            mallopt(param, value)


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


def _free_in_an_arena(malloc, free) -> None:
    """Allocate and free PROBE_BYTES on a thread of its own: malloc attaches a new thread
    to the next arena in turn, and the free trims that arena's top to the threshold."""

    def probe():
        free(malloc(PROBE_BYTES))

    thread = threading.Thread(target=probe, name="heap-trim")
    thread.start()
    thread.join()


def release_free_pages() -> bool:
    """Give the OS every whole free page of every arena, their tops included; False
    without glibc. Every other thread allocates on as it was meanwhile: for the moment
    the threshold and the pad are 0, a free elsewhere that reaches a top trims it too."""
    trim, mallopt = _glibc("malloc_trim"), _mallopt()
    malloc, free = _glibc("malloc"), _glibc("free")
    if None in (trim, mallopt, malloc, free):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    malloc.argtypes, malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    free.argtypes, free.restype = [ctypes.c_void_p], None
    trim(0)
    mallopt(M_TRIM_THRESHOLD, 0)
    mallopt(M_TOP_PAD, 0)
    try:
        for _ in range(2 * _setting(M_ARENA_MAX)):  # each arena in turn, twice
            _free_in_an_arena(malloc, free)
    finally:
        mallopt(M_TOP_PAD, _setting(M_TOP_PAD))
        mallopt(M_TRIM_THRESHOLD, _setting(M_TRIM_THRESHOLD))
    return True


async def trim_periodically(interval_s: float) -> None:
    """Release free heap pages every `interval_s` seconds until cancelled (a no-op without
    glibc)."""
    if interval_s <= 0 or _glibc("malloc_trim") is None:
        return
    log.info("returning free heap pages to the OS every %g s (--heap-trim-interval-s)",
             interval_s)
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(interval_s)
        await loop.run_in_executor(None, release_free_pages)
