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


@pytest.fixture(scope="session", autouse=True)
def compiled_steps_kept(tmp_path_factory):
    """Every engine the tests build keeps its compiled steps in one directory for the run
    (JAXSERVE_COMPILATION_CACHE_DIR), so an engine of a model and settings built before
    loads them instead of compiling again, as a warm restart does (a tiny model's
    kv-quantization invariants test: 33 s cold, 2 s warm; the suite 39 → 37 min). Tests of
    the cache itself pass their own directory; set the variable to keep one across runs."""
    if not os.environ.get("JAXSERVE_COMPILATION_CACHE_DIR"):
        os.environ["JAXSERVE_COMPILATION_CACHE_DIR"] = str(tmp_path_factory.mktemp("compiled"))
    yield


@pytest.fixture(autouse=True)
def server_invariants():
    """After every test, each server still up (tests/serving.py's running_server) is checked
    whole: idle, nothing leaked, still answering (serving.check_invariants)."""
    yield
    serving = sys.modules.get("serving")  # imported by every test module that starts one
    for server in [] if serving is None else list(serving.LIVE):
        server.check()
