"""Open whatever `--model` names — a GGUF file, a Hugging Face directory, or a checkpoint
written by `jaxserve convert` — as a model and its tokenizer."""

from pathlib import Path

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxserve.checkpoint import orbax_checkpoint
from jaxserve.checkpoint.tokenizer import Tokenizer
from jaxserve.checkpoint.weights import WeightsError, load_model, open_checkpoint


def load(
    path: str | Path, dtype: jnp.dtype = jnp.float32, mesh: Mesh | None = None
) -> tuple[nnx.Module, Tokenizer]:
    """The model with its weights on the device (or sharded over `mesh`), and its tokenizer."""
    path = Path(path)
    if orbax_checkpoint.is_converted(path):
        return orbax_checkpoint.restore(path, dtype, mesh)
    model = load_model(open_checkpoint(path), dtype, mesh)
    if path.suffix == ".gguf":
        tokenizer = Tokenizer.from_gguf(path)
    elif (path / "tokenizer.json").exists():
        tokenizer = Tokenizer.from_dir(path)
    else:
        raise WeightsError(f"{path}: no tokenizer.json beside the weights")
    return model, tokenizer
