"""LoRA adapters through the engine: rows of different adapters batched together get the
tokens they get alone, more adapters than slots take turns, nothing compiles, and a page
computed under one adapter is never reused under another."""

import pytest
from lora_adapters import save_random_adapter

from jaxserve import LLM, SamplingParams
from jaxserve.cpu_kernels import linear
from jaxserve.device.runner import compile_count
from jaxserve.models.layers import PackedWeight

TARGETS = [["q_proj", "v_proj"], "all-linear", ["o_proj", "down_proj"], ["gate_proj", "up_proj"],
           ["k_proj", "q_proj", "up_proj"], ["v_proj", "o_proj", "gate_proj"]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# few step shapes: every test warms them all up
SIZES = {"max_batch": 8, "token_budget": 32, "buckets": ((8, 32), (1, 8))}
# the slots' stacks on XLA (every row multiplies every slot's columns), or packed
# for a bf16 CPU kernel (each row its own slot's: cpu_kernels/linear.py's slot_linear)
KERNEL = next((b for b in linear.KERNELS if linear.available(b)), None)
BACKENDS = [pytest.param("xla", id="xla"),
            pytest.param(KERNEL, id="bf16-kernel",
                         marks=pytest.mark.skipif(KERNEL is None, reason="no bf16 CPU kernel"))]
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):",
           "A list of colours: red,", "Water boils at", "My favourite animal"]


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    """Six random adapters of rank 8 and 16 on different targets, as {name: path}."""
    root = tmp_path_factory.mktemp("adapters")
    paths = {}
    for i, targets in enumerate(TARGETS):
        paths[f"a{i}"] = root / f"a{i}"
        save_random_adapter(tiny_model, paths[f"a{i}"], rank=8 if i % 2 else 16,
                            targets=targets, seed=i, std=0.3)
    return paths


def tokens(llm: LLM, prompts: list[str], adapters: list[str | None]) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(prompts, GREEDY, adapter=adapters)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_of_four_adapters_and_the_base_batch_as_they_run_alone(tiny_model, adapters,
                                                                    backend):
    llm = LLM(tiny_model, **SIZES, num_pages=128, max_loras=4, max_lora_rank=16,
              lora={n: adapters[n] for n in ("a0", "a1", "a2", "a3")}, warmup=True,
              linear_backend=backend)
    packed = isinstance(llm.runner.adapter_slots.a["qkv"], PackedWeight)
    assert packed == (backend != "xla")  # on a kernel, each row takes its own slot's part
    names = ["a0", "a1", None, "a2", "a3", None]
    alone = [tokens(llm, [p], [n])[0] for p, n in zip(PROMPTS, names)]
    compiles = compile_count()
    together = tokens(llm, PROMPTS, names)  # every row in the same steps
    assert together == alone
    assert compile_count() == compiles  # the mix of adapters compiled nothing
    # the adapters matter: each changes its prompt's tokens from the base model's
    base = tokens(llm, PROMPTS, [None] * len(PROMPTS))
    assert all(base[i] != alone[i] for i, n in enumerate(names) if n is not None)
    llm.scheduler.check_invariants()


def test_more_adapters_than_slots_take_turns(tiny_model, adapters):
    llm = LLM(tiny_model, **SIZES, num_pages=128, max_loras=2, max_lora_rank=16,
              lora=adapters, warmup=True)
    names = [f"a{i % 6}" for i in range(12)]
    prompts = [PROMPTS[i % 6] + " and" * (i // 6) for i in range(12)]
    alone = [tokens(llm, [p], [n])[0] for p, n in zip(prompts, names)]
    swaps = llm.scheduler.adapter_slots.swaps
    compiles = compile_count()
    assert tokens(llm, prompts, names) == alone  # 6 adapters through 2 slots
    assert llm.scheduler.adapter_slots.swaps >= swaps + 4  # at least 4 more had to come in
    assert compile_count() == compiles
    slots = llm.scheduler.adapter_slots
    assert len(slots.holder) == 2 and not slots.users and len(slots.idle) == 2


def test_a_page_computed_under_one_adapter_is_not_reused_under_another(tiny_model, adapters):
    prompt = " ".join(["tokens to fill several pages"] * 12)
    fresh = LLM(tiny_model, **SIZES, num_pages=64, lora=adapters)
    want = tokens(fresh, [prompt], ["a1"])
    llm = LLM(tiny_model, **SIZES, num_pages=64, lora=adapters)
    tokens(llm, [prompt], ["a0"])  # caches the prompt's pages under a0
    hits = llm.scheduler.prefix_hits
    assert tokens(llm, [prompt], ["a1"]) == want
    assert llm.scheduler.prefix_hits == hits  # a1 found none of a0's pages
    tokens(llm, [prompt], ["a1"])
    assert llm.scheduler.prefix_hits > hits  # but it reuses its own


def test_an_unknown_adapter_is_refused(tiny_model, adapters):
    llm = LLM(tiny_model, **SIZES, num_pages=32, lora={"a0": adapters["a0"]})
    with pytest.raises(KeyError, match="no LoRA adapter named 'nope'"):
        llm.generate("hi", GREEDY, adapter="nope")
    plain = LLM(tiny_model, **SIZES, num_pages=32)
    with pytest.raises(KeyError, match="no LoRA adapter named 'a0'"):
        plain.generate("hi", GREEDY, adapter="a0")
