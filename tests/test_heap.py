"""The server's heap (server/heap.py): glibc malloc's live bytes as a metric, so a soak can
tell an RSS step of live malloc blocks from one of fragments or of memory malloc does not
own; and the free pages it gives back, a thread arena's top included."""

import json
import os
import subprocess
import sys
import textwrap

from serving import ROOT

# a test's own process with glibc's malloc and free at hand (sys.argv[1]: a folder to
# import from); CONFIGURED: its malloc configured as `jaxserve serve` configures it
LIBC = textwrap.dedent("""
    import ctypes, json, os, resource, sys, threading
    sys.path.insert(0, sys.argv[1])
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
""")
CONFIGURED = LIBC + textwrap.dedent("""
    from server import heap
    heap.configure_malloc()
""")


def test_the_heap_metric_follows_mallocs_live_blocks():
    """In a process of its own: in the suite's, an arena may hold a free chunk that takes
    the 64 MiB block, which then is in use rather than mmapped (CI saw it once)."""
    script = LIBC + textwrap.dedent("""
        from server.heap import heap_bytes
        from server.metrics import Metrics

        def metric(kind):
            line = f'jaxserve:heap_bytes{{kind="{kind}"}} '
            text = Metrics().render().decode()
            return float(next(x for x in text.splitlines() if x.startswith(line)).split()[-1])

        before = heap_bytes()
        large = libc.malloc(64 << 20)  # past the mmap threshold: mmapped
        small = [libc.malloc(4096) for _ in range(2048)]  # 8 MiB in the arenas
        held = {"mmapped": metric("mmapped"), "in_use": metric("in_use")}
        libc.free(large)
        for block in small:
            libc.free(block)
        print(json.dumps([before, held, metric("mmapped")]))
    """)
    out = subprocess.run([sys.executable, "-c", script, str(ROOT)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    before, held, mmapped_after = json.loads(out)
    assert before is not None and before["in_use"] > 0  # glibc >= 2.33 here
    assert held["mmapped"] >= before["mmapped"] + (64 << 20)
    assert held["in_use"] >= before["in_use"] + (8 << 20)
    assert mmapped_after < before["mmapped"] + (64 << 20)


def test_free_pages_at_a_thread_arenas_top_go_back_to_the_os():
    """A thread that keeps its arena (as XLA's workers do) frees 24 MiB it wrote into the
    arena's top: malloc_trim leaves them resident, release_free_pages does not. In a
    process of its own, configured as `jaxserve serve` configures its malloc."""
    script = CONFIGURED + textwrap.dedent("""
        from soak import resident_by_mapping
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        done, stay = threading.Event(), threading.Event()

        def worker():  # a block from the arena's top, under the mmap threshold
            block = libc.malloc(24 << 20)
            ctypes.memset(block, 1, 24 << 20)
            libc.free(block)
            done.set()
            stay.wait()

        thread = threading.Thread(target=worker)
        thread.start()
        done.wait()
        arenas = [resident_by_mapping(os.getpid())["arenas"]]
        libc.malloc_trim(0)
        arenas.append(resident_by_mapping(os.getpid())["arenas"])
        assert heap.release_free_pages()
        arenas.append(resident_by_mapping(os.getpid())["arenas"])
        stay.set()
        thread.join()
        print(json.dumps(arenas))
    """)
    out = subprocess.run([sys.executable, "-c", script, str(ROOT / "bench")], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    written, after_malloc_trim, released = json.loads(out)
    assert written >= 24
    assert after_malloc_trim >= 24  # glibc: malloc_trim leaves a thread arena's top
    assert released < 1, (written, after_malloc_trim, released)


def test_a_thread_arenas_emptied_heap_stays_mapped():
    """XLA allocates a step's temporaries afresh each step, from the executing thread's
    arena. Where its heap has no room, malloc maps a new one, and glibc's default top pad
    (128 KiB) let the free that emptied it unmap it again, so every step faulted its
    temporaries' pages back in (a served c=16 run: 150-580 thousand faults). The server's
    64 MiB pad keeps it: ten 29 MiB steps fault their pages in once. With the default
    pad (the environment's, which configure_malloc leaves), ten times."""
    script = CONFIGURED + textwrap.dedent("""
        faults = []

        def worker():  # an arena of its own, its first heap ~40 MiB full
            held = [libc.malloc(20 << 20) for _ in range(2)]
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            for _ in range(10):  # a step's temporaries: no room for them in that heap
                block = libc.malloc(29 << 20)
                ctypes.memset(block, 1, 29 << 20)
                libc.free(block)
            faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
            for block in held:
                libc.free(block)

        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        print(json.dumps(faults[0]))
    """)

    def faults(env):
        return json.loads(subprocess.run(
            [sys.executable, "-c", script, str(ROOT)], cwd=ROOT, env={**os.environ, **env},
            capture_output=True, text=True, timeout=60, check=True).stdout)

    block_pages = (29 << 20) // 4096
    assert faults({}) < 2 * block_pages
    assert faults({"MALLOC_TOP_PAD_": str(128 << 10)}) > 8 * block_pages
