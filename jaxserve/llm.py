"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, on the engine.

`LLM` also builds the engine the server runs: model, tokenizer, page allocator,
scheduler and runner from one EngineConfig.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.checkpoint.adapter import Adapter
from jaxserve.checkpoint.default_model import default_model_path
from jaxserve.checkpoint.loader import load
from jaxserve.checkpoint.weights import open_checkpoint, pack_projections, untie_head
from jaxserve.config import EngineConfig, SamplingParams, serving_dtype
from jaxserve.cpu_kernels import linear
from jaxserve.device.kv_cache import calibration_text, storage_name
from jaxserve.device.runner import ModelRunner, WarmupProgress, enable_compilation_cache
from jaxserve.device.sharding import make_mesh
from jaxserve.host.adapters import AdapterRegistry, SlotTable
from jaxserve.host.buckets import BucketTable
from jaxserve.host.engine import Engine
from jaxserve.host.ngram import NgramProposer
from jaxserve.host.page_allocator import PageAllocator
from jaxserve.host.request import check_prompt_ids
from jaxserve.host.scheduler import Scheduler
from jaxserve.models import get_model_spec
from jaxserve.models.layers import PackedWeight, is_packed
from jaxserve.planner import kv_bytes_per_token


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """What one prompt produced."""

    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    # with SamplingParams(prompt_logprobs=...): per prompt token, None for the first
    prompt_logprobs: list[float | None] | None = None


class LLM:
    """A model and its tokenizer behind a continuous-batching engine."""

    def __init__(
        self,
        model: str | Path | None = None,
        config: EngineConfig | None = None,
        *,
        warmup: bool = False,
        warmup_progress: Callable[[WarmupProgress], None] | None = None,
        **overrides,
    ):
        """`overrides` are EngineConfig fields (e.g. `max_batch=8, num_pages=256`).

        `warmup` compiles every bucket now (as a server must, before serving), logging
        each and telling `warmup_progress` of it."""
        self.engine_config = config or EngineConfig(**overrides)
        if config is not None and overrides:
            raise TypeError("pass either config or EngineConfig fields, not both")
        cfg = self.engine_config
        # one process: each bucket's executable is kept (device/executables.py), and jax's
        # own cache stays off (what it loads cannot be kept); several: jax's cache
        executable_dir = None
        if cfg.compilation_cache_dir and jax.process_count() == 1:
            executable_dir = Path(cfg.compilation_cache_dir) / "executables"
        elif cfg.compilation_cache_dir:
            enable_compilation_cache(cfg.compilation_cache_dir)
        self.model_path = Path(model) if model is not None else default_model_path()
        # one device unsharded; otherwise weights load straight into their shards
        self.mesh = make_mesh(cfg.tp, cfg.dp) if cfg.tp * cfg.dp > 1 else None
        self.dtype = jnp.dtype(serving_dtype(cfg.dtype, jax.default_backend()))
        module, self.tokenizer = load(self.model_path, self.dtype, self.mesh, cfg.weight_dtype)
        self.config = module.config
        stored = projection_dtype(module, self.dtype)
        # auto with f32 projections may take bf16 on a CPU kernel (AMX, AVX512-BF16) where
        # the CPU has one: 1.4-2x the tokens/s of f32 at 0.06 % of its log-likelihood
        # (README); --weight-dtype f32 keeps f32, and a model without projections has none
        # to pack
        rules = get_model_spec(self.config.architecture).weight_map(self.config)
        to_bf16 = (cfg.weight_dtype == "auto" and stored == "float32"
                   and any(rule.projection for rule in rules.values()))
        self.linear_backend = linear.select(cfg.linear_backend,
                                            "bfloat16" if to_bf16 else stored, self.dtype,
                                            self.mesh is None)
        # what the projections multiply the weights by: XLA, x as it is; a kernel, x
        # rounded to bf16 (one pass, auto) or kept in f32 (two), or Q4_1 weights' x
        # quantized to int8 per block of 32 (linear.cc)
        if self.linear_backend == "xla":
            if cfg.linear_activations in ("bf16", "int8"):
                raise ValueError(f"--linear-activations {cfg.linear_activations} needs a bf16 "
                                 "CPU kernel (--linear-backend amx or avx512_bf16); XLA keeps "
                                 "them as they are")
            self.linear_activations = self.dtype.name
            if self.mesh is None and jax.default_backend() == "cpu":
                module = untie_head(module)
        else:
            self.linear_activations = cfg.linear_activations
            if self.linear_activations == "auto":
                self.linear_activations = "bf16"
            passes = {"bf16": 1, "f32": 2, "int8": 0}[self.linear_activations]
            # f32 -> bf16; under auto, a GGUF file's Q4_1 projections stay Q4_1 where the
            # kernel multiplies them (the same results, a third of bf16's bytes)
            source = None
            if cfg.weight_dtype == "auto" and self.model_path.suffix == ".gguf":
                source = open_checkpoint(self.model_path)
            module = pack_projections(module, self.linear_backend, passes, source)
            stored = "q4_1" if any(
                isinstance(w, PackedWeight) and w.values.dtype == jnp.uint8
                for w in jax.tree.leaves(nnx.state(module), is_leaf=is_packed)) else "bfloat16"
            if passes == 0 and not (stored == "q4_1" and linear.int8_available()):
                raise ValueError(
                    "--linear-activations int8 multiplies a GGUF file's Q4_1 projections "
                    f"(--weight-dtype auto) with {', '.join(linear.INT8_FLAGS)}; this model or "
                    "CPU has none of that")
        self.weight_dtype = stored
        # auto: pages in the serving dtype (f16 only there: --dtype float16), or in bf16
        # where every projection already rounds its input to bf16 (a kernel, one pass): a
        # 16-row decode step at context 256 took 0.91x f32 pages' time, at 512 0.83x
        # (Zen 5), with half the bytes a token
        self.kv_dtype = cfg.kv_dtype
        if cfg.kv_dtype == "auto":
            self.kv_dtype = "bf16" if self.linear_activations in ("bf16", "int8") else storage_name(
                self.dtype)
        self.num_pages = cfg.num_pages
        if cfg.kv_cache_bytes is not None:
            c = self.config
            page = cfg.page_size * kv_bytes_per_token(
                c.num_layers, c.num_kv_heads, c.head_dim, self.kv_dtype
            )
            self.num_pages = cfg.kv_cache_bytes // page
            if self.num_pages < 2:
                raise ValueError(
                    f"kv_cache_bytes={cfg.kv_cache_bytes:,} holds {self.num_pages} pages of "
                    f"{page:,} B in {self.kv_dtype}: need 2 (one is the null page)"
                )
        max_model_len = min(
            cfg.max_model_len or self.config.max_position_embeddings,
            (self.num_pages - 1) * cfg.page_size,
        )
        if cfg.buckets is None:
            buckets = BucketTable.for_limits(cfg.max_batch, cfg.token_budget)
        else:
            buckets = BucketTable(*cfg.buckets)  # EngineConfig checked that it covers a step
        self.runner = ModelRunner(
            module,
            buckets,
            self.num_pages,
            cfg.page_size,
            max_model_len,
            cfg.max_batch,
            cfg.attention_backend,
            self.dtype,
            self.mesh,
            self.kv_dtype,
            (cfg.max_loras, cfg.max_lora_rank) if cfg.serves_adapters else None,
            executable_dir,
            cfg.num_speculative_tokens,
        )
        # LoRA adapters, read before the warm-up so that a bad one fails the start at once
        self.adapters = None
        if cfg.serves_adapters:
            self.adapters = AdapterRegistry(self.config, cfg.max_lora_rank)
            for name, path in cfg.lora:
                self.adapters.load(name, path)
        max_batch = cfg.max_batch
        if cfg.tpot_slo_ms is not None and not warmup:
            raise ValueError(
                "tpot_slo_ms caps the batch by the warm-up's step times: pass warmup=True"
            )
        if warmup:
            if cfg.tpot_slo_ms is not None:
                # the TPOT bound needs every bucket's worst-case (full-context) step time
                self.runner.warmup(worst_case=True, progress=warmup_progress)
                max_batch = max(1, self.runner.max_batch_under(cfg.tpot_slo_ms / 1000))
            else:
                # only a full batch's decode step is timed (admission's first rate
                # estimate): timing every bucket tripled a warm restart's warm-up
                full = buckets.choose(max_batch, max_batch)
                self.runner.warmup(worst_case=False, timed={full}, progress=warmup_progress)
        if self.runner.kv_cache.k_center is not None:  # fp8 KV: before any page is used
            self.runner.calibrate_kv(self.tokenizer.encode(calibration_text()))
        self.scheduler = Scheduler(
            [PageAllocator(self.num_pages) for _ in range(cfg.dp)],
            buckets,
            cfg.page_size,
            max_batch,
            max_model_len,
            cfg.token_budget,
            cfg.prefix_caching,
            max(1, max_batch // 8) if cfg.reserved_rows is None else cfg.reserved_rows,
            SlotTable(cfg.max_loras) if cfg.serves_adapters else None,
            cfg.num_speculative_tokens,
        )
        eos = self.config.eos_token_ids or self.tokenizer.eos_token_ids
        # a step's drafts follow its tokens, so speculation plans each step after the last
        proposer = NgramProposer(cfg.num_speculative_tokens, cfg.prompt_lookup_min,
                                 cfg.prompt_lookup_max) if cfg.num_speculative_tokens else None
        self.engine = Engine(
            self.runner, self.scheduler, self.tokenizer, eos, cfg.stream_capacity,
            debug_checks=cfg.debug_checks, proposer=proposer,
            async_scheduling=cfg.async_scheduling and proposer is None,
        )

    @property
    def weight_bytes(self) -> int:
        """Bytes of every parameter on the device (all shards together), scales included."""
        return sum(x.nbytes for x in jax.tree.leaves(self.runner.state))

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token's K and V take in the pool on the device, every layer, scales
        included (all shards together, per data shard's page)."""
        pool = self.runner.kv_cache
        held = sum(x.nbytes for x in (pool.k, pool.v, pool.k_scale, pool.v_scale)
                   if x is not None)  # fp8's calibration is per channel, not per token
        return held // (pool.num_pages * pool.page_size)

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt given as text or ids; RequestRejected (a ValueError) when
        empty or out of the vocabulary."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_prompt_ids(ids, self.config.vocab_size)
        return ids

    def adapter(self, name: str | None) -> Adapter | None:
        """The served LoRA adapter called `name` (None: the base model); KeyError if none."""
        if name is None:
            return None
        adapter = self.adapters and self.adapters.get(name)
        if adapter is None:
            raise KeyError(f"no LoRA adapter named {name!r} is loaded")
        return adapter

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        adapter: str | Sequence[str | None] | None = None,
    ) -> list[CompletionOutput]:
        """Complete each prompt (a string or a list of token ids), batched continuously.

        `sampling_params` is one SamplingParams for all prompts or one per prompt;
        `adapter` the name of a LoRA adapter (`lora=`) for all of them, or one per prompt
        (None: the base model).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        names = [adapter] * len(prompts) if adapter is None or isinstance(adapter, str) else adapter
        if len(names) != len(prompts):
            raise ValueError(f"{len(names)} adapters for {len(prompts)} prompts")
        adapters = [self.adapter(name) for name in names]
        encoded = [self.encode(p) for p in prompts]
        streams = [self.engine.submit(ids, p, adapter=a)
                   for ids, p, a in zip(encoded, params, adapters)]
        token_ids: list[list[int]] = [[] for _ in prompts]
        texts: list[list[str]] = [[] for _ in prompts]
        reasons: list[str | None] = [None] * len(prompts)
        prompt_logprobs: list[list[float | None] | None] = [None] * len(prompts)
        while self.engine.has_work():
            self.engine.step()
            for i, stream in enumerate(streams):  # drain as we go: buffers are bounded
                while len(stream):
                    item = stream.get(timeout=0)
                    token_ids[i].extend(item.token_ids)
                    texts[i].append(item.text)
                    reasons[i] = item.finish_reason
                    if item.prompt_logprobs is not None:
                        prompt_logprobs[i] = list(item.prompt_logprobs)
        outputs = [
            CompletionOutput(
                prompt if isinstance(prompt, str) else None, ids, tokens, "".join(text), reason,
                scores,
            )
            for prompt, ids, tokens, text, reason, scores in zip(
                prompts, encoded, token_ids, texts, reasons, prompt_logprobs
            )
        ]
        return outputs


def projection_dtype(model: nnx.Module, dtype: jnp.dtype) -> str:
    """How the model's projections are stored: float32, bfloat16, int8 or float8_e4m3fn
    (`--weight-dtype` resolved; `dtype` for a model without projections)."""
    rules = get_model_spec(model.config.architecture).weight_map(model.config)
    for path, variable in nnx.to_flat_state(nnx.state(model)):
        if rules["/".join(str(p) for p in path)].projection:
            value = variable.get_value()
            return getattr(value, "values", value).dtype.name
    return dtype.name
