"""The server's heap metric (server/heap.py): glibc malloc's live bytes, so a soak can tell
an RSS step of live malloc blocks from one of fragments or of memory malloc does not own."""

import ctypes

from server.heap import heap_bytes
from server.metrics import Metrics


def heap_metric(kind: str) -> float:
    line = f'jaxserve:heap_bytes{{kind="{kind}"}} '
    text = Metrics().render().decode()
    return float(next(x for x in text.splitlines() if x.startswith(line)).split()[-1])


def test_the_heap_metric_follows_mallocs_live_blocks():
    before = heap_bytes()
    assert before is not None and before["in_use"] > 0  # glibc >= 2.33 here
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    large = libc.malloc(64 << 20)  # past the mmap threshold: mmapped
    small = [libc.malloc(4096) for _ in range(2048)]  # 8 MiB in the arenas
    try:
        assert heap_metric("mmapped") >= before["mmapped"] + (64 << 20)
        assert heap_metric("in_use") >= before["in_use"] + (8 << 20)
    finally:
        libc.free(large)
        for block in small:
            libc.free(block)
    assert heap_metric("mmapped") < before["mmapped"] + (64 << 20)
