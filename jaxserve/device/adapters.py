"""LoRA adapters on the device: a fixed number of slots, and each token's adapter in a step.

Every projection an adapter may target has a B stack holding all slots side by side,
B [num_layers, width, out], and an A stack [num_layers, in, width], slot s (1-based; 0
means no adapter) owning B's rows and A's columns (s−1)·R to s·R (R: --max-lora-rank; an
adapter of a lower rank is padded with zeros, a target it leaves alone is all zeros, and
`width` is slots × R rounded up to whole kernel tiles). Projections that read the same
input (`GROUPS`: q/k/v, gate/up) keep their A stacks side by side in one, so one matmul
serves the group.

A step multiplies each token's activations by A, keeps only its own slot's columns (times
that adapter's scale: `token_mix`) and multiplies by B. On XLA (f32 stacks) these are
dense matmuls by every slot's columns, whose shapes never depend on which adapters the
rows use, so every row pays for slots × rank columns, which is why slots are few. On the
bf16 CPU kernels each token multiplies only its own slot's part of A and of B
(cpu_kernels/linear.py's `slot_linear`, as S-LoRA's and Punica's gathered products do on
a GPU): a 256-token prefill under an adapter cost 1.14x the base model's instead of
1.26x (Zen 5, 4 slots of rank 16, bench/results/NOTES.md). Either way a mix of adapters
compiles nothing and every row gets exactly the arithmetic it gets alone. A step in which
no row uses an adapter skips the adapter products altogether (`layers.lora_terms`).

The stacks are stored as the base projections are: f32, or, where the projections
multiply on a bf16 CPU kernel (`layers.PackedWeight`), packed for that kernel, so the
adapters' products run as fast per byte as the base model's. `SlotStore` keeps an f32
copy of every slot on the host; writing an adapter into a slot updates it, repacks the
tiles that changed, and places the stacks again (a swap: a few milliseconds between
steps).
"""

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxserve.checkpoint.adapter import TARGETS, Adapter, projection_shapes
from jaxserve.config import ModelConfig
from jaxserve.cpu_kernels.linear import DEPTH, fits, pack
from jaxserve.device.sharding import param_sharding

TILE = 16  # a packed weight's columns come in whole tiles of 16 (cpu_kernels/linear.py)
# projections that read the same input, whose A stacks sit side by side in one
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
          "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class AdapterSlots:
    """Every slot's adapter weights on the device (see the module docstring)."""

    # group -> f32[num_layers, in, members × width]; target -> f32[num_layers, width,
    # out]; each may be a layers.PackedWeight instead
    a: dict
    b: dict
    scale: jax.Array  # f32[slots]: slot s's scale at s − 1
    rank: int = field(metadata={"static": True})  # the columns of one slot
    width: int = field(metadata={"static": True})  # all slots' columns, padded

    @property
    def num_slots(self) -> int:
        return self.scale.shape[0]


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class AdapterBatch:
    """What a forward pass needs for adapters: the slots and each token's slot."""

    slots: AdapterSlots
    token_slots: jax.Array  # i32[num_tokens], 0: no adapter


def token_mix(slots: AdapterSlots, token_slots: jax.Array) -> jax.Array:
    """f32[num_tokens, width]: each token's weight on each slot's rank columns, its
    adapter's scale on its own slot's and 0 elsewhere (all 0: no adapter)."""
    own = token_slots[:, None] == jnp.arange(1, slots.num_slots + 1, dtype=jnp.int32)[None, :]
    mix = jnp.repeat(own * slots.scale[None, :], slots.rank, axis=1)
    return jnp.pad(mix, ((0, 0), (0, slots.width - mix.shape[1])))


def slot_axes(axes: dict[str, tuple[str | None, ...]]) -> dict[str, tuple]:
    """Each stack's logical axes from its projection's (layers, in, out) axes (`axes`, by
    parameter path): A split like the projection's input, B like its output, so under
    tensor parallelism a column-parallel projection's B and a row-parallel one's A are
    split with it and the other factor is whole on every device."""
    out = {}
    for group, members in GROUPS.items():
        layers, fan_in, _ = axes[f"layers/{members[0]}"]
        out[f"a/{group}"] = (layers, fan_in, None)
        for t in members:
            layers, _, fan_out = axes[f"layers/{t}"]
            out[f"b/{t}"] = (layers, None, fan_out)
    return out


class SlotStore:
    """The slots' host copy and how they are placed: f32 stacks (on one device or split
    over `mesh` like their projections), or packed for `backend`'s CPU kernel."""

    def __init__(self, config: ModelConfig, num_slots: int, rank: int,
                 mesh: Mesh | None = None, axes: dict | None = None,
                 backend: str | None = None, passes: int = 1):
        self.config, self.num_slots, self.rank = config, num_slots, rank
        self.mesh, self.axes, self.backend, self.passes = mesh, axes, backend, passes
        self.width = -(-num_slots * rank // TILE) * TILE
        shapes = projection_shapes(config)
        layers = config.num_layers
        self.host = {
            f"a/{g}": np.zeros((layers, shapes[m[0]][0], len(m) * self.width), np.float32)
            for g, m in GROUPS.items()
        }
        self.host |= {f"b/{t}": np.zeros((layers, self.width, shapes[t][1]), np.float32)
                      for t in TARGETS}
        self.scale = np.zeros(num_slots, np.float32)
        # packed for the kernel, on the host: a write repacks only the tiles it changes
        self.packed = {name: pack(stack) for name, stack in self.host.items()
                       if self._packs(stack)}
        self.placed = {name: self._place(name) for name in self.host}

    def slots(self) -> AdapterSlots:
        """The slots as the step takes them."""
        return AdapterSlots({g: self.placed[f"a/{g}"] for g in GROUPS},
                            {t: self.placed[f"b/{t}"] for t in TARGETS},
                            self._put(self.scale, (None,)), self.rank, self.width)

    def write(self, slot: int, adapter: Adapter | None) -> None:
        """Put `adapter` (None: zeros) into slot `slot` (1-based) and place what changed."""
        first = (slot - 1) * self.rank
        for group, members in GROUPS.items():
            for j, t in enumerate(members):
                columns = slice(j * self.width + first, j * self.width + first + self.rank)
                rows = slice(first, first + self.rank)
                a, b = self.host[f"a/{group}"], self.host[f"b/{t}"]
                a[..., columns], b[:, rows] = 0.0, 0.0
                if adapter is not None and t in adapter.weights:
                    a_t, b_t = adapter.weights[t]
                    a[..., columns][..., : adapter.rank] = a_t
                    b[:, rows][:, : adapter.rank] = b_t
                self._repack(f"a/{group}", columns, -1)
                self._repack(f"b/{t}", rows, -2)
            for name in (f"a/{group}", *(f"b/{t}" for t in members)):
                self.placed[name] = self._place(name)
        self.scale[slot - 1] = 0.0 if adapter is None else adapter.scale

    def _packs(self, stack: np.ndarray) -> bool:
        return self.backend is not None and fits(*stack.shape[-2:])

    def _repack(self, name: str, changed: slice, axis: int) -> None:
        """Pack again the tiles of a packed stack that hold the `changed` slice of `axis`
        (A's output columns come 16 a tile, B's inputs 32 a tile)."""
        if name not in self.packed:
            return
        stack, step = self.host[name], (TILE if axis == -1 else DEPTH)
        lo, hi = changed.start // step * step, -(-changed.stop // step) * step
        part = pack(np.take(stack, range(lo, min(hi, stack.shape[axis])), axis=axis))
        if axis == -1:
            self.packed[name][:, lo // step : hi // step] = part
        else:
            self.packed[name][:, :, lo // step : hi // step] = part

    def _place(self, name: str):
        """A stack on the device: packed for the kernel where it packs, else f32 (split
        over the mesh like its projection)."""
        from jaxserve.models.layers import PackedWeight  # jaxserve.models imports this

        if name in self.packed:
            return PackedWeight(jnp.asarray(self.packed[name]), self.backend, self.passes)
        return self._put(self.host[name], self.axes and self.axes[name])

    def _put(self, array: np.ndarray, axes: tuple | None) -> jax.Array:
        if self.mesh is None:
            return jnp.asarray(array)
        return jax.device_put(array, param_sharding(self.mesh, axes, array.shape))
