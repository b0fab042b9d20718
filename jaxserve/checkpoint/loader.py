"""Open whatever `--model` names — a GGUF file, a Hugging Face directory, or a checkpoint
written by `jaxserve convert` — as a model and its tokenizer."""

from pathlib import Path

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxserve.checkpoint import orbax_checkpoint
from jaxserve.checkpoint.tokenizer import Tokenizer
from jaxserve.checkpoint.weights import (
    WeightsError,
    load_model,
    open_checkpoint,
    store_projections,
)


def load(
    path: str | Path, dtype: jnp.dtype = jnp.float32, mesh: Mesh | None = None,
    weight_dtype: str = "auto",
) -> tuple[nnx.Module, Tokenizer]:
    """The model with its weights on the device (or sharded over `mesh`), its projections
    stored as `weight_dtype` says (models/layers.py), and its tokenizer."""
    path = Path(path)
    if orbax_checkpoint.is_converted(path):
        stored = orbax_checkpoint.stored_weight_dtype(path)
        model, tokenizer = orbax_checkpoint.restore(path, dtype, mesh)
        if weight_dtype in ("auto", stored):
            return model, tokenizer
        if stored != "auto":
            raise WeightsError(
                f"{path} stores its weights as {stored}: serve it with --weight-dtype "
                f"{stored} (or auto), or convert its source again with --weight-dtype "
                f"{weight_dtype}"
            )
        return store_projections(model, weight_dtype, mesh), tokenizer
    model = load_model(open_checkpoint(path), dtype, mesh, weight_dtype)
    if path.suffix == ".gguf":
        tokenizer = Tokenizer.from_gguf(path)
    elif (path / "tokenizer.json").exists():
        tokenizer = Tokenizer.from_dir(path)
    else:
        raise WeightsError(f"{path}: no tokenizer.json beside the weights")
    return model, tokenizer
