"""A research team's own model, served through the documented path.

A tiny GPT-style decoder (LayerNorm with biases, learned position embeddings, fused QKV,
GELU, tied LM head, a Python loop over per-layer modules rather than a scan) is written
here against `ServableModel`, given a weight map of GPT-2's tensor names, registered as
"tinygpt" and saved as a Hugging Face style directory with a tokenizer. `LLM` must then
generate exactly the greedy tokens of a plain numpy forward of the same weights.
"""

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import tokenizers
from flax import nnx

from jaxserve import LLM, SamplingParams
from jaxserve.checkpoint.weights import WeightsError
from jaxserve.config import ModelConfig
from jaxserve.device.attention import AttentionMetadata, paged_attention
from jaxserve.device.kv_cache import KVCache, write_kv
from jaxserve.models import ModelSpec, WeightRule, register_model

VOCAB = 48
HIDDEN = 32
FFN = 64
LAYERS = 2
HEADS = 4
POSITIONS = 32
EPS = 1e-5


# ---------------------------------------------------------------- the model


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias


def _weight(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: jnp.dtype) -> nnx.Param:
    return nnx.Param(jax.random.normal(rngs.params(), shape, dtype) * 0.02)


class Block(nnx.Module):
    """Pre-LayerNorm attention and MLP, GPT-2 style; kernels [in, out] as GPT-2 stores them."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, dtype: jnp.dtype):
        d, f = config.hidden_size, config.intermediate_size
        self.config = config
        self.ln1_scale = nnx.Param(jnp.ones((d,), dtype))
        self.ln1_bias = nnx.Param(jnp.zeros((d,), dtype))
        self.qkv = _weight(rngs, (d, 3 * d), dtype)
        self.qkv_bias = nnx.Param(jnp.zeros((3 * d,), dtype))
        self.out = _weight(rngs, (d, d), dtype)
        self.out_bias = nnx.Param(jnp.zeros((d,), dtype))
        self.ln2_scale = nnx.Param(jnp.ones((d,), dtype))
        self.ln2_bias = nnx.Param(jnp.zeros((d,), dtype))
        self.fc = _weight(rngs, (d, f), dtype)
        self.fc_bias = nnx.Param(jnp.zeros((f,), dtype))
        self.proj = _weight(rngs, (f, d), dtype)
        self.proj_bias = nnx.Param(jnp.zeros((d,), dtype))

    def __call__(
        self,
        x: jax.Array,  # f32[num_tokens, hidden]
        positions: jax.Array,  # i32[num_tokens]
        kv_cache: KVCache,
        layer: int,
        metadata: AttentionMetadata,
    ) -> tuple[jax.Array, KVCache]:
        cfg = self.config
        num_tokens = x.shape[0]
        h = layer_norm(x, self.ln1_scale[...], self.ln1_bias[...], cfg.rms_norm_eps)
        qkv = h @ self.qkv[...] + self.qkv_bias[...]
        q, k, v = (
            a.reshape(num_tokens, cfg.num_heads, cfg.head_dim) for a in jnp.split(qkv, 3, -1)
        )
        # the new keys and values go into this sequence's pages; attention reads them back
        kv_cache = write_kv(kv_cache, layer, metadata.slot_mapping, k, v)
        attn = paged_attention(q, kv_cache, layer, positions, metadata, cfg.head_dim**-0.5)
        x = x + attn.reshape(num_tokens, -1) @ self.out[...] + self.out_bias[...]
        h = layer_norm(x, self.ln2_scale[...], self.ln2_bias[...], cfg.rms_norm_eps)
        h = jax.nn.gelu(h @ self.fc[...] + self.fc_bias[...], approximate=True)
        return x + h @ self.proj[...] + self.proj_bias[...], kv_cache


class TinyGPT(nnx.Module):
    """Token + learned position embeddings → blocks → final LayerNorm → tied LM head."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32):
        d = config.hidden_size
        self.config = config
        self.wte = _weight(rngs, (config.vocab_size, d), dtype)
        self.wpe = _weight(rngs, (config.max_position_embeddings, d), dtype)
        self.blocks = nnx.List([Block(config, rngs, dtype) for _ in range(config.num_layers)])
        self.ln_f_scale = nnx.Param(jnp.ones((d,), dtype))
        self.ln_f_bias = nnx.Param(jnp.zeros((d,), dtype))

    def __call__(
        self,
        token_ids: jax.Array,  # i32[num_tokens]
        positions: jax.Array,  # i32[num_tokens] position of each token in its sequence
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> tuple[jax.Array, KVCache]:  # f32[num_logits, vocab_size], updated cache
        x = self.wte[...][token_ids] + self.wpe[...][positions]
        for layer, block in enumerate(self.blocks):
            x, kv_cache = block(x, positions, kv_cache, layer, metadata)
        x = x[metadata.logits_indices]  # only the rows that sample: the rest is padding or prompt
        x = layer_norm(x, self.ln_f_scale[...], self.ln_f_bias[...], self.config.rms_norm_eps)
        return (x @ self.wte[...].T).astype(jnp.float32), kv_cache


# each Block parameter, its GPT-2 tensor in layer i ("transformer.h.{i}.<tensor>") and its
# logical axes: the MLP splits over tensor parallelism, the fused qkv stays whole
BLOCK_TENSORS = {
    "ln1_scale": ("ln_1.weight", ("embed",)),
    "ln1_bias": ("ln_1.bias", ("embed",)),
    "qkv": ("attn.c_attn.weight", ("embed", None)),
    "qkv_bias": ("attn.c_attn.bias", (None,)),
    "out": ("attn.c_proj.weight", (None, "embed")),
    "out_bias": ("attn.c_proj.bias", ("embed",)),
    "ln2_scale": ("ln_2.weight", ("embed",)),
    "ln2_bias": ("ln_2.bias", ("embed",)),
    "fc": ("mlp.c_fc.weight", ("embed", "mlp")),
    "fc_bias": ("mlp.c_fc.bias", ("mlp",)),
    "proj": ("mlp.c_proj.weight", ("mlp", "embed")),
    "proj_bias": ("mlp.c_proj.bias", ("embed",)),
}


def tinygpt_weight_map(config: ModelConfig) -> dict[str, WeightRule]:
    """GPT-2's tensor names; its Conv1D weights are already [in, out], so nothing transposes.
    Layers are separate modules, so each layer's tensors get their own rules (no `{layer}`)."""
    rules = {
        "wte": WeightRule("transformer.wte.weight", axes=("vocab", "embed")),
        "wpe": WeightRule("transformer.wpe.weight", axes=(None, "embed")),
        "ln_f_scale": WeightRule("transformer.ln_f.weight", axes=("embed",)),
        "ln_f_bias": WeightRule("transformer.ln_f.bias", axes=("embed",)),
    }
    for i in range(config.num_layers):
        for param, (tensor, axes) in BLOCK_TENSORS.items():
            rules[f"blocks/{i}/{param}"] = WeightRule(f"transformer.h.{i}.{tensor}", axes=axes)
    return rules


register_model("tinygpt", ModelSpec(build=TinyGPT, weight_map=tinygpt_weight_map))


# ---------------------------------------------------------------- the checkpoint


def random_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """GPT-2 named float32 tensors, scaled so that greedy choices are clear-cut and varied
    (the tied head otherwise keeps repeating the last token)."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int, std: float = 0.6) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    weights = {
        "transformer.wte.weight": normal(VOCAB, HIDDEN, std=0.5),
        "transformer.wpe.weight": normal(POSITIONS, HIDDEN, std=0.5),
        "transformer.ln_f.weight": 1 + normal(HIDDEN, std=0.1),
        "transformer.ln_f.bias": normal(HIDDEN, std=0.1),
    }
    for i in range(LAYERS):
        h = f"transformer.h.{i}."
        weights |= {
            h + "ln_1.weight": 1 + normal(HIDDEN, std=0.1),
            h + "ln_1.bias": normal(HIDDEN, std=0.1),
            h + "attn.c_attn.weight": normal(HIDDEN, 3 * HIDDEN),
            h + "attn.c_attn.bias": normal(3 * HIDDEN, std=0.1),
            h + "attn.c_proj.weight": normal(HIDDEN, HIDDEN),
            h + "attn.c_proj.bias": normal(HIDDEN, std=0.1),
            h + "ln_2.weight": 1 + normal(HIDDEN, std=0.1),
            h + "ln_2.bias": normal(HIDDEN, std=0.1),
            h + "mlp.c_fc.weight": normal(HIDDEN, FFN),
            h + "mlp.c_fc.bias": normal(FFN, std=0.1),
            h + "mlp.c_proj.weight": normal(FFN, HIDDEN),
            h + "mlp.c_proj.bias": normal(HIDDEN, std=0.1),
        }
    return weights


def save_model_dir(path: Path, weights: dict[str, np.ndarray]) -> Path:
    """config.json (the keys `config_from_hf` reads), model.safetensors and a word tokenizer."""
    path.mkdir()
    config = {
        "model_type": "tinygpt",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "max_position_embeddings": POSITIONS,
        "rms_norm_eps": EPS,  # ModelConfig has one norm epsilon; TinyGPT uses it for LayerNorm
        "tie_word_embeddings": True,
        "eos_token_id": 0,
    }
    (path / "config.json").write_text(json.dumps(config))
    safetensors.numpy.save_file(weights, path / "model.safetensors")
    vocab = {"<eos>": 0, "<unk>": 1} | {f"w{i}": i for i in range(2, VOCAB)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>"}
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return path


# ---------------------------------------------------------------- the reference


def np_layer_norm(x: np.ndarray, scale: np.ndarray, bias: np.ndarray) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + EPS) * scale + bias


def np_gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def reference_logits(w: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """f64[vocab] logits of the last token: the whole sequence recomputed, no cache."""
    w = {name: t.astype(np.float64) for name, t in w.items()}
    n, head_dim = len(ids), HIDDEN // HEADS
    x = w["transformer.wte.weight"][ids] + w["transformer.wpe.weight"][:n]
    causal = np.tril(np.ones((n, n), bool))
    for i in range(LAYERS):
        p = {name[len(f"transformer.h.{i}.") :]: t for name, t in w.items() if f".h.{i}." in name}
        h = np_layer_norm(x, p["ln_1.weight"], p["ln_1.bias"])
        qkv = h @ p["attn.c_attn.weight"] + p["attn.c_attn.bias"]
        q, k, v = (a.reshape(n, HEADS, head_dim).transpose(1, 0, 2) for a in np.split(qkv, 3, -1))
        scores = np.where(causal, q @ k.transpose(0, 2, 1) / math.sqrt(head_dim), -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = (probs @ v).transpose(1, 0, 2).reshape(n, HIDDEN)
        x = x + attn @ p["attn.c_proj.weight"] + p["attn.c_proj.bias"]
        h = np_layer_norm(x, p["ln_2.weight"], p["ln_2.bias"])
        h = np_gelu(h @ p["mlp.c_fc.weight"] + p["mlp.c_fc.bias"])
        x = x + h @ p["mlp.c_proj.weight"] + p["mlp.c_proj.bias"]
    x = np_layer_norm(x[-1], w["transformer.ln_f.weight"], w["transformer.ln_f.bias"])
    return x @ w["transformer.wte.weight"].T


def reference_greedy(w: dict[str, np.ndarray], prompt: list[int], max_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(max_tokens):
        logits = reference_logits(w, ids)
        first, second = np.sort(logits)[-2:][::-1]
        assert first - second > 1e-3, "near tie: pick another seed"
        ids.append(int(np.argmax(logits)))
    return ids[len(prompt) :]


# ---------------------------------------------------------------- the test


@pytest.fixture(scope="module")
def weights() -> dict[str, np.ndarray]:
    return random_weights()


def test_llm_serves_registered_custom_model(weights, tmp_path):
    path = save_model_dir(tmp_path / "tinygpt", weights)
    llm = LLM(model=path, page_size=4, num_pages=32)
    assert isinstance(llm.config, ModelConfig) and llm.config.architecture == "tinygpt"

    # two prompts of different lengths in one batch: prefill, then decode across page borders
    prompts = ["w5 w9 w3 w17 w2 w40 w11", [7, 30, 12]]
    max_tokens = 8
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params)

    assert outputs[0].prompt_token_ids == [5, 9, 3, 17, 2, 40, 11]
    assert outputs[1].prompt_token_ids == [7, 30, 12]
    for out in outputs:
        assert len(set(out.token_ids)) >= 3  # not one token repeated: the cache is really read
        assert out.token_ids == reference_greedy(weights, out.prompt_token_ids, max_tokens)
        assert out.finish_reason == "length"
        assert out.text.split() == [f"w{t}" for t in out.token_ids]


def forgetful_weight_map(config: ModelConfig) -> dict[str, WeightRule]:
    """tinygpt's map with one parameter's sharding axes left out."""
    rules = tinygpt_weight_map(config)
    rules["blocks/0/fc"] = WeightRule(rules["blocks/0/fc"].source)
    return rules


register_model("tinygpt-forgetful", ModelSpec(build=TinyGPT, weight_map=forgetful_weight_map))


def test_a_parameter_without_sharding_axes_is_refused_at_load(weights, tmp_path):
    path = save_model_dir(tmp_path / "model", weights)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "tinygpt-forgetful"}))
    with pytest.raises(WeightsError, match=r"no sharding axes for \['blocks/0/fc'\]"):
        LLM(path)
