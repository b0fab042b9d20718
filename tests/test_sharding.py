"""Sharded weights and KV over a device mesh give the results of one device.

The partition rules are checked here on abstract meshes. Everything that needs 8
devices runs in a subprocess with `--xla_force_host_platform_device_count=8` (the
device count is fixed when jax starts, and the rest of the suite runs on one
device): this file is also that subprocess's script, `python test_sharding.py
SCENARIO DIR`, which prints one JSON line of measurements for the tests to judge.
"""

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # starts servers or multi-device processes

HERE = Path(__file__).resolve().parent
MESHES = [(8, 1), (4, 2), (2, 4)]  # (tp, dp)

# a small Qwen2 (biases, untied head) whose every sharded dimension divides by 8,
# with 4 KV heads: the cache shards at tp 2 and 4 and is replicated at tp 8
RANDOM = {
    "model_type": "qwen2",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
SMOLLM2 = {
    "num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "hidden": 576, "ffn": 1536,
    "vocab": 49152, "layers": 30,
}


# ---------------------------------------------------------------- rules (one device)


def abstract_mesh(tp: int, dp: int):
    from jax.sharding import AbstractMesh

    from jaxserve.device.sharding import DATA, MODEL

    return AbstractMesh((dp, tp), (DATA, MODEL))


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_smollm2_shards_every_layer_weight_but_replicates_its_3_kv_heads(tp):
    from jax.sharding import PartitionSpec as P

    from jaxserve.config import ModelConfig
    from jaxserve.device.sharding import DATA, MODEL, kv_sharding, param_sharding
    from jaxserve.models import param_axes

    m = SMOLLM2
    mesh = abstract_mesh(tp, 8 // tp)
    axes = param_axes(ModelConfig(
        "llama", m["vocab"], m["hidden"], m["ffn"], m["layers"], m["num_heads"],
        m["num_kv_heads"], m["head_dim"], tie_word_embeddings=True,
    ))
    q_dim, kv_dim = m["num_heads"] * m["head_dim"], m["num_kv_heads"] * m["head_dim"]
    shapes = {
        "embed": (m["vocab"], m["hidden"]),
        "layers/q_proj": (m["layers"], m["hidden"], q_dim),
        "layers/k_proj": (m["layers"], m["hidden"], kv_dim),
        "layers/o_proj": (m["layers"], q_dim, m["hidden"]),
        "layers/up_proj": (m["layers"], m["hidden"], m["ffn"]),
        "layers/down_proj": (m["layers"], m["ffn"], m["hidden"]),
        "layers/input_norm": (m["layers"], m["hidden"]),
    }
    specs = {name: param_sharding(mesh, axes[name], shape).spec for name, shape in shapes.items()}
    assert specs == {
        "embed": P(MODEL, None),
        "layers/q_proj": P(None, None, MODEL),  # 576 = 9 heads × 64 columns: heads split
        "layers/k_proj": P(None, None, MODEL),
        "layers/o_proj": P(None, MODEL, None),
        "layers/up_proj": P(None, None, MODEL),
        "layers/down_proj": P(None, MODEL, None),
        "layers/input_norm": P(None, None),
    }
    kv_shape = (m["layers"], m["num_kv_heads"], 64, 16, m["head_dim"])
    # KV heads replicated; pages split over the data shards (one pool each)
    assert kv_sharding(mesh, kv_shape).spec == P(None, None, DATA, None, None)


def test_a_dimension_that_does_not_divide_is_replicated():
    from jax.sharding import PartitionSpec as P

    from jaxserve.device.sharding import DATA, MODEL, kv_sharding, param_sharding

    mesh = abstract_mesh(3, 1)
    gate = ("layers", "embed", "mlp")
    assert param_sharding(mesh, gate, (2, 64, 96)).spec == P(None, None, MODEL)
    assert param_sharding(mesh, gate, (2, 64, 128)).spec == P(None, None, None)
    assert param_sharding(mesh, (None, "norm"), (64, 192)).spec == P(None, None)
    assert kv_sharding(mesh, (2, 6, 8, 4, 16)).spec == P(None, MODEL, DATA, None, None)
    assert kv_sharding(abstract_mesh(1, 3), (2, 6, 8, 4, 16)).spec == P(
        None, MODEL, None, None, None
    )  # 8 pages do not split over 3 data shards


def test_mesh_and_config_refuse_bad_sizes():
    from jaxserve.config import EngineConfig
    from jaxserve.device.sharding import make_mesh

    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh(tp=8, dp=2, devices=[object()] * 8)
    with pytest.raises(ValueError, match="tp and dp"):
        EngineConfig(tp=0)


def test_cli_engine_flags_carry_tp_and_dp():
    import argparse

    from jaxserve.cli import _engine_config, _engine_flags

    parser = argparse.ArgumentParser()
    _engine_flags(parser)
    config = _engine_config(parser.parse_args(["--tp", "4", "--dp", "2"]))
    assert (config.tp, config.dp) == (4, 2)


# ---------------------------------------------------------------- 8 devices, in a subprocess


def spawn(
    scenario: str, directory: Path, *extra: int, devices: int = 8
) -> tuple[subprocess.Popen, Path]:
    """This file as a script on `devices` forced CPU devices; its output goes to STEM.out/.err."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    stem = directory / "-".join([scenario, *map(str, extra)])
    script = [sys.executable, str(Path(__file__).resolve()), scenario, str(directory)]
    # files, not pipes: a process blocked on a full pipe would stall its peer's collectives
    with open(f"{stem}.out", "w") as out, open(f"{stem}.err", "w") as err:
        process = subprocess.Popen(
            script + [str(x) for x in extra], stdout=out, stderr=err, env=env, cwd=HERE.parent
        )
    return process, stem


def wait_all(spawned: list[tuple[subprocess.Popen, Path]], timeout: float = 400) -> list[dict]:
    """Each process's JSON line, once all exit; all are killed if one hangs."""
    deadline = time.monotonic() + timeout
    try:
        for process, _ in spawned:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for process, _ in spawned:
            if process.poll() is None:
                process.kill()
                process.wait()
    results = []
    for process, stem in spawned:
        assert process.returncode == 0, Path(f"{stem}.err").read_text()[-4000:]
        results.append(json.loads(Path(f"{stem}.out").read_text().strip().splitlines()[-1]))
    return results


def run_worker(scenario: str, directory: Path) -> dict:
    return wait_all([spawn(scenario, directory)])[0]


def run_on_random_model(tmp_path_factory, scenario: str) -> dict:
    """Run `scenario` on 8 devices over a fresh random RANDOM-shaped model."""
    directory = tmp_path_factory.mktemp(f"sharded-{scenario}")
    write_random_model(directory / "model")
    return run_worker(scenario, directory)


@pytest.fixture(scope="module")
def random_run(tmp_path_factory) -> dict:
    return run_on_random_model(tmp_path_factory, "random")


def test_random_model_logits_match_one_device_on_every_mesh(random_run):
    for tp, dp in MESHES:
        assert random_run["logits_error"][f"{tp}x{dp}"] < 1e-4, (tp, dp)


def test_kv_cache_shards_over_kv_heads_only_where_they_divide(random_run):
    # 4 KV heads: sharded over tp 4 and 2, replicated over tp 8; pages over the data shards
    assert random_run["kv_spec"] == {
        "8x1": [None, None, "data", None, None],
        "4x2": [None, "model", "data", None, None],
        "2x4": [None, "model", "data", None, None],
    }


def test_tp8_holds_an_eighth_of_the_layer_weights_per_device(random_run):
    held, total = random_run["layer_bytes_per_device"], random_run["layer_bytes_total"]
    assert len(held) == 8
    # only the norms (2 × [layers, 64]) are replicated
    assert all(total / 8 <= b <= 1.03 * total / 8 for b in held), (held, total)


def test_orbax_checkpoint_from_tp8_restores_into_tp2_dp4(random_run):
    orbax = random_run["orbax"]
    assert orbax["logits_error"] < 1e-4
    assert orbax["q_proj_spec"] == [None, None, "model"]
    assert orbax["devices"] == 8


def test_int8_weights_and_their_scales_shard_like_the_weights(random_run):
    int8 = random_run["int8"]
    assert int8["logits_error"] < 1e-4  # tp 4 × dp 2 computes what one device does
    assert 0 < int8["error_vs_f32"] < 0.05  # rounded, not another computation
    # q_proj is column-parallel: its values and its per-column scales split alike
    assert int8["values_spec"] == [None, None, "model"]
    assert int8["scale_spec"] == [None, "model"]


def test_int8_kv_and_its_scales_shard_over_kv_heads_and_pages(random_run):
    kv = random_run["int8_kv"]
    assert kv["logits_error"] < 1e-4  # tp 4 × dp 2 computes what one device does
    assert 0 < kv["error_vs_f32"] < 0.05  # rounded, not another computation
    assert kv["values_dtype"] == "int8"
    # the scales sit with their values: over KV heads (tp 4 divides 4) and data shards
    assert kv["values_spec"] == [None, "model", "data", None, None]
    assert kv["scale_spec"] == [None, "model", "data", None]
    engine = random_run["engine_int8_kv"]
    assert engine == {"tokens_match": True, "compiles_after_warmup": 0}


def test_fp8_kv_is_calibrated_and_served_on_a_mesh(random_run):
    """fp8 KV on tp 4 × dp 2: calibrated at start on the first data shard's pages, its
    centers and scales laid out over KV heads, the tokens those of one device."""
    engine = random_run["engine_fp8_kv"]
    assert engine.pop("center_spec") == [None, "model", None]
    assert engine == {"tokens_match": True, "compiles_after_warmup": 0}


def test_lora_adapters_on_a_mesh_give_the_tokens_of_one_device(random_run):
    """tp 4 (and tp 4 × dp 2): 3 adapters through 2 slots and base rows, token for token
    as on one device; A is split like a row-parallel projection's input, B like a
    column-parallel one's output."""
    for key in ("engine_lora", "engine_lora_dp"):
        engine = random_run[key]
        assert engine["tokens_match"] and engine["adapters_change_tokens"], (key, engine)
        assert engine["compiles_after_warmup"] == 0
        assert engine["slot_specs"] == {"q_proj_b": [None, None, "model"],
                                        "o_proj_a": [None, "model", None]}


def test_engine_on_a_mesh_generates_the_tokens_of_one_device_without_compiling(random_run):
    engine = random_run["engine"]
    assert engine["tokens_match"]
    assert engine["compiles_after_warmup"] == 0


@pytest.fixture(scope="module")
def pallas_run(tmp_path_factory) -> dict:
    return run_on_random_model(tmp_path_factory, "pallas")


def test_pallas_attention_runs_on_each_devices_own_heads(pallas_run):
    """A Pallas call has no partitioning rule: left to the compiler, it would gather
    the layer's KV pool to every device. Where the 4 KV heads divide tp, each device's
    kernel gets its own heads (8 query heads / tp); at tp 8 the cache is replicated
    and so is the kernel. The tokens are one device's."""
    assert pallas_run["kernel_heads"] == {"2x1": [4], "4x2": [2], "8x1": [8]}
    assert all(pallas_run["tokens_match"].values()), pallas_run["tokens_match"]


def test_head_local_pallas_attention_lowers_to_triton_in_a_manual_model_region(pallas_run):
    """No GPU here: lowering for cuda checks what Triton and the partitioner accept."""
    lowered = pallas_run["cuda_lowering"]
    assert lowered["triton"] and lowered["manual_model"]
    assert lowered["local_pool"] == "3x4x65x16x128xbf16"  # 8 KV heads over tp 2


def test_smollm2_greedy_tokens_match_one_device_on_every_mesh(tmp_path):
    run = run_worker("smollm2", tmp_path)
    want = run["tokens"]["1x1"]
    assert len(want) == 2 and all(len(t) == 8 for t in want)
    for tp, dp in MESHES:
        key = f"{tp}x{dp}"
        assert run["tokens"][key] == want, key
        assert run["compiles_after_warmup"][key] == 0, key
    assert "Paris" in run["answers"]["1x1"]
    # tp 8: each device holds an eighth of the layer weights; only the norms (0.03%) are
    # replicated, attention included (576 = 9 heads × 64 columns split 72 to a device)
    held, total = run["layer_bytes_per_device"], run["layer_bytes_total"]
    assert len(held) == 8 and all(total / 8 <= b <= 1.01 * total / 8 for b in held)


def test_a_one_device_engine_loads_its_steps_for_one_device_among_eight(tmp_path):
    """Loaded back (device/executables.py), an executable runs on the devices it was
    compiled for: jax's loader gives it every device of the process unless told, and a
    one-device engine restarted on a machine of 8 devices then failed its first step
    ("Expected args ... to have 8 shards"); an engine of the same model and sizes on a
    mesh keeps steps of its own."""
    out = run_worker("restart", tmp_path)
    assert out["one again"][0] == out["one"][0] == out["mesh"][0] == out["mesh again"][0]
    assert out["one"][1] == out["mesh"][1] == 0  # each compiled its own steps
    assert out["one again"][1] > 0 and out["mesh again"][1] > 0  # and loaded them back


def test_two_processes_of_4_devices_run_as_one_8_device_mesh(tmp_path):
    write_random_model(tmp_path / "model")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    runs = wait_all([spawn("multihost", tmp_path, i, port, devices=4) for i in range(2)])
    for run in runs:
        assert (run["process_count"], run["devices"], run["local_devices"]) == (2, 8, 4)
        assert max(run["logits_error"].values()) < 1e-4, run["logits_error"]


def test_two_serve_processes_answer_through_process_0_as_one_process_does(tmp_path):
    """`jaxserve serve --coordinator … --num-processes 2 --process-id I` on 4 CPU devices
    each, tp 4 × dp 2: process 0 serves HTTP and schedules, process 1 runs its steps.
    The greedy answers equal one process's; SIGTERM to process 0 ends both with 0."""
    from serving import free_port, running_server

    from jaxserve import LLM, SamplingParams

    model = tmp_path / "model"
    write_random_model(model)
    sizes = ["--max-batch", "2", "--num-pages", "64", "--page-size", "4",
             "--token-budget", "8", "--weight-dtype", "f32"]
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 256, int(n)).tolist() for n in rng.integers(2, 30, 6)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    alone = LLM(model, max_batch=2, num_pages=64, page_size=4, token_budget=8,
                weight_dtype="f32")
    want = [o.text for o in alone.generate(prompts, params)]

    coordinator = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "JAX_PLATFORMS": "cpu"}
    flags = [*sizes, "--tp", "4", "--dp", "2", "--coordinator", coordinator,
             "--num-processes", "2", "--max-queue", "16"]
    log1 = tmp_path / "process-1.log"
    with open(log1, "w") as out:
        follower = subprocess.Popen(
            [sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(model), *flags,
             "--process-id", "1"], stdout=out, stderr=subprocess.STDOUT, env=env,
            cwd=HERE.parent,
        )
    try:
        with running_server(model, *flags, "--process-id", "0", env=env) as (url, leader):
            got = asyncio.run(_complete_all(url, prompts, params.max_tokens))
            # one row sampling among greedy ones: the shards' steps take different paths
            # unless every branch is chosen for the whole mesh (a hang in gloo once)
            mixed = asyncio.run(_complete_all(url, prompts, params.max_tokens,
                                              [0.9] + [0.0] * (len(prompts) - 1)))
            metrics = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
        assert leader.returncode == 0  # SIGTERM: drained, followers released
        assert follower.wait(timeout=60) == 0, log1.read_text()[-3000:]
    finally:
        if follower.poll() is None:
            follower.kill()
    assert got == want
    assert mixed[1:] == want[1:] and mixed[0]
    assert "jaxserve:compiles_after_warmup_total 0.0" in metrics
    assert "process 0 sent STOP" in log1.read_text()


def test_a_lost_process_ends_process_0_with_a_clear_error_not_a_hang(tmp_path):
    """Process 1 is killed: the request in flight fails cleanly (500, OpenAI error
    object), and jax's coordination service ends process 0 on the missing heartbeats."""
    from serving import free_port

    model = tmp_path / "model"
    write_random_model(model)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "JAX_PLATFORMS": "cpu"}
    port = free_port()
    flags = ["--model", str(model), "--max-batch", "2", "--num-pages", "64", "--page-size",
             "4", "--token-budget", "4", "--tp", "4", "--dp", "2", "--coordinator",
             f"127.0.0.1:{free_port()}", "--num-processes", "2"]
    procs = []
    for i in (1, 0):
        log = open(tmp_path / f"process-{i}.log", "w")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "jaxserve.cli", "serve", *flags, "--process-id", str(i),
             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=env,
            cwd=HERE.parent,
        ))
    follower, leader = procs
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert time.monotonic() < deadline and leader.poll() is None, "never healthy"
            try:
                if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        follower.kill()
        follower.wait()
        body = json.dumps({"model": "model", "prompt": [5, 6, 7], "max_tokens": 3}).encode()
        request = urllib.request.Request(url + "/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(request, timeout=60)
        assert failed.value.code == 500
        assert set(json.loads(failed.value.read())["error"]) == {"message", "type", "param",
                                                                 "code"}
        assert leader.wait(timeout=90) != 0  # ended by the runtime, well before any hang
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    log0 = (tmp_path / "process-0.log").read_text()
    assert "another task died" in log0


async def _complete_all(url: str, prompts: list[list[int]], max_tokens: int,
                        temperatures: list[float] | None = None) -> list[str]:
    """Completions of every prompt (greedy unless `temperatures` say), all in flight at
    once (both data shards busy)."""
    import aiohttp

    async def one(session, prompt, temperature):
        body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens,
                "temperature": temperature, "seed": 1, "ignore_eos": True}
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return (await resp.json())["choices"][0]["text"]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        temperatures = temperatures or [0.0] * len(prompts)
        return await asyncio.gather(*(one(session, p, t) for p, t in zip(prompts, temperatures)))


# ---------------------------------------------------------------- the subprocess side


def write_random_model(path: Path, seed: int = 0) -> None:
    """A random RANDOM-shaped Hugging Face directory: config, safetensors, word tokenizer."""
    import safetensors.numpy
    import tokenizers

    c = RANDOM
    rng = np.random.default_rng(seed)
    d, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]

    def w(*shape: int, scale: float = 0.1, mean: float = 0.0) -> np.ndarray:
        return (mean + scale * rng.standard_normal(shape)).astype(np.float32)

    tensors = {
        "model.embed_tokens.weight": w(v, d, scale=1.0),
        "model.norm.weight": w(d, mean=1.0),
        "lm_head.weight": w(v, d),
    }
    shapes = {
        "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (q, d), "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.weight": (kv, d), "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.weight": (kv, d), "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (d, q),
        "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d),
        "mlp.down_proj.weight": (d, f),
    }
    for i in range(c["num_hidden_layers"]):
        for name, shape in shapes.items():
            mean = 1.0 if "layernorm" in name else 0.0
            tensors[f"model.layers.{i}.{name}"] = w(*shape, mean=mean)
    path.mkdir(parents=True)
    safetensors.numpy.save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(c))
    vocab = {f"w{i}": i for i in range(v)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w1"}))


def _layer_bytes(state) -> tuple[list[int], int]:
    """Bytes of the decoder layers' weights on each device, and in all."""
    import jax

    from jaxserve.device.sharding import device_bytes

    layers = state["layers"]
    held = device_bytes(layers)
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(layers))
    return [held[d] for d in sorted(held, key=lambda d: d.id)], total


PAGE_SIZE, NUM_PAGES = 4, 40


def _logits_over_steps(model, mesh=None, kv_dtype: str = "f32") -> tuple[np.ndarray, object]:
    """Logits of every token of a prefill of 3 prompts and 3 decode steps (pages shuffled
    between sequences), run unsharded or on `mesh`, KV stored as `kv_dtype`; and the
    final KV cache."""
    import dataclasses

    from flax import nnx

    from jaxserve.device.batch import pack_step
    from jaxserve.device.kv_cache import KV_STORAGE, SCALED, init_kv_cache
    from jaxserve.device.sharding import Layout
    from jaxserve.device.step import forward, sharded_forward
    from jaxserve.host.plan import Chunk
    from jaxserve.models import param_axes

    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, RANDOM["vocab_size"], n).tolist() for n in (1, 7, 13)]
    free = rng.permutation(np.arange(1, NUM_PAGES)).tolist()
    pages = [[free.pop() for _ in range(8)] for _ in prompts]
    steps = [[Chunk(p, 0, pg) for p, pg in zip(prompts, pages)]]
    length = [len(p) for p in prompts]
    for _ in range(3):  # decode steps, one token per sequence
        nxt = rng.integers(0, RANDOM["vocab_size"], len(prompts)).tolist()
        steps.append([Chunk([t], n, pg) for t, n, pg in zip(nxt, length, pages)])
        length = [n + 1 for n in length]

    cfg = model.config
    graphdef, state = nnx.split(model)
    kv_shape = (cfg.num_layers, cfg.num_kv_heads, NUM_PAGES, PAGE_SIZE, cfg.head_dim)
    scaled = kv_dtype in SCALED
    layout = None if mesh is None else Layout.build(
        mesh, state, kv_shape, param_axes(cfg), scaled
    )
    run = forward if layout is None else sharded_forward(layout)
    kv = init_kv_cache(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, NUM_PAGES, PAGE_SIZE,
        KV_STORAGE[kv_dtype],
        sharding=None if layout is None else layout.kv_cache.k,
        scale_sharding=None if layout is None else layout.kv_cache.k_scale,
    )
    out = []
    for chunks in steps:
        inputs = pack_step(chunks, PAGE_SIZE, 32, 4, 8, spare_row=4)
        n = sum(len(c.token_ids) for c in chunks)
        meta = dataclasses.replace(inputs.metadata, logits_indices=np.arange(n, dtype=np.int32))
        logits, kv = run(graphdef, state, kv, inputs.token_ids, inputs.positions, meta)
        out.append(np.asarray(logits))
    return np.concatenate(out), kv


def _engine_check(model_dir: Path, tp: int, dp: int, kv_dtype: str = "auto",
                  adapters: dict[str, Path] | None = None) -> dict:
    """Greedy tokens of mixed requests on one device and, after warm-up, on a tp × dp mesh,
    KV stored as `kv_dtype`; with `adapters` (LoRA, name -> directory) the requests take
    them and the base model in turn."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.device.runner import compile_count

    rng = np.random.default_rng(2)
    requests = [rng.integers(3, 256, int(n)).tolist() for n in rng.integers(1, 40, 6)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    # 3 buckets: (1 token, 1 row), (2, 1), (2, 2)
    # f32 projections on both: auto picks bf16 on the AMX kernel for one CPU device only
    sizes = {"max_batch": 2, "num_pages": 64, "page_size": 4, "token_budget": 2,
             "kv_dtype": kv_dtype, "weight_dtype": "f32"}
    names = None
    if adapters:
        sizes.update(lora=adapters, max_loras=2, max_lora_rank=8)
        names = [[*adapters, None][i % (len(adapters) + 1)] for i in range(len(requests))]
    alone = LLM(model_dir, **sizes).generate(requests, params, adapter=names)
    llm = LLM(model_dir, tp=tp, dp=dp, **sizes)
    llm.runner.warmup(repeats=1)
    before = compile_count()
    sharded = llm.generate(requests, params, adapter=names)
    result = {
        "tokens_match": [o.token_ids for o in sharded] == [o.token_ids for o in alone],
        "compiles_after_warmup": llm.runner.compiles_after_warmup + compile_count() - before,
    }
    if kv_dtype == "fp8":
        result["center_spec"] = list(llm.runner.kv_cache.k_center.sharding.spec)
    if adapters:  # and they matter: the base model's tokens differ
        base = llm.generate(requests, params)
        result["adapters_change_tokens"] = [o.token_ids for o in base] != [
            o.token_ids for o in alone]
        slots = llm.runner.adapter_slots
        result["slot_specs"] = {"q_proj_b": list(slots.b["q_proj"].sharding.spec),
                                "o_proj_a": list(slots.a["o"].sharding.spec)}
    return result


def _random_scenario(directory: Path) -> dict:
    from flax import nnx

    from jaxserve.checkpoint import orbax_checkpoint
    from jaxserve.checkpoint.loader import load
    from jaxserve.device.sharding import make_mesh

    model_dir = directory / "model"
    start = time.perf_counter()
    want, _ = _logits_over_steps(load(model_dir)[0])
    result: dict = {"logits_error": {}, "kv_spec": {}, "seconds": {}}
    result["seconds"]["1x1"] = round(time.perf_counter() - start, 1)
    for tp, dp in MESHES:
        mesh = make_mesh(tp, dp)
        model, tokenizer = load(model_dir, mesh=mesh)
        got, kv = _logits_over_steps(model, mesh)
        key = f"{tp}x{dp}"
        result["logits_error"][key] = float(np.abs(got - want).max())
        result["kv_spec"][key] = list(kv.k.sharding.spec)
        result["seconds"][key] = round(time.perf_counter() - start, 1)
        if tp == 8:
            held, total = _layer_bytes(nnx.state(model))
            result["layer_bytes_per_device"], result["layer_bytes_total"] = held, total
            orbax_checkpoint.save(model, tokenizer, directory / "tp8")

    mesh = make_mesh(2, 4)
    restored, _ = load(directory / "tp8", mesh=mesh)
    got, _ = _logits_over_steps(restored, mesh)
    q = nnx.state(restored)["layers"]["q_proj"].get_value()
    result["orbax"] = {
        "logits_error": float(np.abs(got - want).max()),
        "q_proj_spec": list(q.sharding.spec),
        "devices": len(q.sharding.device_set),
    }
    result["seconds"]["orbax"] = round(time.perf_counter() - start, 1)
    want_int8, _ = _logits_over_steps(load(model_dir, weight_dtype="int8")[0])
    mesh = make_mesh(4, 2)
    quantized = load(model_dir, mesh=mesh, weight_dtype="int8")[0]
    got, _ = _logits_over_steps(quantized, mesh)
    q = nnx.state(quantized)["layers"]["q_proj"].get_value()
    result["int8"] = {
        "logits_error": float(np.abs(got - want_int8).max()),
        "error_vs_f32": float(np.abs(want_int8 - want).max() / np.abs(want).max()),
        "values_spec": list(q.values.sharding.spec), "scale_spec": list(q.scale.sharding.spec),
    }
    want_kv, _ = _logits_over_steps(load(model_dir)[0], kv_dtype="int8")
    got, kv = _logits_over_steps(load(model_dir, mesh=mesh)[0], mesh, kv_dtype="int8")
    result["int8_kv"] = {
        "logits_error": float(np.abs(got - want_kv).max()),
        "error_vs_f32": float(np.abs(want_kv - want).max() / np.abs(want).max()),
        "values_spec": list(kv.k.sharding.spec), "scale_spec": list(kv.k_scale.sharding.spec),
        "values_dtype": str(kv.k.dtype),
    }
    result["engine"] = _engine_check(model_dir, 4, 2)
    result["engine_int8_kv"] = _engine_check(model_dir, 4, 2, "int8")
    result["engine_fp8_kv"] = _engine_check(model_dir, 4, 2, "fp8")
    sys.path.insert(0, str(HERE.parent / "bench"))
    from lora import write_adapter

    config = load(model_dir)[0].config
    adapters = {f"a{i}": directory / f"adapter-{i}" for i in range(3)}
    for i, path in enumerate(adapters.values()):
        write_adapter(path, config, rank=4 + 4 * (i % 2), seed=i, std=0.2)
    result["engine_lora"] = _engine_check(model_dir, 4, 1, adapters=adapters)
    result["engine_lora_dp"] = _engine_check(model_dir, 4, 2, adapters=adapters)
    result["seconds"]["engine"] = round(time.perf_counter() - start, 1)
    return result


def _multihost_scenario(directory: Path, process_id: int, port: int) -> dict:
    """One of two processes with 4 CPU devices each, joined into one 8-device runtime."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{port}", num_processes=2, process_id=process_id, initialization_timeout=60
    )
    from jaxserve.checkpoint.loader import load
    from jaxserve.device.sharding import make_mesh

    model_dir = directory / "model"
    want, _ = _logits_over_steps(load(model_dir)[0])  # on this process's first device
    result: dict = {
        "process_count": jax.process_count(),
        "devices": jax.device_count(),
        "local_devices": jax.local_device_count(),
        "logits_error": {},
    }
    mesh = make_mesh(8, 1)  # the model axis spans both processes
    got, _ = _logits_over_steps(load(model_dir, mesh=mesh)[0], mesh)
    result["logits_error"]["8x1"] = float(np.abs(got - want).max())
    return result


def _smollm2_scenario(directory: Path) -> dict:
    from flax import nnx

    from jaxserve import LLM, SamplingParams
    from jaxserve.checkpoint import orbax_checkpoint
    from jaxserve.checkpoint.default_model import default_model_path
    from jaxserve.device.runner import compile_count

    question = "What is the capital of France?"
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    # three buckets, (1|2|4 tokens, 1 row), and a short context keep warm-up cheap
    sizes = {"max_batch": 1, "num_pages": 8, "token_budget": 4, "weight_dtype": "f32"}
    result: dict = {"tokens": {}, "answers": {}, "compiles_after_warmup": {}, "seconds": {}}

    def serve(source: Path, tp: int, dp: int) -> LLM:
        start = time.perf_counter()
        llm = LLM(source, tp=tp, dp=dp, **sizes)
        loaded = time.perf_counter()
        if tp * dp > 1:  # one device is the reference: its tokens are all it gives
            llm.runner.warmup(repeats=1)
        warm = time.perf_counter()
        before = compile_count()
        chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": question}])
        prompts = [chat, "Once upon a time, by the sea,"]
        outputs = llm.generate(prompts, params)
        key = f"{tp}x{dp}"
        result["tokens"][key] = [o.token_ids for o in outputs]
        result["answers"][key] = outputs[0].text
        if tp * dp > 1:
            result["compiles_after_warmup"][key] = (
                llm.runner.compiles_after_warmup + compile_count() - before
            )
        result["seconds"][key] = [
            round(t, 1) for t in (loaded - start, warm - loaded, time.perf_counter() - warm)
        ]
        return llm

    # GGUF straight into tp 8 shards, then an Orbax checkpoint written from that mesh
    # serves one device and the other meshes (the GGUF file is slow to parse: once only)
    llm = serve(default_model_path(), 8, 1)
    held, total = _layer_bytes(llm.runner.state)
    result["layer_bytes_per_device"], result["layer_bytes_total"] = held, total
    model = nnx.merge(llm.runner.graphdef, llm.runner.state)
    orbax_checkpoint.save(model, llm.tokenizer, directory / "tp8")
    del llm, model
    for tp, dp in [(1, 1), (4, 2), (2, 4)]:
        serve(directory / "tp8", tp, dp)
    return result


def _pallas_scenario(directory: Path) -> dict:
    """The Pallas backend (interpreted on CPU) on meshes, beside one device's XLA path;
    and the head-local kernel lowered for cuda on a tp=2 mesh."""
    import jax
    import jax.numpy as jnp

    import jaxserve.device.attention as attention
    from jaxserve.config import SamplingParams
    from jaxserve.device.sharding import make_mesh
    from jaxserve.llm import LLM
    from jaxserve.pallas_kernels.ragged_attention import ragged_paged_attention

    heads_seen = []

    def spy(q, *args, **kwargs):
        heads_seen.append(q.shape[1])
        return ragged_paged_attention(q, *args, **kwargs)

    attention.ragged_paged_attention = spy
    prompts, params = [[5, 6, 7, 8], [9, 10]], SamplingParams(max_tokens=6, temperature=0)
    sizes = {"max_batch": 2, "num_pages": 64, "page_size": 4, "token_budget": 16,
             "max_model_len": 64, "weight_dtype": "f32"}

    def tokens(tp, dp, backend):
        llm = LLM(directory / "model", tp=tp, dp=dp, attention_backend=backend, **sizes)
        return [out.token_ids for out in llm.generate(prompts, params)]

    want = tokens(1, 1, "xla")
    kernel_heads, tokens_match = {}, {}
    for tp, dp in [(2, 1), (4, 2), (8, 1)]:
        heads_seen.clear()
        tokens_match[f"{tp}x{dp}"] = tokens(tp, dp, "pallas-interpret") == want
        kernel_heads[f"{tp}x{dp}"] = sorted(set(heads_seen))

    s = jax.ShapeDtypeStruct
    cache = s((3, 8, 65, 16, 128), jnp.bfloat16)  # every layer's pool, as the model passes

    def head_local(q, k, v, *index):  # index: cu_q_lens, kv_lens, page_table, flags, layer
        return attention._head_local(attention._pallas(0.1), k.shape[1])(q, k, v, *index)

    with jax.set_mesh(make_mesh(2, 1)):
        text = jax.jit(head_local).trace(
            s((40, 32, 128), jnp.float32), cache, cache, s((5,), jnp.int32), s((4,), jnp.int32),
            s((4, 16), jnp.int32), s((4,), jnp.int32), s((), jnp.int32),
        ).lower(lowering_platforms=("cuda",)).as_text()
    manual = next((line for line in text.splitlines() if "manual_computation" in line), "")
    local_pool = re.search(r"tensor<(\d+x\d+x65x16x128xbf16)>", manual)
    return {
        "kernel_heads": kernel_heads,
        "tokens_match": tokens_match,
        "cuda_lowering": {
            "triton": "xla.gpu.triton" in text,
            "manual_model": 'manual_axes={"model"}' in manual,
            "local_pool": local_pool and local_pool[1],
        },
    }


def _restart_scenario(directory: Path) -> dict:
    """A one-device engine and a tp 4 × dp 2 one of the same sizes, each started twice
    with one store: each start's greedy tokens and the steps it loaded."""
    from jaxserve import LLM, SamplingParams

    write_random_model(directory / "model")
    sizes = {"max_batch": 2, "num_pages": 64, "page_size": 4, "token_budget": 8,
             "weight_dtype": "f32", "compilation_cache_dir": str(directory / "cache")}
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = {}
    for name, mesh in [("one", {}), ("mesh", {"tp": 4, "dp": 2}), ("one again", {}),
                       ("mesh again", {"tp": 4, "dp": 2})]:
        llm = LLM(directory / "model", **mesh, **sizes)
        out[name] = [llm.generate([[5, 6, 7]], params)[0].token_ids,
                     llm.runner.executable_store.loaded]
    return out


if __name__ == "__main__":
    scenario, directory, *extra = sys.argv[1:]
    run = {
        "random": _random_scenario,
        "pallas": _pallas_scenario,
        "smollm2": _smollm2_scenario,
        "multihost": _multihost_scenario,
        "restart": _restart_scenario,
    }[scenario]
    print(json.dumps(run(Path(directory), *map(int, extra))))
