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
