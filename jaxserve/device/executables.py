"""Each bucket's compiled step kept on disk, so that a warm restart neither traces nor lowers.

jax's persistent compilation cache saves only XLA's compile: its key is the lowered
module, so every start still traces and lowers each bucket, ~0.3 s apiece (44 buckets
for SmolLM2 at default flags: ~13 s of a 20 s warm restart). Here each executable is
serialized (`jax.experimental.serialize_executable`) under a key of everything its
program depends on: jaxserve's own source files, jax's version, the platform, the CPU
and XLA_FLAGS (the file name's prefix), then the model's graph and config, the runner's
static settings and every argument's shape, dtype and sharding. A key that misses is
lowered and compiled (past jax's caches: see `_SERIALIZED`) and stored; jax's disk
cache stays off where this store is used. Files under another
prefix were written by other sources or another jax, and are deleted on open.
"""

import hashlib
import logging
import os
import pickle
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jaxlib
from jax.experimental import serialize_executable
from jax.extend.backend import clear_in_memory_compilation_cache

log = logging.getLogger(__name__)

_PACKAGE = Path(__file__).resolve().parents[1]  # jaxserve/
# On CPU (jaxlib 0.10.2) an executable serializes whole only the first time its program
# is compiled in a process: compiled again (another LLM, another store), or loaded by
# jax's disk cache, it serializes without its kernels' code, and the copy fails when it
# runs ("Function wrapped_iota not found"). So this process's first serialization of
# each file is kept and written wherever the file is missing, and what jax's disk cache
# answers is never kept (the engine turns that cache off where it keeps executables).
_SERIALIZED: dict[str, bytes] = {}


def compile_ahead(fn: Callable, args: Sequence) -> jax.stages.Compiled:
    """`fn` (a jitted function) compiled for `args`, without running it."""
    return fn.lower(*args).compile()


class ExecutableStore:
    """Serialized executables in `directory`, one file a (program, argument shapes)."""

    def __init__(self, directory: str | Path, program: str, devices: Sequence[jax.Device]):
        """`program`: what the stored programs depend on beyond their arguments and the
        code (the model's graph and config, the runner's static settings); `devices`: those
        they run on, in the order they were compiled for (one, or a mesh's), which a loaded
        executable is given back (jax would give it every device of the process: a
        one-device step on a machine of 8 then wants 8 shards of each argument)."""
        self.directory = Path(directory)
        self.prefix = _environment_key()
        self.devices = list(devices)
        self.program = repr((program, [d.id for d in self.devices]))
        self.loaded = self.stored = 0  # executables read from disk, and written to it
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob("*.exe"):
            if not stale.name.startswith(self.prefix):
                stale.unlink(missing_ok=True)

    def load_or_compile(self, name: str, fn: Callable, args: Sequence) -> jax.stages.Compiled:
        """The executable of `fn` (jitted) for `args`: from disk, or compiled and stored."""
        path = self.directory / f"{self.prefix}-{self._key(name, args)}.exe"
        if path.exists():
            try:
                executable = serialize_executable.deserialize_and_load(
                    *pickle.loads(path.read_bytes()), execution_devices=self.devices)
                self.loaded += 1
                return executable
            except Exception as e:  # noqa: BLE001 (a torn or foreign file: compile instead)
                log.warning("could not load %s (%s): compiling it again", path.name, e)
        payload = _SERIALIZED.get(path.name)
        if payload is None:
            compiled = _compile_afresh(fn, args)
            if compiled is None:  # it would be stored without its kernels: not stored
                log.warning("jax's compilation cache is on in this process: %s is not kept",
                            name)
                return compile_ahead(fn, args)
            payload = _SERIALIZED[path.name] = pickle.dumps(
                serialize_executable.serialize(compiled))
        else:  # compiled here before, for another store: its first serialization
            compiled = serialize_executable.deserialize_and_load(
                *pickle.loads(payload), execution_devices=self.devices)
        self.stored += 1
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_bytes(payload)
        temporary.replace(path)  # whole or absent, for a concurrent reader
        return compiled

    def _key(self, name: str, args: Sequence) -> str:
        leaves, treedef = jax.tree.flatten(args)
        shapes = [(jax.typeof(x), getattr(x, "sharding", None)) for x in leaves]
        text = repr((self.program, name, treedef, shapes))
        return hashlib.sha256(text.encode()).hexdigest()[:32]


def _compile_afresh(fn: Callable, args: Sequence) -> jax.stages.Compiled | None:
    """Compiled by XLA now, past jax's in-memory cache; None if jax's disk cache (turned on
    elsewhere in this process) answered instead (see _SERIALIZED)."""
    clear_in_memory_compilation_cache()
    hits = _DISK_CACHE_HITS.count
    compiled = compile_ahead(fn, args)
    return compiled if _DISK_CACHE_HITS.count == hits else None


class _EventCounter:
    """How many times jax has recorded one monitoring event in this process."""

    def __init__(self, event: str):
        self.event, self.count = event, 0
        jax.monitoring.register_event_listener(self._on_event)

    def _on_event(self, event: str, **kwargs) -> None:
        if event == self.event:
            self.count += 1


_DISK_CACHE_HITS = _EventCounter("/jax/compilation_cache/cache_hits")


def _environment_key() -> str:
    """A hash of jaxserve's source files, jax's version, the platform, the CPU and
    XLA_FLAGS: an executable is valid only where all of them are the same."""
    digest = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*")):
        if path.suffix in (".py", ".cc", ".h") and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(_PACKAGE)).encode())
            digest.update(path.read_bytes())
    device = jax.devices()[0]
    digest.update(repr((jax.__version__, jaxlib.__version__, device.platform,
                        device.device_kind, jax.device_count(), _cpu(),
                        os.environ.get("XLA_FLAGS", ""))).encode())
    return digest.hexdigest()[:16]


def _cpu() -> str:
    """The CPU's model and flags (XLA compiles for the host's instruction set)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(lines[:2])
