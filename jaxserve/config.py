"""Frozen, typed configuration records, built once at the edge (CLI or `LLM(...)`)."""

import os
from dataclasses import dataclass, field

from jaxserve.host.buckets import BucketTable


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (`rope_type: llama3`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape of a decoder-only transformer, as read from config.json or GGUF metadata."""

    architecture: str  # registry key, e.g. "llama", "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )


MAX_LOGPROBS = 20  # alternatives per token, as the OpenAI API allows
# logit_bias entries a request may carry: every step carries a table this wide per row
MAX_LOGIT_BIAS = 128
# --dtype's choices, with vLLM's aliases (half, float)
DTYPES = {"auto": None, "float32": "float32", "float": "float32", "bfloat16": "bfloat16",
          "float16": "float16", "half": "float16"}
# --weight-dtype's choices, how projections are stored (models/layers.py); auto: in --dtype
# (bf16 on a CPU with AMX: llm.py)
WEIGHT_DTYPES = ("auto", "f32", "bf16", "int8", "fp8")
# --kv-dtype's choices, how KV pages are stored (device/kv_cache.py); auto: in --dtype
KV_DTYPES = ("auto", "f32", "bf16", "int8", "fp8")
ATTENTION_BACKENDS = ("pallas", "pallas-interpret", "cpu", "xla", "reference")  # see attention.py
# how bf16 projections multiply (cpu_kernels/linear.py): auto is the first of amx and
# avx512_bf16 that can run, else xla
LINEAR_BACKENDS = ("auto", "amx", "avx512_bf16", "xla")
# what such a kernel multiplies bf16 weights by: activations rounded to bf16 (one pass) or
# kept in f32 (two); auto: bf16 (README: the same accuracy, 1.6x faster prefill)
LINEAR_ACTIVATIONS = ("auto", "bf16", "f32", "int8")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token and when to stop; the OpenAI/vLLM parameter set.

    temperature 0 means greedy. top_k 0 (or -1), top_p 1 and min_p 0 disable those
    filters; penalties at 0 (presence, frequency) or 1 (repetition) are off.
    `logprobs` asks for the chosen token's log-probability and that many alternatives;
    `prompt_logprobs` the same for every prompt token after the first (what scoring,
    e.g. lm-evaluation-harness's loglikelihood, reads). Such a prompt is computed in
    full: it takes no cached prefix.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    # (token id, value added to its logit before sampling), as OpenAI's logit_bias;
    # a dict is taken too. Logprobs stay those of the model's own logits.
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        bias = self.logit_bias
        bias = bias.items() if isinstance(bias, dict) else bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(v)) for t, v in bias))
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}"
            )
        for token, value in self.logit_bias:
            if token < 0 or not -100 <= value <= 100:
                raise ValueError(
                    f"logit_bias maps token ids >= 0 to values in [-100, 100], got {token}: {value}"
                )
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )


def serving_dtype(requested: str, platform: str) -> str:
    """The dtype weights and activations are served in. `auto`: float32 on CPU, where
    jax 0.10's XLA:CPU has no bf16 path to AMX/AVX512-BF16 and runs bf16 dots 2-10x slower
    than f32 (bench/results/NOTES.md); bfloat16 on accelerators, as vLLM does."""
    if requested == "auto":
        return "float32" if platform == "cpu" else "bfloat16"
    return DTYPES[requested]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Sizes of the KV page pool, the batch and the step; what the engine allocates once."""

    page_size: int = 16
    num_pages: int = 1024  # including the reserved null page; per data shard
    # the KV pool's bytes per data shard: replaces num_pages by the pages that fit, a
    # page's bytes being page_size × planner.kv_bytes_per_token in kv_dtype
    kv_cache_bytes: int | None = None
    max_batch: int = 16  # rows in the running batch, per data shard (lowered by tpot_slo_ms)
    token_budget: int = 256  # tokens a step computes (decodes + prefill chunks), per shard
    max_model_len: int | None = None  # None: the model's context, capped by the pool
    dtype: str = "auto"  # weights and activations; see serving_dtype
    weight_dtype: str = "auto"  # how projections are stored (WEIGHT_DTYPES)
    kv_dtype: str = "auto"  # how KV pages are stored (KV_DTYPES); auto: see llm.py
    attention_backend: str | None = None  # None: by platform (see attention.select_backend)
    linear_backend: str = "auto"  # LINEAR_BACKENDS
    linear_activations: str = "auto"  # LINEAR_ACTIVATIONS
    tpot_slo_ms: float | None = None
    # where compiled steps are kept (device/executables.py); unset, the Python API keeps
    # none unless JAXSERVE_COMPILATION_CACHE_DIR names a directory (the CLI: .cache/jax)
    compilation_cache_dir: str | None = field(
        default_factory=lambda: os.environ.get("JAXSERVE_COMPILATION_CACHE_DIR") or None)
    stream_capacity: int = 256  # unread outputs a request keeps apart; past it they merge
    prefix_caching: bool = True  # reuse cached full pages of earlier prompts
    # rows no tenant may take while another is active (see scheduler);
    # None: max(1, max_batch // 8)
    reserved_rows: int | None = None
    debug_checks: bool = False  # verify page ownership every step (tests turn it on)
    # plan and launch each step before the previous one's tokens are read (engine.py)
    async_scheduling: bool = True
    # the compiled step shapes as (token sizes, row sizes); None: BucketTable.for_limits
    # (max_batch, token_budget). Fewer buckets start faster and pad more.
    buckets: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    tp: int = 1  # tensor parallelism: devices on the mesh's "model" axis
    dp: int = 1  # data parallelism: shards of the batch on the mesh's "data" axis
    # LoRA adapters (PEFT directories) served from the start, as (name, path) pairs or a
    # {name: path} dict
    lora: tuple[tuple[str, str], ...] = ()
    # serve adapters even with none at the start (they are loaded at run time)
    enable_lora: bool = False
    max_loras: int = 4  # device slots for adapters; more wait in host memory
    max_lora_rank: int = 16  # the highest rank an adapter may have (slots are this wide)
    # speculative decoding by prompt lookup (vLLM's "ngram" method, host/ngram.py): up to
    # this many draft tokens a step for each request that takes them (ngram.takes_drafts:
    # greedy or sampled, without logprobs, penalties or logit bias); 0: off. It plans each step
    # after the one before (no async scheduling: a step's drafts follow its tokens).
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 2  # the shortest run of a request's last tokens looked up
    prompt_lookup_max: int = 4  # the longest

    @property
    def serves_adapters(self) -> bool:
        return self.enable_lora or bool(self.lora)

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras ({self.max_loras}) and max_lora_rank "
                             f"({self.max_lora_rank}) must be at least 1")
        lora = self.lora.items() if isinstance(self.lora, dict) else self.lora
        object.__setattr__(self, "lora", tuple((str(n), str(p)) for n, p in lora))
        if self.page_size < 1 or self.num_pages < 2:
            raise ValueError("page_size must be >= 1 and num_pages >= 2")
        if self.tp < 1 or self.dp < 1:
            raise ValueError(f"tp and dp must be at least 1, got tp={self.tp}, dp={self.dp}")
        if self.reserved_rows is not None and not 0 <= self.reserved_rows < self.max_batch:
            raise ValueError(
                f"reserved_rows must be in [0, max_batch={self.max_batch}), got "
                f"{self.reserved_rows}"
            )
        if self.max_batch < 1 or self.token_budget < self.max_batch:
            raise ValueError(
                f"need 1 <= max_batch ({self.max_batch}) <= token_budget ({self.token_budget})"
            )
        if self.num_speculative_tokens < 0 or not (
                1 <= self.prompt_lookup_min <= self.prompt_lookup_max):
            raise ValueError(
                f"need num_speculative_tokens >= 0 ({self.num_speculative_tokens}) and 1 <= "
                f"prompt_lookup_min ({self.prompt_lookup_min}) <= prompt_lookup_max "
                f"({self.prompt_lookup_max})")
        if self.buckets is not None:
            BucketTable(*self.buckets).covers(self.max_batch, self.token_budget)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got "
                             f"{self.kv_dtype!r}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.linear_backend not in LINEAR_BACKENDS:
            raise ValueError(f"linear_backend must be one of {', '.join(LINEAR_BACKENDS)}, got "
                             f"{self.linear_backend!r}")
        if self.linear_activations not in LINEAR_ACTIVATIONS:
            raise ValueError(f"linear_activations must be one of {', '.join(LINEAR_ACTIVATIONS)}"
                             f", got {self.linear_activations!r}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got "
                             f"{self.weight_dtype!r}")
