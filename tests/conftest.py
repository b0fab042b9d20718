"""Shared fixtures: the default real model and small random Hugging Face models."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pathlib import Path

import pytest

from jaxserve.default_model import default_model_path


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The default model's GGUF file, fetched by the Makefile (or here when missing)."""
    return default_model_path()
