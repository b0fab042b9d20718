"""Converted checkpoints: parameters saved with Orbax, config and tokenizer beside them.

Restoring skips dequantization and renaming, so it starts faster than reading
the source again; the layout is:

    NAME/jaxserve_config.json   the ModelConfig
    NAME/params/                Orbax StandardCheckpointer output
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

CONFIG_FILE = "jaxserve_config.json"


def is_converted(path: Path) -> bool:
    return (path / CONFIG_FILE).exists()


def save(model: nnx.Module, tokenizer: Tokenizer, out: Path) -> None:
    """Write params, config and tokenizer under `out` (which must not hold a checkpoint yet)."""
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    _, state = nnx.split(model)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(out / "params", nnx.to_pure_dict(state))
    checkpointer.wait_until_finished()
    tokenizer.save(out)
    (out / CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(model.config), indent=2))


def read_config(path: Path) -> ModelConfig:
    raw = json.loads((path / CONFIG_FILE).read_text())
    if raw.get("rope_scaling"):
        raw["rope_scaling"] = RopeScaling(**raw["rope_scaling"])
    raw["eos_token_ids"] = tuple(raw["eos_token_ids"])
    return ModelConfig(**raw)


def restore(
    path: Path, dtype: jnp.dtype = jnp.float32, mesh: Mesh | None = None
) -> tuple[nnx.Module, Tokenizer]:
    """The model and tokenizer of a converted checkpoint, cast to `dtype`.

    With a `mesh`, every parameter is restored straight into its sharding (as
    `sharding.param_sharding` lays it out), whatever mesh the checkpoint was saved from.
    """
    path = path.resolve()
    config = read_config(path)
    spec = get_model_spec(config.architecture)
    abstract = nnx.eval_shape(lambda: spec.build(config, nnx.Rngs(0), dtype))
    graphdef, state = nnx.split(abstract)

    axes = param_axes(config) if mesh is not None else {}

    def abstract_param(name: str, x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        sharding = None if mesh is None else param_sharding(mesh, axes[name], x.shape)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    target = nnx.to_pure_dict(map_params(abstract_param, state))
    params = ocp.StandardCheckpointer().restore(path / "params", target)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state), Tokenizer.from_dir(path)
