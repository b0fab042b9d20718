"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2) as a Flax NNX module.

Decoder layers keep their weights stacked on a leading [num_layers] axis and run
under `jax.lax.scan`, so compile time does not grow with depth. Kernels are
stored [in, out]; the weight map transposes torch's [out, in] on load.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.device.adapters import GROUPS, AdapterBatch, token_mix
from jaxserve.device.attention import AttentionMetadata, paged_attention
from jaxserve.device.kv_cache import KVCache, write_kv
from jaxserve.device.sharding import on_any_shard
from jaxserve.models.interface import ModelSpec, WeightRule, register_model
from jaxserve.models.layers import (
    LoraGroup,
    Norm,
    PackedWeight,
    linear,
    linear_group,
    lora_terms,
    prologue,
    scan_layers,
)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """f32[head_dim // 2] rotary frequencies, with Llama-3 scaling when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = config.rope_scaling
    if scaling is not None:
        low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
        high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
        inv_freq = np.where(
            wavelen > low_wavelen,
            inv_freq / scaling.factor,
            np.where(wavelen < high_wavelen, inv_freq, smoothed),
        )
    return inv_freq.astype(np.float32)


def apply_rope(
    x: jax.Array,  # f32[num_tokens, heads, head_dim]
    positions: jax.Array,  # i32[num_tokens]
    inv_freq: np.ndarray,  # f32[head_dim // 2]
) -> jax.Array:
    """Rotate halves (the Hugging Face layout, after undoing llama.cpp's permutation)."""
    angles = positions[:, None].astype(jnp.float32) * inv_freq[None, :]
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: jnp.dtype) -> nnx.Param:
    return nnx.Param(jax.random.normal(rngs.params(), shape, dtype) * 0.02)


class DecoderLayers(nnx.Module):
    """Every decoder layer's weights, stacked on a leading [num_layers] axis."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32):
        n, d, f = config.num_layers, config.hidden_size, config.intermediate_size
        q_dim = config.num_heads * config.head_dim
        kv_dim = config.num_kv_heads * config.head_dim
        self.config = config
        self.input_norm = nnx.Param(jnp.ones((n, d), dtype))
        self.q_proj = _param(rngs, (n, d, q_dim), dtype)
        self.k_proj = _param(rngs, (n, d, kv_dim), dtype)
        self.v_proj = _param(rngs, (n, d, kv_dim), dtype)
        if config.attention_bias:
            self.q_bias = nnx.Param(jnp.zeros((n, q_dim), dtype))
            self.k_bias = nnx.Param(jnp.zeros((n, kv_dim), dtype))
            self.v_bias = nnx.Param(jnp.zeros((n, kv_dim), dtype))
        self.o_proj = _param(rngs, (n, q_dim, d), dtype)
        self.post_norm = nnx.Param(jnp.ones((n, d), dtype))
        self.gate_proj = _param(rngs, (n, d, f), dtype)
        self.up_proj = _param(rngs, (n, d, f), dtype)
        self.down_proj = _param(rngs, (n, f, d), dtype)

    def __call__(
        self,
        x: jax.Array,  # f32[num_tokens, hidden]
        positions: jax.Array,  # i32[num_tokens]
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        adapters: AdapterBatch | None = None,
    ) -> tuple[jax.Array, KVCache]:
        cfg = self.config
        # values, not p[...]: a quantized weight is a pytree (layers.py), not an array
        weights = {
            name: p.get_value() for name, p in vars(self).items() if isinstance(p, nnx.Param)
        }
        if adapters is not None:  # the slots' stacks are scanned with the layers' weights
            weights["adapters"] = {"a": adapters.slots.a, "b": adapters.slots.b}
            mix = token_mix(adapters.slots, adapters.token_slots)
            active = on_any_shard(jnp.any(adapters.token_slots > 0))
        inv_freq = rope_inv_freq(cfg)
        scale = cfg.head_dim**-0.5
        num_tokens = x.shape[0]

        def layer(carry, w):
            x, cache, i = carry

            def project(h, group, norm=None, gated=False, residual=None):  # projections of
                # one input (its prologue and residual as `linear`'s), adapter terms added
                if adapters is None:  # if served
                    return linear_group(h, w, group, GROUPS[group], norm, gated, residual)
                h = prologue(h, norm, gated)  # which the adapters' terms read too
                ys = linear_group(h, w, group, GROUPS[group])
                slots = w["adapters"]
                lora = LoraGroup(slots["a"][group], tuple(slots["b"][n] for n in GROUPS[group]),
                                 mix, active, adapters.token_slots, adapters.slots.rank)
                ys = [y + term for y, term in zip(ys, lora_terms(h, lora))]
                return ys if residual is None else [residual + y for y in ys]

            q, k, v = project(x, "qkv", Norm(w["input_norm"], cfg.rms_norm_eps))
            if cfg.attention_bias:
                q, k, v = q + w["q_bias"], k + w["k_bias"], v + w["v_bias"]
            q = apply_rope(q.reshape(num_tokens, cfg.num_heads, cfg.head_dim), positions, inv_freq)
            k = apply_rope(
                k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim), positions, inv_freq
            )
            v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            cache = write_kv(cache, i, metadata.slot_mapping, k, v)
            attn = paged_attention(q, cache, i, positions, metadata, scale)
            (x,) = project(attn.reshape(num_tokens, -1), "o", residual=x)
            gate, up = project(x, "gate_up", Norm(w["post_norm"], cfg.rms_norm_eps))
            # silu(gate) * up in the down projection's kernel where it has one (`linear`)
            (x,) = project((gate, up), "down", gated=True, residual=x)
            return (x, cache, i + 1), None

        # the step's real tokens come first (device/batch.py): its bucket's padding after
        (x, kv_cache, _), _ = scan_layers(layer, (x, kv_cache, jnp.int32(0)), weights,
                                          metadata.cu_q_lens[-1])
        return x, kv_cache


class LlamaForCausalLM(nnx.Module):
    """Embedding → scanned decoder layers → final norm → LM head (tied or not)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32):
        self.config = config
        self.embed = _param(rngs, (config.vocab_size, config.hidden_size), dtype)
        self.layers = DecoderLayers(config, rngs, dtype)
        self.norm = nnx.Param(jnp.ones((config.hidden_size,), dtype))
        if not config.tie_word_embeddings:
            self.lm_head = _param(rngs, (config.hidden_size, config.vocab_size), dtype)

    def __call__(
        self,
        token_ids: jax.Array,  # i32[num_tokens]
        positions: jax.Array,  # i32[num_tokens]
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        adapters: AdapterBatch | None = None,  # LoRA: the slots and each token's
    ) -> tuple[jax.Array, KVCache]:  # f32[num_logits, vocab], cache
        x = self.embed[...][token_ids]
        x, kv_cache = self.layers(x, positions, kv_cache, metadata, adapters)
        # tied: the embedding's transpose, unless a packed copy was added (weights.py)
        head = self.lm_head.get_value() if hasattr(self, "lm_head") else self.embed[...].T
        if isinstance(head, PackedWeight) and metadata.num_logits is not None:
            head = dataclasses.replace(head, live=metadata.num_logits[0])  # no padding drafts
        logits = linear(x[metadata.logits_indices], head,
                        Norm(self.norm[...], self.config.rms_norm_eps))
        return logits.astype(jnp.float32), kv_cache


def llama_weight_map(config: ModelConfig) -> dict[str, WeightRule]:
    """Hugging Face tensor names and sharding axes of every parameter of `LlamaForCausalLM`.

    Megatron-style tensor parallelism: q/k/v/gate/up are column-parallel (their output
    axis split), o/down row-parallel (their input axis split), embedding and LM head split
    over the vocabulary (see sharding.py).
    """
    layer = "model.layers.{layer}."
    rules = {
        "embed": WeightRule("model.embed_tokens.weight", axes=("vocab", "embed")),
        "norm": WeightRule("model.norm.weight", axes=("embed",)),
        "layers/input_norm": WeightRule(
            layer + "input_layernorm.weight", axes=("layers", "embed")
        ),
        "layers/post_norm": WeightRule(
            layer + "post_attention_layernorm.weight", axes=("layers", "embed")
        ),
        "layers/o_proj": WeightRule(
            layer + "self_attn.o_proj.weight", transpose=True, axes=("layers", "heads", "embed"),
            projection=True,
        ),
    }
    for name, heads in (("q", "heads"), ("k", "kv_heads"), ("v", "kv_heads")):
        rules[f"layers/{name}_proj"] = WeightRule(
            layer + f"self_attn.{name}_proj.weight", transpose=True,
            axes=("layers", "embed", heads), projection=True,
        )
        if config.attention_bias:
            rules[f"layers/{name}_bias"] = WeightRule(
                layer + f"self_attn.{name}_proj.bias", axes=("layers", heads)
            )
    for name, axes in (("gate", ("embed", "mlp")), ("up", ("embed", "mlp")),
                       ("down", ("mlp", "embed"))):
        rules[f"layers/{name}_proj"] = WeightRule(
            layer + f"mlp.{name}_proj.weight", transpose=True, axes=("layers", *axes),
            projection=True,
        )
    if not config.tie_word_embeddings:
        rules["lm_head"] = WeightRule("lm_head.weight", transpose=True, axes=("embed", "vocab"))
    return rules


# llama.cpp's tensor names
GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    **{
        f"blk.{{layer}}.{gguf}": f"model.layers.{{layer}}.{hf}"
        for gguf, hf in {
            "attn_norm.weight": "input_layernorm.weight",
            "ffn_norm.weight": "post_attention_layernorm.weight",
            "attn_q.weight": "self_attn.q_proj.weight",
            "attn_k.weight": "self_attn.k_proj.weight",
            "attn_v.weight": "self_attn.v_proj.weight",
            "attn_q.bias": "self_attn.q_proj.bias",
            "attn_k.bias": "self_attn.k_proj.bias",
            "attn_v.bias": "self_attn.v_proj.bias",
            "attn_output.weight": "self_attn.o_proj.weight",
            "ffn_gate.weight": "mlp.gate_proj.weight",
            "ffn_up.weight": "mlp.up_proj.weight",
            "ffn_down.weight": "mlp.down_proj.weight",
        }.items()
    },
}
LLAMA_SPEC = ModelSpec(build=LlamaForCausalLM, weight_map=llama_weight_map, gguf_names=GGUF_NAMES)
# llama.cpp permutes Q/K rows for its "llama" architecture only
register_model("llama", dataclasses.replace(LLAMA_SPEC, gguf_qk_permuted=True))
for _architecture in ("mistral", "qwen2"):
    register_model(_architecture, LLAMA_SPEC)
