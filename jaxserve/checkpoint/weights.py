"""Load Hugging Face safetensors directories and GGUF files into model parameters.

Both formats are read as Hugging Face tensor names ([out, in] layout), so one
weight map per architecture serves both; what is particular to an architecture (its
config parser, its GGUF tensor names, whether llama.cpp permuted its Q/K rows) comes
from its `ModelSpec`. GGUF tensors are dequantized with the `gguf` package. Every
failure is a `WeightsError` (`jaxserve.checkpoint.model_config`) that names the file and the
tensor or key at fault.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxserve.checkpoint.gguf_file import read_gguf
from jaxserve.checkpoint.model_config import (
    WeightsError,
    gguf_architecture,
    hf_architecture,
    read_hf_config,
)
from jaxserve.config import ModelConfig
from jaxserve.cpu_kernels.linear import Q4_1_KERNELS, fits, pack, pack_q4_1
from jaxserve.device.adapters import GROUPS
from jaxserve.device.sharding import map_params, param_sharding
from jaxserve.models import ModelSpec, WeightRule, get_model_spec, param_axes
from jaxserve.models.layers import PackedWeight, QuantizedWeight, fuse, map_stored, store

# GGUF quantization types dequantized here (the ones real Llama-family files use).
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
# safetensors dtypes read here; numpy knows BF16 through ml_dtypes, which jax registers
SAFETENSORS_DTYPES = ("F64", "F32", "F16", "BF16")

@dataclass(frozen=True)
class Checkpoint:
    """A model's config and lazy loaders of its tensors, keyed by Hugging Face name."""

    path: Path
    config: ModelConfig
    tensors: Mapping[str, Callable[[], np.ndarray]]
    # the file's own tensor names where they differ (GGUF), so messages name what the file has
    file_names: Mapping[str, str] = field(default_factory=dict)
    # the GGUF tensors stored as Q4_1: loaders of their blocks as the file holds them,
    # uint8 [out, in/32, 20] (Q/K rows unpermuted), which a CPU kernel multiplies as they are
    q4_1_blocks: Mapping[str, Callable[[], np.ndarray]] = field(default_factory=dict)


# ---------------------------------------------------------------- Hugging Face


def open_hf_dir(path: Path) -> Checkpoint:
    """A Hugging Face directory: config.json and one or many *.safetensors files."""
    from safetensors import safe_open

    config_file = path / "config.json"
    if not config_file.exists():
        raise WeightsError(f"{path}: no config.json (not a Hugging Face model directory)")
    raw = read_hf_config(config_file)
    spec = get_model_spec_or_raise(hf_architecture(raw, str(config_file)), str(config_file))
    config = spec.config_from_hf(raw, str(config_file))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{path}: no *.safetensors files")
    loaders: dict[str, Callable[[], np.ndarray]] = {}
    for file in files:
        try:
            with safe_open(file, framework="numpy") as f:
                names = list(f.keys())
        except Exception as e:  # noqa: BLE001 (safetensors raises its own error types)
            raise WeightsError(f"{file}: unreadable safetensors file ({e})") from None
        for name in names:
            loaders[name] = _safetensors_loader(file, name)
    return Checkpoint(path, config, loaders)


def _safetensors_loader(file: Path, name: str) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        from safetensors import safe_open

        with safe_open(file, framework="numpy") as f:
            dtype = f.get_slice(name).get_dtype()
            if dtype not in SAFETENSORS_DTYPES:
                raise WeightsError(
                    f"{file}: tensor {name!r} has unsupported dtype {dtype}; "
                    f"supported: {', '.join(SAFETENSORS_DTYPES)}"
                )
            return f.get_tensor(name)

    return load


# ---------------------------------------------------------------- GGUF


def get_model_spec_or_raise(arch: str, source: str) -> ModelSpec:
    try:
        return get_model_spec(arch)
    except ValueError as e:
        raise WeightsError(f"{source}: {e}") from None


def open_gguf(path: Path) -> Checkpoint:
    """A GGUF file: metadata → config; tensors dequantized on demand, renamed to HF names."""
    try:
        gguf_file = read_gguf(path)
    except Exception as e:  # noqa: BLE001 (ValueError, struct.error, UnicodeDecodeError, ...)
        raise WeightsError(f"{path}: not a readable GGUF file ({e})") from None
    tensor_names = {t.name for t in gguf_file.tensors}
    fields = gguf_file.fields
    vocab_size = len(fields.get("tokenizer.ggml.tokens", ()))
    spec = get_model_spec_or_raise(gguf_architecture(fields, str(path)), str(path))
    if not spec.gguf_names:
        raise WeightsError(f"{path}: architecture {fields['general.architecture']!r} is not "
                           "read from GGUF files (its ModelSpec names no GGUF tensors)")
    config = spec.config_from_gguf(fields, tensor_names, vocab_size, str(path))
    if "rope_freqs.weight" in tensor_names:
        raise WeightsError(
            f"{path}: tensor 'rope_freqs.weight' (Llama-3 RoPE frequency factors) is not "
            "supported from GGUF; load the Hugging Face safetensors directory instead"
        )
    # file name -> Hugging Face name, every layer's spelled out
    hf_names = {
        gguf.format(layer=i): hf.format(layer=i)
        for gguf, hf in spec.gguf_names.items()
        for i in (range(config.num_layers) if "{layer}" in gguf else (0,))
    }
    loaders: dict[str, Callable[[], np.ndarray]] = {}
    blocks: dict[str, Callable[[], np.ndarray]] = {}
    for tensor in gguf_file.tensors:
        hf_name = hf_names.get(tensor.name)
        if hf_name is None:
            continue
        heads = None
        if spec.gguf_qk_permuted and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            heads = config.num_heads
        elif spec.gguf_qk_permuted and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = config.num_kv_heads
        loaders[hf_name] = _gguf_loader(path, tensor, heads)
        if tensor.tensor_type.name == "Q4_1" and len(tensor.shape) == 2:
            blocks[hf_name] = _q4_1_loader(tensor, heads)
    file_names = {hf: name for name, hf in hf_names.items()}
    return Checkpoint(path, config, loaders, file_names, blocks)


def _gguf_loader(path: Path, tensor, heads: int | None) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        from gguf import quants

        kind = tensor.tensor_type.name
        if kind not in GGUF_TYPES:
            raise WeightsError(
                f"{path}: tensor {tensor.name!r} has unsupported quantization type {kind}; "
                f"supported: {', '.join(GGUF_TYPES)}"
            )
        array = np.asarray(quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
        expected = tuple(int(n) for n in reversed(tensor.shape))
        array = array.reshape(expected)
        if heads and array.shape[0] % (2 * heads) == 0:  # else the caller reports the shape
            array = _unpermute_rows(array, heads)
        return array

    return load


def _q4_1_loader(tensor, heads: int | None) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        out, k = (int(n) for n in reversed(tensor.shape))
        blocks = np.asarray(tensor.data).reshape(out, k // 32, 20)
        if heads and out % (2 * heads) == 0:  # whole rows move, as the dequantized ones do
            blocks = _unpermute_rows(blocks, heads)
        return blocks

    return load


def _unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of RoPE halves in Q/K rows (weights or biases)."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(heads, rows // heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------- parameters


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open a GGUF file or a Hugging Face directory, by what the path is."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return open_gguf(path)
    if path.is_dir():
        return open_hf_dir(path)
    if not path.exists():
        raise WeightsError(f"{path}: no such file or directory")
    raise WeightsError(f"{path}: expected a .gguf file or a Hugging Face model directory")


def load_model(
    checkpoint: Checkpoint, dtype: jnp.dtype = jnp.float32, mesh: Mesh | None = None,
    weight_dtype: str = "auto",
) -> nnx.Module:
    """Build the registered architecture and fill every parameter from the checkpoint,
    its projections stored as `weight_dtype` says (layers.store: quantized on the host).

    With a `mesh`, each parameter is assembled on the host and each device receives
    only its own shard (as `sharding.param_sharding` lays it out): no device ever
    holds a whole copy of a sharded parameter.
    """
    config = checkpoint.config
    spec = get_model_spec_or_raise(config.architecture, str(checkpoint.path))
    abstract = nnx.eval_shape(lambda: spec.build(config, nnx.Rngs(0), dtype))
    graphdef, state = nnx.split(abstract)
    rules = spec.weight_map(config)
    try:
        axes = param_axes(config)  # every parameter's sharding, checked before any loads
    except ValueError as e:
        raise WeightsError(f"{checkpoint.path}: {e}") from None
    flat = []
    for path, variable in nnx.to_flat_state(state):
        name = "/".join(str(p) for p in path)
        if name not in rules:
            raise WeightsError(f"{checkpoint.path}: weight map has no rule for parameter {name!r}")
        target = variable.get_value()
        array = _assemble(checkpoint, rules[name], config.num_layers, target.shape, name)
        array = np.asarray(array, dtype=target.dtype)
        if rules[name].projection:
            array = store(array, weight_dtype)
        flat.append((path, variable.replace(place_param(array, mesh, axes.get(name)))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def store_projections(model: nnx.Module, weight_dtype: str, mesh: Mesh | None = None
                      ) -> nnx.Module:
    """`model` with its projections re-stored as `weight_dtype` says (via the host)."""
    graphdef, state = nnx.split(model)
    rules = get_model_spec(model.config.architecture).weight_map(model.config)
    axes = param_axes(model.config)

    def as_stored(name: str, value):
        if not rules[name].projection:
            return value
        return place_param(store(np.asarray(value), weight_dtype), mesh, axes[name])

    return nnx.merge(graphdef, map_params(as_stored, state))


def pack_projections(model: nnx.Module, backend: str, passes: int,
                     source: Checkpoint | None = None) -> nnx.Module:
    """`model` (on one device) with its float projections packed for `backend`'s kernel
    (layers.PackedWeight, cpu_kernels.linear.KERNELS), which multiplies them in `passes`
    (1: activations rounded to bf16; 2: kept in f32; 0: int8 for the Q4_1 ones, bf16 for
    the rest). They are rounded to bf16 as `pack`
    does (an f32 model is packed straight, not stored as bf16 first), and the LM head is
    packed too: the step's largest matmul. A tied head gains a packed copy of the
    embedding, which the lookup keeps reading. Projections of one input (adapters.GROUPS:
    q/k/v, gate/up) are packed side by side under the group's name, one kernel call
    each (layers.fuse). Given the `source` checkpoint the model was loaded from, the
    projections it stores as Q4_1 stay Q4_1 where `backend` multiplies them (`pack_q4_1`:
    the same results from 0.31x the bytes)."""
    graphdef, state = nnx.split(model)
    rules = get_model_spec(model.config.architecture).weight_map(model.config)
    keep_q4_1 = source is not None and backend in Q4_1_KERNELS
    bf16_passes = max(passes, 1)  # int8 activations (0) are for Q4_1 weights; bf16 take bf16

    def packed(name: str, value):
        rule = rules[name]
        if not (rule.projection and isinstance(value, jax.Array)
                and value.dtype in (jnp.float32, jnp.bfloat16) and fits(*value.shape[-2:])):
            return value
        blocks = _q4_1_blocks(source, rule, model.config.num_layers, value.shape) if (
            keep_q4_1) else None
        if blocks is not None:
            return PackedWeight(jnp.asarray(pack_q4_1(blocks)), backend, passes)
        return PackedWeight(jnp.asarray(pack(np.asarray(value))), backend, bf16_passes)

    model = nnx.merge(graphdef, map_params(packed, state))
    layers = getattr(model, "layers", None)  # llama.py's layout: one input's projections fused
    for group, members in GROUPS.items():
        params = [getattr(layers, name, None) for name in members]
        if not all(isinstance(p, nnx.Param) for p in params):
            continue
        fused = fuse([p.get_value() for p in params])
        if fused is not None:
            for name in members:
                delattr(layers, name)
            setattr(layers, group, nnx.Param(fused))
    head = None  # a model of another layout than llama.py's keeps its head as it is
    if hasattr(model, "lm_head"):
        head = model.lm_head.get_value()
    elif hasattr(model, "embed"):  # tied
        head = model.embed.get_value().T
    if isinstance(head, jax.Array) and fits(*head.shape):
        packed = PackedWeight(jnp.asarray(pack(np.asarray(head))), backend, bf16_passes)
        model.lm_head = nnx.Param(packed)
    return model


def untie_head(model: nnx.Module) -> nnx.Module:
    """`model` (on one device) with a tied head's own copy, laid out [hidden, vocab] as an
    untied one: XLA:CPU's Eigen dots (device/step.py, compiler_options) multiply the
    embedding's transpose 3.8x slower at 16 rows (19.6 against 5.2 ms for SmolLM2's
    head; the copy: 6.1 ms), for the copy's bytes (SmolLM2 f32: 113 MB). The lookup
    keeps reading the embedding."""
    if hasattr(model, "embed") and not hasattr(model, "lm_head"):
        model.lm_head = nnx.Param(jnp.asarray(model.embed.get_value().T, copy=True))
    return model


def _q4_1_blocks(checkpoint: Checkpoint, rule: WeightRule, num_layers: int,
                 shape: tuple[int, ...]) -> np.ndarray | None:
    """A projection's Q4_1 blocks as `_assemble` lays out its values (layers stacked):
    uint8 [..., out, in/32, 20]; None unless every tensor of it is Q4_1, of `shape`."""
    names, stacked = _source_tensors(rule, num_layers)
    if not rule.transpose or not all(n in checkpoint.q4_1_blocks for n in names):
        return None
    arrays = [checkpoint.q4_1_blocks[n]() for n in names]
    blocks = np.stack(arrays) if stacked else arrays[0]
    *lead, k, n = shape
    return blocks if blocks.shape == (*lead, n, k // 32, 20) else None


def _source_tensors(rule: WeightRule, num_layers: int) -> tuple[list[str], bool]:
    """The checkpoint tensors a parameter comes from, and whether they are one a layer
    (stacked over layers on a new leading axis)."""
    stacked = "{layer}" in rule.source
    return ([rule.source.format(layer=i) for i in range(num_layers)] if stacked
            else [rule.source]), stacked


def place_param(value: np.ndarray | QuantizedWeight, mesh: Mesh | None,
                axes: tuple[str | None, ...] | None) -> jax.Array | QuantizedWeight:
    """A host parameter on the device, or sharded over `mesh` by its logical `axes` (a
    QuantizedWeight's scale by its weight's output axis)."""
    return map_stored(lambda array, array_axes: jnp.asarray(array) if mesh is None
                      else _place(array, mesh, array_axes), value, axes)


def _place(array: np.ndarray, mesh: Mesh, axes: tuple[str | None, ...]) -> jax.Array:
    """A host array as a global array sharded by its logical `axes`; each device gets its
    slice (in a multi-process mesh, this process's devices only)."""
    sharding = param_sharding(mesh, axes, array.shape)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def _assemble(
    checkpoint: Checkpoint, rule: WeightRule, num_layers: int, shape: tuple, param: str
) -> np.ndarray:
    """One parameter: a tensor, or per-layer tensors stacked, transposed as the rule says."""
    names, stacked = _source_tensors(rule, num_layers)
    want = tuple(shape[1:]) if stacked else tuple(shape)
    if rule.transpose:
        want = want[::-1]  # as stored in the checkpoint
    arrays = []
    for name in names:
        label = checkpoint.file_names.get(name, name)
        if name not in checkpoint.tensors:
            raise WeightsError(f"{checkpoint.path}: missing tensor {label!r} (for {param})")
        array = checkpoint.tensors[name]()
        if tuple(array.shape) != want:
            raise WeightsError(
                f"{checkpoint.path}: tensor {label!r} has shape {tuple(array.shape)}, "
                f"expected {want} (for {param})"
            )
        arrays.append(array.T if rule.transpose else array)
    return np.stack(arrays) if stacked else arrays[0]
