"""Executables kept between starts (device/executables.py): a second start loads every
bucket without compiling it, and generates what a start without the store generates."""

import logging

from jaxserve import LLM, SamplingParams
from jaxserve.device.executables import ExecutableStore

ENGINE = {"max_batch": 2, "token_budget": 8, "num_pages": 32, "page_size": 4, "warmup": True}
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def tokens(llm: LLM) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]


def test_a_second_start_loads_every_bucket_and_generates_the_same(tiny_model, tmp_path):
    cache = tmp_path / "cache"
    first = LLM(tiny_model, compilation_cache_dir=str(cache), **ENGINE)
    store = first.runner.executable_store
    buckets = len(first.runner.buckets.buckets()) + len(first.runner.buckets.token_sizes)
    assert (store.stored, store.loaded) == (buckets, 0)
    want = tokens(LLM(tiny_model, **ENGINE))  # no store: compiled in memory
    assert tokens(first) == want
    second = LLM(tiny_model, compilation_cache_dir=str(cache), **ENGINE)
    store = second.runner.executable_store
    assert (store.stored, store.loaded) == (0, buckets)
    assert tokens(second) == want
    assert second.runner.compiles_after_warmup == 0
    other = LLM(tiny_model, compilation_cache_dir=str(cache), **{**ENGINE, "num_pages": 48})
    assert other.runner.executable_store.loaded == 0  # another pool: other programs


def test_a_program_compiled_twice_in_a_process_is_stored_whole(tiny_model, tmp_path):
    """On CPU a program compiled a second time in one process serializes without its
    kernels' code: a store in another directory gets the process's first serialization,
    and what it loads runs."""
    first = LLM(tiny_model, compilation_cache_dir=str(tmp_path / "a"), **ENGINE)
    want = tokens(first)
    elsewhere = LLM(tiny_model, compilation_cache_dir=str(tmp_path / "b"), **ENGINE)
    assert elsewhere.runner.executable_store.loaded == 0
    assert tokens(elsewhere) == want
    again = LLM(tiny_model, compilation_cache_dir=str(tmp_path / "b"), **ENGINE)
    assert again.runner.executable_store.loaded > 0
    assert tokens(again) == want


def test_stale_and_torn_files(tiny_model, tmp_path, caplog):
    cache = tmp_path / "cache"
    LLM(tiny_model, compilation_cache_dir=str(cache), **ENGINE)
    directory = cache / "executables"
    stale = directory / "0123456789abcdef-feed.exe"  # other sources or another jax
    stale.write_bytes(b"old")
    files = sorted(directory.glob("*.exe"))
    files.remove(stale)
    files[0].write_bytes(b"torn")
    with caplog.at_level(logging.WARNING):
        llm = LLM(tiny_model, compilation_cache_dir=str(cache), **ENGINE)
    assert not stale.exists()
    assert llm.runner.executable_store.stored == 1  # the torn one, compiled again
    assert "compiling it again" in caplog.text
    assert tokens(llm) == tokens(LLM(tiny_model, **ENGINE))
    assert isinstance(llm.runner.executable_store, ExecutableStore)


RESTART_ON_8_DEVICES = """
import json, sys
from jaxserve import LLM, SamplingParams
model, cache = sys.argv[1:]
sizes = dict(max_batch=2, num_pages=64, page_size=4, token_budget=8, weight_dtype="f32",
             compilation_cache_dir=cache)
params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
out = {}
for name, mesh in [("one", {}), ("mesh", {"tp": 4, "dp": 2}), ("one again", {}),
                   ("mesh again", {"tp": 4, "dp": 2})]:
    llm = LLM(model, **mesh, **sizes)
    out[name] = [llm.generate([[5, 6, 7]], params)[0].token_ids,
                 llm.runner.executable_store.loaded]
print(json.dumps(out))
"""


def test_a_one_device_engine_loads_its_steps_for_one_device_among_eight(tiny_model, tmp_path):
    """Loaded back, an executable runs on the devices it was compiled for: jax's loader
    gives it every device of the process unless told, and a one-device engine restarted
    on a machine of 8 devices then failed its first step ("Expected args ... to have 8
    shards"); an engine of the same model and sizes on a mesh keeps steps of its own."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", RESTART_ON_8_DEVICES, str(tiny_model),
                          str(tmp_path / "cache")], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["one again"][0] == out["one"][0] == out["mesh"][0] == out["mesh again"][0]
    assert out["one"][1] == out["mesh"][1] == 0  # each compiled its own steps
    assert out["one again"][1] > 0 and out["mesh again"][1] > 0  # and loaded them back
