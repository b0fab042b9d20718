"""Shared fixtures: the default real model and small random Hugging Face models."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from jaxserve.default_model import default_model_path  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The default model's GGUF file, fetched by the Makefile (or here when missing)."""
    return default_model_path()
