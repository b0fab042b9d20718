"""Compile the C++ CPU kernels on first use, for the CPU they run on, and cache the library.

The library is built with `-march=native`, so it is keyed by the CPU's flags as well as
by its source, the compiler and jaxlib (whose FFI headers it includes): a cache copied
to another machine is rebuilt there, never run on a CPU without its instructions.
Builds land under `$JAXSERVE_KERNEL_CACHE` (default `~/.cache/jaxserve/kernels`),
written to a temporary name and renamed, so concurrent processes never load a
half-written file. Without a C++ compiler `build` raises `KernelUnavailable` and the
caller serves with the XLA path instead.
"""

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jaxlib

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp-simd", "-std=c++20",
         "-shared", "-fPIC")


class KernelUnavailable(RuntimeError):
    """The kernel library cannot be built here; the message says why."""


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "jaxserve" / "kernels"
    return Path(os.environ.get("JAXSERVE_KERNEL_CACHE", default))


def cpu_flags() -> str:
    """This CPU's flags line (/proc/cpuinfo), or what platform knows of it."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def compiler() -> str | None:
    """The C++ compiler on PATH (g++, or $CXX), if any."""
    return shutil.which(os.environ.get("CXX", "g++"))


def build(name: str) -> Path:
    """The shared library of `<name>.cc`, compiled here unless a matching build is cached."""
    compiler_path = compiler()
    if compiler_path is None:
        raise KernelUnavailable("no C++ compiler (g++, or $CXX) on PATH")
    source = SOURCE_DIR / f"{name}.cc"
    version = subprocess.run([compiler_path, "--version"], capture_output=True, text=True).stdout
    headers = [h.read_text() for h in sorted(SOURCE_DIR.glob("*.h"))]  # what it includes
    key = hashlib.sha256(
        "\0".join([source.read_text(), *headers, version, " ".join(FLAGS), jaxlib.__version__,
                   cpu_flags()]).encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("compiling the CPU kernel %s (once for this machine)", name)
    start = time.monotonic()
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    cmd = [compiler_path, *FLAGS, f"-I{jax.ffi.include_dir()}", str(source), "-o", tmp]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        os.unlink(tmp)
        # the errors, not the tail: jaxlib's headers warn by the page (the tail where no
        # line names one)
        lines = done.stderr.splitlines()
        errors = [line for line in lines if "error" in line][:20] or lines[-20:]
        raise KernelUnavailable(f"{' '.join(cmd)} failed:\n" + "\n".join(errors))
    os.replace(tmp, target)
    log.info("compiled %s in %.1f s: %s", name, time.monotonic() - start, target)
    return target
