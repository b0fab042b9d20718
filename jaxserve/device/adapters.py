"""LoRA adapters on the device: a fixed number of slots, and each token's adapter in a step.

Every projection an adapter may target has one A stack and one B stack holding all slots
side by side: A f32[num_layers, in, slots × max_rank], B f32[num_layers, slots × max_rank,
out]. Slot s (1-based; 0 means no adapter) owns A's columns and B's rows (s−1)·R to s·R,
an adapter of a lower rank padded with zeros, and a target it leaves alone all zeros.

A step multiplies each token's activations by every slot's A at once, keeps only its own
slot's columns (times that adapter's scale) and multiplies by B: two dense matmuls whose
shapes never depend on which adapters the rows use, so a mix of adapters compiles
nothing and every row gets exactly the arithmetic it gets alone. Every row pays for
slots × rank columns, which is why slots are few; S-LoRA and Punica gather each row's
own adapter instead, which a GPU kernel can do without the padding. A step in which no
row uses an adapter skips the adapter products altogether (`linear`).
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxserve.checkpoint.adapter import TARGETS, Adapter, projection_shapes
from jaxserve.config import ModelConfig
from jaxserve.device.sharding import param_sharding


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class AdapterSlots:
    """Every slot's adapter weights on the device (see the module docstring)."""

    a: dict[str, jax.Array]  # target -> f32[num_layers, in, slots × max_rank]
    b: dict[str, jax.Array]  # target -> f32[num_layers, slots × max_rank, out]
    scale: jax.Array  # f32[slots]: slot s's scale at s − 1

    @property
    def num_slots(self) -> int:
        return self.scale.shape[0]

    @property
    def max_rank(self) -> int:
        return next(iter(self.a.values())).shape[-1] // self.num_slots


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class AdapterBatch:
    """What a forward pass needs for adapters: the slots and each token's slot."""

    slots: AdapterSlots
    token_slots: jax.Array  # i32[num_tokens], 0: no adapter


def init_adapter_slots(config: ModelConfig, num_slots: int, max_rank: int
                       ) -> AdapterSlots:
    """Empty slots (zeros, on the host) for `config`'s model."""
    width = num_slots * max_rank
    shapes = projection_shapes(config)
    return AdapterSlots(
        {t: np.zeros((config.num_layers, shapes[t][0], width), np.float32) for t in TARGETS},
        {t: np.zeros((config.num_layers, width, shapes[t][1]), np.float32) for t in TARGETS},
        np.zeros(num_slots, np.float32),
    )


def slot_shardings(mesh: Mesh, slots: AdapterSlots, axes: dict[str, tuple[str | None, ...]]
                   ) -> AdapterSlots:
    """Where each slot stack lives, from its projection's logical (layers, in, out) axes
    (`axes`, by parameter path): A split like the projection's input, B like its output,
    so under tensor parallelism a column-parallel projection's B and a row-parallel one's
    A are split with it and the other factor is whole on every device."""
    def a_axes(t):
        return axes[f"layers/{t}"][:2] + (None,)

    def b_axes(t):
        return axes[f"layers/{t}"][:1] + (None,) + axes[f"layers/{t}"][2:]

    return AdapterSlots(
        {t: param_sharding(mesh, a_axes(t), slots.a[t].shape) for t in TARGETS},
        {t: param_sharding(mesh, b_axes(t), slots.b[t].shape) for t in TARGETS},
        param_sharding(mesh, (None,), slots.scale.shape),
    )


def slot_weights(adapter: Adapter | None, config: ModelConfig, max_rank: int
                 ) -> tuple[dict, dict, np.float32]:
    """One slot's (A per target, B per target, scale) on the host, padded to `max_rank`:
    what `write_slot` takes (an empty slot: zeros)."""
    shapes = projection_shapes(config)
    a, b = {}, {}
    for t in TARGETS:
        fan_in, fan_out = shapes[t]
        a[t] = np.zeros((config.num_layers, fan_in, max_rank), np.float32)
        b[t] = np.zeros((config.num_layers, max_rank, fan_out), np.float32)
        if adapter is not None and t in adapter.weights:
            a_t, b_t = adapter.weights[t]
            a[t][..., : adapter.rank], b[t][:, : adapter.rank] = a_t, b_t
    return a, b, np.float32(0.0 if adapter is None else adapter.scale)


def _write_slot(slots: AdapterSlots, slot: jax.Array, a: dict, b: dict, scale: jax.Array
                ) -> AdapterSlots:
    """`slots` with slot `slot` (1-based) holding a, b and scale."""
    rank = slots.max_rank
    column = (slot - 1) * rank
    zero = jnp.int32(0)
    return AdapterSlots(
        {t: jax.lax.dynamic_update_slice(slots.a[t], a[t], (zero, zero, column)) for t in TARGETS},
        {t: jax.lax.dynamic_update_slice(slots.b[t], b[t], (zero, column, zero)) for t in TARGETS},
        jax.lax.dynamic_update_slice(slots.scale, scale[None], (slot - 1,)),
    )


def jit_write_slot(shardings: AdapterSlots | None = None):
    """`_write_slot` jitted, in place (the old slots are donated): one compile whatever the
    slot, keeping the slots where `shardings` puts them."""
    return jax.jit(_write_slot, donate_argnums=0, out_shardings=shardings)


def token_mix(slots: AdapterSlots, token_slots: jax.Array) -> jax.Array:
    """f32[num_tokens, slots × max_rank]: each token's weight on each slot's rank
    columns, its adapter's scale on its own slot's and 0 elsewhere (all 0: no adapter)."""
    own = token_slots[:, None] == jnp.arange(1, slots.num_slots + 1, dtype=jnp.int32)[None, :]
    return jnp.repeat(own * slots.scale[None, :], slots.max_rank, axis=1)
