"""Keep a served step's buffers mapped between steps, and a long-lived server's RSS
following what it holds rather than the most it ever held: one malloc arena that never
maps a block of its own, and its free pages given back to the OS now and then.

Each step XLA allocates its temporary buffers afresh (posix_memalign, on the thread that
runs the step), tens of MiB: 18 at the default 16 rows, 72 at `--max-batch 64`. glibc
serves a block past its mmap threshold (32 MiB at most) with a mapping of its own and
unmaps it at the free, and a thread's arena grows in heaps of 64 MiB at most, so such a
block is mapped afresh whatever the thresholds: a 64-row decode step faulted ~10
thousand pages back in every step (73 against 60 ms; served c=64 with `--max-batch 64`
1.12x the throughput once they stayed; bench/results/NOTES.md). Below the ceiling a
thread arena's emptied heap was unmapped as well (150-580 thousand faults in a served
c=16 run, ~5 % of its throughput). So the server keeps glibc to its main arena, which
grows by brk without that cap, maps no block of its own (M_MMAP_MAX 0), and trims the
arena's top only past 1 GiB: a step's temporaries come from memory the steps before
faulted in. One arena also held the RSS ~130 MiB below two and flatter under the soak;
served c=16 was level with two arenas (9 alternated rounds, 0.96-1.10x).

glibc's malloc keeps freed memory in its arena, fragmented between live blocks; it
returns a page to the OS only when the arena's top is trimmed. Under mixed load (bursts,
long prompts, disconnects) the soak saw the RSS floor creep up ~11 MiB a minute with no
live object growing (bench/results/NOTES.md). `malloc_trim(0)` releases (madvise) each
whole free page of every arena and the main arena's top; it takes a few milliseconds, on
a worker thread, every `interval_s`. Where the operator asks for more arenas
(MALLOC_ARENA_MAX), a thread arena's top is trimmed only by a free that leaves it over
the threshold: for the moment of the release the threshold is 0 and a fresh thread,
which malloc attaches to one of the arenas in turn, frees a block in each
(`_free_in_an_arena`).
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
# the server sets where the operator set none (the module's docstring). Setting any of
# them also stops glibc's dynamic thresholds.
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
SETTINGS = (
    (M_ARENA_MAX, "MALLOC_ARENA_MAX", 1),
    (M_MMAP_MAX, "MALLOC_MMAP_MAX_", 0),
    (M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_", 1 << 30),
)
# a block freed to trim its arena's top: past glibc's 64 KiB consolidation threshold,
# below which a free does not trim
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
    without glibc. With thread arenas (the operator's MALLOC_ARENA_MAX), every other
    thread allocates on as it was meanwhile: for the moment the threshold is 0, a free
    elsewhere that reaches a top trims it too."""
    trim, mallopt = _glibc("malloc_trim"), _mallopt()
    malloc, free = _glibc("malloc"), _glibc("free")
    if None in (trim, mallopt, malloc, free):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)  # the main arena's top too
    arenas = _setting(M_ARENA_MAX)
    if arenas == 1:
        return True
    malloc.argtypes, malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    free.argtypes, free.restype = [ctypes.c_void_p], None
    mallopt(M_TRIM_THRESHOLD, 0)
    try:
        for _ in range(2 * arenas):  # each arena in turn, twice
            _free_in_an_arena(malloc, free)
    finally:
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
