"""Converted checkpoints: parameters saved with Orbax, config and tokenizer beside them.

Restoring skips dequantization and renaming, so it starts faster than reading
the source again; the layout is:

    NAME/jaxserve_config.json   the ModelConfig
    NAME/jaxserve_weights.json  how projections are stored: {"weight_dtype": "int8"}
    NAME/params/                Orbax StandardCheckpointer output (a quantized weight as
                                {"values", "scale"}), so a restart does not re-quantize
    NAME/tokenizer.json, tokenizer_config.json
"""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from jaxserve.checkpoint.tokenizer import Tokenizer
from jaxserve.config import ModelConfig, RopeScaling
from jaxserve.device.sharding import map_params, param_sharding
from jaxserve.models import get_model_spec, param_axes
from jaxserve.models.layers import QuantizedWeight, abstract_stored, map_stored

CONFIG_FILE = "jaxserve_config.json"
WEIGHTS_FILE = "jaxserve_weights.json"


def is_converted(path: Path) -> bool:
    return (path / CONFIG_FILE).exists()


def save(model: nnx.Module, tokenizer: Tokenizer, out: Path, weight_dtype: str = "auto"
         ) -> None:
    """Write params, config and tokenizer under `out` (which must not hold a checkpoint
    yet); `weight_dtype` is how the model's projections are stored (layers.store)."""
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    _, state = nnx.split(model)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(out / "params", _plain(nnx.to_pure_dict(state)))
    checkpointer.wait_until_finished()
    tokenizer.save(out)
    (out / CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(model.config), indent=2))
    (out / WEIGHTS_FILE).write_text(json.dumps({"weight_dtype": weight_dtype}))


def stored_weight_dtype(path: Path) -> str:
    """How a converted checkpoint's projections are stored (auto: in its saved dtype)."""
    meta = path / WEIGHTS_FILE
    return json.loads(meta.read_text())["weight_dtype"] if meta.exists() else "auto"


def _plain(tree):
    """Quantized weights as {"values", "scale"} dicts: plain trees that Orbax writes."""
    return jax.tree.map(lambda x: {"values": x.values, "scale": x.scale}
                        if isinstance(x, QuantizedWeight) else x, tree,
                        is_leaf=lambda x: isinstance(x, QuantizedWeight))


def _quantized(tree):
    """The inverse of `_plain`."""
    return jax.tree.map(lambda x: QuantizedWeight(x["values"], x["scale"])
                        if isinstance(x, dict) and set(x) == {"values", "scale"} else x, tree,
                        is_leaf=lambda x: isinstance(x, dict) and set(x) == {"values", "scale"})


def read_config(path: Path) -> ModelConfig:
    raw = json.loads((path / CONFIG_FILE).read_text())
    if raw.get("rope_scaling"):
        raw["rope_scaling"] = RopeScaling(**raw["rope_scaling"])
    raw["eos_token_ids"] = tuple(raw["eos_token_ids"])
    return ModelConfig(**raw)


def restore(
    path: Path, dtype: jnp.dtype = jnp.float32, mesh: Mesh | None = None
) -> tuple[nnx.Module, Tokenizer]:
    """The model and tokenizer of a converted checkpoint, cast to `dtype`, its projections
    as they were stored (`stored_weight_dtype`: quantized ones are not quantized again).

    With a `mesh`, every parameter is restored straight into its sharding (as
    `sharding.param_sharding` lays it out), whatever mesh the checkpoint was saved from.
    """
    path = path.resolve()
    config = read_config(path)
    spec = get_model_spec(config.architecture)
    abstract = nnx.eval_shape(lambda: spec.build(config, nnx.Rngs(0), dtype))
    graphdef, state = nnx.split(abstract)
    rules = spec.weight_map(config)
    weight_dtype = stored_weight_dtype(path)
    axes = param_axes(config) if mesh is not None else {}

    def placed(x: jax.ShapeDtypeStruct, x_axes: tuple | None) -> jax.ShapeDtypeStruct:
        sharding = None if mesh is None else param_sharding(mesh, x_axes, x.shape)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    def abstract_param(name: str, x: jax.ShapeDtypeStruct):
        if rules[name].projection:
            x = abstract_stored(x.shape, x.dtype, weight_dtype)
        return map_stored(placed, x, axes.get(name))

    target = _plain(nnx.to_pure_dict(map_params(abstract_param, state)))
    params = ocp.StandardCheckpointer().restore(path / "params", target)
    nnx.replace_by_pure_dict(state, _quantized(params))
    return nnx.merge(graphdef, state), Tokenizer.from_dir(path)
