"""Mesh construction and partition rules: parallelism as a transformation of the model state.

The mesh has two axes: "data" (dp) and "model" (tp, the minor axis, so one
tensor-parallel group is adjacent devices). Layers never see it. Each parameter is
given logical axis names by its model's weight map (`WeightRule.axes`, keyed by
parameter path), the KV cache by `KV_AXES`; `RULES` maps logical names to mesh axes.
One rule decides every dimension:

    a dimension is sharded over the mesh axis its logical name maps to when its
    size divides by that axis' size; otherwise that dimension is replicated.

Megatron-style tensor parallelism falls out of the table: q/k/v/gate/up are
column-parallel (their output axis on "model"), o/down row-parallel (their input
axis on "model"), embedding and LM head split over the vocabulary. When the head
counts divide tp the shards fall on head boundaries and attention runs head-local.
When they do not (SmolLM2: 9 heads, 3 KV heads), the flattened heads × head_dim
weight columns still divide (576 and 192 by 8), so the weights stay sharded and
XLA gathers the q/k/v activations before attention, which then runs replicated.
The Pallas attention kernel has no partitioning rule of its own, so it is run
under `shard_map` over "model" where the KV heads divide tp (`attention.py`).

The KV cache [layer, kv_head, page, slot, head_dim] shards its KV-head axis by the
same rule, so with kv_heads < tp (or not dividing it) the cache is replicated over
"model". Sharding head_dim instead would need an all-reduce of the scores inside
the page loop and breaks RoPE's rotate-half pairing. Replication costs KV memory,
not correctness.

The "data" axis splits the batch: weights are replicated over it, and the KV pages
are sharded over it, so each data shard holds a pool of its own (the scheduler
keeps one page allocator per shard and places each sequence on one). The step's
inputs are the shards' packed batches laid end to end, sharded over "data" too,
and the step runs under `shard_map` over "data" (the "model" axis stays automatic),
so a shard's attention reads only its own pages.

A parameter with no axes is an error (`models.interface.param_axes`), never a
silent copy on every device.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxserve.device.kv_cache import KVCache

DATA, MODEL = "data", "model"

# logical axis -> mesh axis; logical axes not named here are replicated
RULES: dict[str, str] = {
    "vocab": MODEL,
    "heads": MODEL,  # q columns and o rows: num_heads × head_dim, flattened
    "kv_heads": MODEL,  # k/v columns (num_kv_heads × head_dim) and the cache's KV-head axis
    "mlp": MODEL,  # the intermediate size
    "pages": DATA,  # the KV pool: one pool per data shard
}

KV_AXES = ("layers", "kv_heads", "pages", "page_slots", "head_dim")


def on_any_shard(flag: jax.Array) -> jax.Array:  # bool[]
    """`flag` or'ed over the data shards where the step runs per shard (under shard_map
    over "data"), else `flag` itself. Every `lax.cond` of the step branches on this, so
    all devices take the same branch and the model axis's collectives inside it meet: a
    branch that one data shard took alone hung a two-process mesh (each process waiting
    in gloo for the other)."""
    mesh = jax.sharding.get_abstract_mesh()
    if DATA in mesh.axis_names and DATA in mesh.manual_axes:
        return jax.lax.psum(flag.astype(jnp.int32), DATA) > 0
    return flag


def make_mesh(tp: int = 1, dp: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("data", "model") mesh of dp × tp devices, the first dp × tp of `devices`.

    Axis types are Auto: jax's default, Explicit, makes plain row-parallel matmuls
    raise a sharding type error.
    """
    if tp < 1 or dp < 1:
        raise ValueError(f"tp and dp must be at least 1, got tp={tp}, dp={dp}")
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < tp * dp:
        raise ValueError(f"tp={tp} × dp={dp} needs {tp * dp} devices, found {len(devices)}")
    return jax.make_mesh(
        (dp, tp), (DATA, MODEL), axis_types=(AxisType.Auto,) * 2, devices=devices[: tp * dp]
    )


def partition_spec(
    axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh
) -> PartitionSpec:
    """Each dimension on its logical axis' mesh axis when its size divides; else replicated."""
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {tuple(axes)} do not fit shape {tuple(shape)}")
    spec = []
    for name, size in zip(axes, shape):
        mesh_axis = RULES.get(name) if name else None
        divides = mesh_axis in mesh.shape and size % mesh.shape[mesh_axis] == 0
        spec.append(mesh_axis if divides else None)
    return PartitionSpec(*spec)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def param_sharding(
    mesh: Mesh, axes: Sequence[str | None], shape: Sequence[int]
) -> NamedSharding:
    """Where a parameter of `shape` with logical `axes` lives."""
    return NamedSharding(mesh, partition_spec(axes, shape, mesh))


def kv_sharding(mesh: Mesh, shape: Sequence[int]) -> NamedSharding:
    """Where a KV pool of `shape` [layer, kv_head, page, slot, head_dim] lives."""
    return NamedSharding(mesh, partition_spec(KV_AXES, shape, mesh))


def map_params(fn: Callable[[str, jax.Array], object], state: nnx.State) -> nnx.State:
    """`state` with each parameter value replaced by fn(path, value); path like "layers/q_proj"."""
    flat = [
        (path, variable.replace(fn("/".join(str(p) for p in path), variable.get_value())))
        for path, variable in nnx.to_flat_state(state)
    ]
    return nnx.from_flat_state(flat)


def state_shardings(
    mesh: Mesh, state: nnx.State, axes: Mapping[str, Sequence[str | None]]
) -> nnx.State:
    """A tree like `state` (arrays or abstract) holding each parameter's NamedSharding,
    `axes` giving each parameter path's logical axes (a quantized weight's scale: its
    weight's, less the input axis)."""
    # imported here: jaxserve.models imports this module
    from jaxserve.models.layers import map_stored

    def sharding(array, array_axes) -> NamedSharding:
        return param_sharding(mesh, array_axes, array.shape)

    return map_params(lambda path, x: map_stored(sharding, x, axes[path]), state)


@dataclass(frozen=True)
class Layout:
    """Where the step's operands live on a mesh; what `jax.jit` is told."""

    mesh: Mesh
    state: nnx.State  # NamedSharding per parameter, shaped like the model state
    kv_cache: KVCache  # NamedSharding of k and of v (and of their scales and centers, if any)
    replicated: NamedSharding  # results, and the inputs of forward passes outside the step
    data: NamedSharding  # axis 0 over "data": step inputs and the row state
    adapters: object = None  # the LoRA adapter slots' NamedShardings, when served

    @staticmethod
    def build(
        mesh: Mesh, state: nnx.State, kv_shape: Sequence[int],
        axes: Mapping[str, Sequence[str | None]], scaled: bool = False,
        calibrated: bool = False, k_transposed: bool = False,
    ) -> "Layout":
        """`scaled`: the pool keeps a scale per token and head (kv_cache.SCALED);
        `calibrated`: a center and scale per layer, head and channel (kv_cache.CALIBRATED);
        `k_transposed`: K's pages are [head_dim, page_size] (only the first three axes
        are ever split, so K and V share a sharding)."""
        kv = kv_sharding(mesh, kv_shape)
        scale = NamedSharding(mesh, partition_spec(KV_AXES[:-1], kv_shape[:-1], mesh))
        channel_axes = KV_AXES[:2] + KV_AXES[-1:]  # [layer, kv_head, head_dim]
        channels = NamedSharding(mesh, partition_spec(
            channel_axes, [kv_shape[KV_AXES.index(a)] for a in channel_axes], mesh))
        scales = (scale, scale) if scaled else (None, None)
        calibration = (channels,) * 4 if calibrated else (None,) * 4
        kv_cache = KVCache(kv, kv, *scales, *calibration, k_transposed=k_transposed)
        data = NamedSharding(mesh, PartitionSpec(DATA))
        return Layout(mesh, state_shardings(mesh, state, axes), kv_cache, replicated(mesh), data)


def device_bytes(tree: object) -> dict[jax.Device, int]:
    """Bytes each device holds of the arrays in `tree` (from their shardings)."""
    held: dict[jax.Device, int] = {}
    for leaf in jax.tree.leaves(tree):
        shard_shape = leaf.sharding.shard_shape(leaf.shape)
        nbytes = int(np.prod(shard_shape)) * leaf.dtype.itemsize
        for device in leaf.sharding.device_set:
            held[device] = held.get(device, 0) + nbytes
    return held
