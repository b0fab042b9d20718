"""Shared fixtures: the default real model and small random Hugging Face models."""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pathlib import Path

import pytest

from jaxserve.checkpoint.default_model import default_model_path


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The default model's GGUF file, fetched by the Makefile (or here when missing)."""
    return default_model_path()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, smollm2_gguf) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer, saved once for the server tests."""
    from serving import save_tiny_chat_model

    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat-model"), smollm2_gguf)


@pytest.fixture(autouse=True)
def server_invariants():
    """After every test, each server still up (tests/serving.py's running_server) is checked
    whole: idle, nothing leaked, still answering (serving.check_invariants)."""
    yield
    serving = sys.modules.get("serving")  # imported by every test module that starts one
    for server in [] if serving is None else list(serving.LIVE):
        server.check()
