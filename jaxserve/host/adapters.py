"""LoRA adapters on the host: which ones are served, and which device slot holds which.

`AdapterRegistry` maps the names clients ask for (`model`) to adapters read into host
memory; the server's thread loads and unloads while the engine's reads, so every change
swaps in a new dict (a reader sees the old one or the new one, never half of one).
`SlotTable` is the scheduler's: the device has a few slots, and an adapter beyond them
waits in host memory until a slot frees up. A slot held by an adapter that some running
request uses is never taken; among the others, an empty slot goes first, then the one
whose adapter was used least recently (LRU). Taking a slot for another adapter is a swap:
the step plan carries it (`StepPlan.adapter_loads`) and the runner writes the slot before
the step.
"""

import dataclasses
import threading
from collections import Counter, OrderedDict
from pathlib import Path

from jaxserve.checkpoint.adapter import Adapter, AdapterError, load_adapter
from jaxserve.config import ModelConfig


class AdapterRegistry:
    """The adapters served, by name (thread-safe)."""

    def __init__(self, config: ModelConfig, max_rank: int):
        self.config, self.max_rank = config, max_rank
        self.adapters: dict[str, Adapter] = {}
        self._lock = threading.Lock()
        self._loads = 0  # each load's serial: the same name loaded again is another adapter

    def load(self, name: str, path: str | Path) -> Adapter:
        """Read the adapter at `path` and serve it as `name`; AdapterError if it cannot be
        served or the name is taken."""
        if not name.strip():
            raise AdapterError("an adapter needs a name")
        adapter = load_adapter(name, path, self.config, self.max_rank)
        with self._lock:
            if name in self.adapters:
                raise AdapterError(f"an adapter named {name!r} is already loaded")
            self._loads += 1
            adapter = dataclasses.replace(adapter, serial=self._loads)
            self.adapters = {**self.adapters, name: adapter}
            return adapter

    def unload(self, name: str) -> None:
        """Stop serving `name` (KeyError if it is not served); requests already running
        with it finish with it."""
        with self._lock:
            if name not in self.adapters:
                raise KeyError(name)
            self.adapters = {n: a for n, a in self.adapters.items() if n != name}

    def get(self, name: str) -> Adapter | None:
        return self.adapters.get(name)


class SlotTable:
    """Which device slot (1..num_slots) holds which adapter, and who uses it."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.holder: dict[int, Adapter] = {}  # slot -> the adapter in it
        self.users: Counter = Counter()  # adapter serial -> running requests using it
        self.idle: OrderedDict[int, None] = OrderedDict()  # slots nobody uses, LRU first
        self.swaps = 0  # adapters written into a slot

    def slot_of(self, adapter: Adapter) -> int | None:
        return next((s for s, a in self.holder.items() if a is adapter), None)

    def can_place(self, adapter: Adapter) -> bool:
        """Whether `acquire` would find `adapter` a slot now."""
        return (self.slot_of(adapter) is not None or len(self.holder) < self.num_slots
                or bool(self.idle))

    def acquire(self, adapter: Adapter) -> tuple[int, bool]:
        """`adapter`'s slot for one more running request, and whether the slot must be
        written first (a swap). Call only after `can_place`."""
        slot = self.slot_of(adapter)
        swap = slot is None
        if swap:
            free = set(range(1, self.num_slots + 1)) - set(self.holder)
            slot = min(free) if free else next(iter(self.idle))
            self.holder[slot] = adapter
            self.swaps += 1
        self.idle.pop(slot, None)
        self.users[adapter.serial] += 1
        return slot, swap

    def release(self, adapter: Adapter) -> None:
        """One running request with `adapter` ended; its slot idles once none is left."""
        self.users[adapter.serial] -= 1
        if self.users[adapter.serial] == 0:
            del self.users[adapter.serial]
            slot = self.slot_of(adapter)
            if slot is not None:
                self.idle[slot] = None
