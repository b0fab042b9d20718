"""Capacity planner: weights, KV pages, the decode roofline and the queue, for any model and chip.

Pure Python (no jax): it loads and runs without an accelerator.

Definitions (all sizes in bytes, GB = 1e9 B, TB/s = 1e12 B/s, TFLOP/s = 1e12 FLOP/s):

- params: a Llama-style count from the shape: embedding (+ an untied lm_head), per layer
  q/k/v/o projections, a gated MLP (3 × hidden × intermediate) and two RMSNorm weights,
  plus the final norm (q/k/v biases where the config has them). Llama-3.1-70B: 70,553,706,496.
- weight bytes = params × weight dtype bytes (every parameter at that dtype, embeddings and
  norms included), the roofline's convention. What jaxserve's engine holds differs a little,
  and is given too: stored weight bytes = projections × weight dtype bytes + an f32 scale
  per output column where they are int8/fp8 + every other parameter (embeddings, head,
  norms, biases) at the serving `dtype` (Llama-3.1-70B in fp8 on bf16: 72.7 GB, +3 %).
- KV bytes per token = 2 × layers × kv_heads × (head_dim × kv dtype bytes + scale bytes),
  as the engine stores pages (device/kv_cache.py): int8 keeps an f32 scale per token
  and head, fp8 (e4m3) and floats none (fp8's calibration, a center and a scale per layer,
  head and channel, is not per token and not counted).
- KV bytes per sequence = context × KV bytes per token, where `context` is every token a
  sequence holds at its end (prompt + output): what admission reserves in pages.
- usable KV pool = kv_cap × (chips × HBM − weight bytes − chips × activation_gb).
- roofline decode step at batch b = max(memory time, compute time), with
  memory time = (weight bytes + b × KV bytes per sequence) ÷ (chips × bandwidth) and
  compute time = 2 × params × b ÷ (chips × peak FLOP/s of the matmul dtype).
  Attention FLOPs and activation traffic are left out (both small at decode).
- the ridge: the smallest batch whose compute time reaches its memory time (None when
  the KV reads grow as fast as the FLOPs, so decode never becomes compute-bound).
- real step = efficiency × roofline step. Real engines land at 2–3× the roofline, so the
  default efficiency is 2.5; `--calibrate` replaces it with a measured ratio (below).
- max batch by TPOT = the largest b whose real step fits the TPOT SLO; max sequences by KV
  = usable pool ÷ KV bytes per sequence; the smaller of the two binds.
- one replica's service rate (admissions/s) at the binding batch B = 1 ÷ (prefill +
  output_tokens × real step(B) ÷ B): each request costs its prompt's prefill compute
  (efficiency × 2 × params × prompt ÷ peak; prefill rides in the decode steps, so no
  weight read of its own) plus its share of B-wide decode steps.
- replicas needed = ceil(arrival rate ÷ one replica's service rate).
- queue bound (Little's law) = floor(queue wait budget × admission rate), the admission rate
  being the arrival rate when given (replicas are sized so that all arrivals are admitted),
  else one replica's service rate. The queue budget defaults to the TTFT SLO minus one
  prefill alone (efficiency × max(weight read, prefill compute)).

Conventions chosen to reproduce DESIGN.md's worked example (Llama-3.1-70B, fp8 weights and KV,
8 × H100, 2,000-token context):

- A sequence contributes its full context of KV to every step, not the mean over its life:
  3.02 / 4.20 / 8.89 ms memory time at batch 32 / 128 / 512 reproduces 3.0 / 4.2 / 8.9; the
  mean (1,000 tokens) would give 2.83 / 3.41 / 5.76 ms.
- Matmuls run at the rate of their wider operand. Activations are bf16 unless
  `compute_dtype` says otherwise, so fp8 weights (weight-only quantisation, W8A16) compute at
  the dense bf16 rate, 989.5 TFLOP/s per H100 (= "fp8 at half of 1,979"): 9.13 ms at batch
  512. `compute_dtype="fp8"` (W8A8) uses the chip's dense fp8 rate, 1,979.
- The example's "8.9 ms at 512" is the memory term; the roofline step there is the compute
  term, 9.13 ms (+2.6 %, 56,100 tokens/s vs 57,000: −1.6 %). Both readings are within 3 %;
  each roofline point carries `memory_ms` and `compute_ms` as well as `step_ms`.
- Activations are reserved per chip: 5 GB × 8 chips = the example's 40 GB.
- HBM sizes are the datasheet's decimal GB (80e9 for H100), which gives the example's 529 GB
  free and 503 GB usable ("≈505"); 1,534 sequences at 2,000 tokens ("≈1,500"; exactly
  1,499 if 2k means 2,048) and 93 at 32,768 tokens (5.37 GB each).

Calibration file (written by bench/roofline.py): a JSON object whose key
`measured_over_roofline` holds an object with `median`, the median over the measured points
of measured step time ÷ roofline step time; everything else in the file is ignored here:

    {"measured_over_roofline": {"median": 2.41, "points": [
        {"batch": 8, "measured_ms": 6.1, "roofline_ms": 2.5, "ratio": 2.44}, ...]}, ...}
"""

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from jaxserve.checkpoint.model_config import config_from_hf, read_hf_config
from jaxserve.config import ModelConfig

GB = 1e9
DTYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
KV_SCALE_BYTES = {"int8": 4}  # per token and head, K and V each (int4: planner-only)
SCALED_WEIGHTS = ("int8", "fp8")  # the weight dtypes jaxserve stores with per-column scales
SERVING_DTYPES = ("f32", "bf16", "f16")
COMPUTE_DTYPES = ("bf16", "fp8", "int8")
DEFAULT_EFFICIENCY = 2.5  # real engines land at 2–3× the roofline
ROOFLINE_BATCHES = tuple(2**i for i in range(10))  # 1 … 512


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The few numbers of a decoder-only transformer that size its weights and KV cache."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2)

    @property
    def num_params(self) -> int:
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = 2 * self.hidden_size * q_width + 2 * self.hidden_size * kv_width
        if self.attention_bias:
            attention += q_width + 2 * kv_width
        layer = attention + 3 * self.hidden_size * self.intermediate_size + 2 * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * layer + self.hidden_size

    @property
    def projection_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of one layer's q, k, v, o, gate, up and down projections."""
        h, f = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return [(h, q), (h, kv), (h, kv), (q, h), (h, f), (h, f), (f, h)]

    @property
    def projection_params(self) -> tuple[int, int]:
        """(parameters, output columns) of every layer's q/k/v/o and MLP projections: what
        `--weight-dtype` quantizes, one scale per output column."""
        params = sum(k * n for k, n in self.projection_shapes)
        columns = sum(n for _, n in self.projection_shapes)
        return self.num_layers * params, self.num_layers * columns


MODELS = {  # from each model's config.json on the Hugging Face hub
    "llama-3.1-70b": ModelShape("llama-3.1-70b", 80, 8192, 28672, 64, 8, 128, 128256),
    "llama-3.1-8b": ModelShape("llama-3.1-8b", 32, 4096, 14336, 32, 8, 128, 128256),
    "smollm2-135m": ModelShape("smollm2-135m", 30, 576, 1536, 9, 3, 64, 49152, True),
}


def model_shape(spec: str) -> ModelShape:
    """A preset name, a Hugging Face config.json (or the directory holding one), or a GGUF
    file, read by the loader's own parsers (the GGUF's metadata only, no tensor)."""
    if spec.lower() in MODELS:
        return MODELS[spec.lower()]
    path = Path(spec)
    if path.suffix == ".gguf" and path.is_file():
        from jaxserve.checkpoint.weights import open_checkpoint  # imports jax: only here

        return shape_of(open_checkpoint(path).config, str(path))
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"model must be one of {sorted(MODELS)}, a config.json or a .gguf file, got {spec!r}"
        )
    return shape_of(config_from_hf(read_hf_config(path), str(path)), str(path))


def shape_of(c: ModelConfig, name: str) -> ModelShape:
    """The planner's shape of a model the engine loads."""
    return ModelShape(
        name, c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads,
        c.num_kv_heads, c.head_dim, c.vocab_size, c.tie_word_embeddings, c.attention_bias,
    )


@dataclass(frozen=True, slots=True)
class Chip:
    """One accelerator: HBM, bandwidth and dense peak FLOP/s (None: no native rate → bf16's)."""

    name: str
    hbm_bytes: float
    bandwidth: float  # B/s
    bf16_flops: float
    fp8_flops: float | None = None
    int8_flops: float | None = None

    def peak_flops(self, dtype: str) -> float:
        rate = {"fp8": self.fp8_flops, "int8": self.int8_flops}.get(dtype)
        return self.bf16_flops if rate is None else rate


# Dense (no sparsity) figures from the vendors' datasheets: NVIDIA H100 SXM (80 GB HBM3,
# 3.35 TB/s, 989.5 bf16 / 1,979 fp8 and int8; the 1,979 bf16 / 3,958 fp8 in the table are
# with 2:4 sparsity), H200 SXM (141 GB HBM3e, 4.8 TB/s, the H100's tensor cores), A100 80 GB
# SXM (2,039 GB/s, 312 bf16, 624 int8, no fp8); Google Cloud TPU docs: v5e (16 GB, 819 GB/s,
# 197 bf16, 394 int8), v6e Trillium (32 GB, 1,640 GB/s, 918 bf16, 1,836 int8).
CHIPS = {
    "h100": Chip("H100", 80 * GB, 3.35e12, 989.5e12, 1979e12, 1979e12),
    "h200": Chip("H200", 141 * GB, 4.8e12, 989.5e12, 1979e12, 1979e12),
    "a100": Chip("A100", 80 * GB, 2.039e12, 312e12, None, 624e12),
    "v5e": Chip("TPU v5e", 16 * GB, 0.819e12, 197e12, None, 394e12),
    "v6e": Chip("TPU v6e", 32 * GB, 1.64e12, 918e12, None, 1836e12),
}


def load_chip(
    name: str,
    hbm_gb: float | None = None,
    hbm_tbps: float | None = None,
    tflops: float | None = None,
) -> Chip:
    """A preset (H100, H200, A100, v5e, v6e; "tpu-" prefix allowed), or "custom"; the
    numbers given override the preset's (`tflops`: one dense rate for every dtype)."""
    key = name.lower().removeprefix("tpu-").removeprefix("tpu ")
    if key == "custom":
        if None in (hbm_gb, hbm_tbps, tflops):
            raise ValueError("a custom chip needs --hbm-gb, --hbm-tbps and --tflops")
        chip = Chip("custom", 0.0, 0.0, 0.0)
    elif key in CHIPS:
        chip = CHIPS[key]
    else:
        raise ValueError(f"chip must be one of {sorted(CHIPS)} or custom, got {name!r}")
    if hbm_gb is not None:
        chip = replace(chip, hbm_bytes=hbm_gb * GB)
    if hbm_tbps is not None:
        chip = replace(chip, bandwidth=hbm_tbps * 1e12)
    if tflops is not None:
        chip = replace(chip, bf16_flops=tflops * 1e12, fp8_flops=None, int8_flops=None)
    return chip


def efficiency_from_calibration(path: str | Path) -> float:
    """`measured_over_roofline.median` of a bench/roofline.py result (module docstring)."""
    data = json.loads(Path(path).read_text())
    try:
        ratio = data["measured_over_roofline"]["median"]
    except (KeyError, TypeError):
        raise ValueError(f"{path}: no measured_over_roofline.median") from None
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not ratio > 0:
        raise ValueError(f"{path}: measured_over_roofline.median must be > 0, got {ratio!r}")
    return float(ratio)


def queue_bound(wait_budget_s: float, admissions_per_s: float) -> int:
    """Little's law: the queue depth whose wait fits the budget at this admission rate."""
    return math.floor(wait_budget_s * admissions_per_s + 1e-9)


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """What a plan is asked for; defaults are those of `jaxserve plan`."""

    model: ModelShape
    chip: Chip
    num_chips: int = 1
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    compute_dtype: str = "bf16"  # matmul activations; fp8/int8: W8A8 at the chip's 8-bit rate
    dtype: str = "bf16"  # what jaxserve serves in (--dtype): activations, embeddings, norms
    context: int = 2048  # tokens a sequence holds at its end: prompt + output
    output_tokens: int = 256
    tpot_slo_ms: float = 50.0
    ttft_slo_ms: float = 1000.0
    queue_budget_ms: float | None = None  # None: the TTFT SLO minus one prefill
    arrival_rate: float | None = None  # requests/s; None: no replica count
    efficiency: float = DEFAULT_EFFICIENCY  # real step ÷ roofline step
    efficiency_source: str = "default: real engines land at 2–3× the roofline"
    kv_cap: float = 0.95  # usable fraction of the free HBM
    activation_gb: float = 5.0  # per chip (40 GB over 8 chips)

    def __post_init__(self) -> None:
        for name in ("weight_dtype", "kv_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise ValueError(f"{name} must be one of {list(DTYPE_BYTES)}")
        if self.dtype not in SERVING_DTYPES:
            raise ValueError(f"dtype must be one of {list(SERVING_DTYPES)}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {list(COMPUTE_DTYPES)}")
        if self.num_chips < 1 or not 0 <= self.output_tokens < self.context:
            raise ValueError("need num_chips >= 1 and 0 <= output_tokens < context")
        if not (self.efficiency > 0 and 0 < self.kv_cap <= 1 and self.activation_gb >= 0):
            raise ValueError("need efficiency > 0, 0 < kv_cap <= 1 and activation_gb >= 0")
        if not (self.tpot_slo_ms > 0 and self.ttft_slo_ms > 0):
            raise ValueError("SLOs must be > 0")

    @property
    def matmul_dtype(self) -> str:
        """The wider of the weight and activation dtypes sets the tensor-core rate."""
        wider = DTYPE_BYTES[self.weight_dtype] > DTYPE_BYTES[self.compute_dtype]
        return "bf16" if wider else self.compute_dtype


@dataclass(frozen=True, slots=True)
class Roofline:
    """Decode step times of the whole deployment (all chips), in seconds."""

    weight_bytes: float
    kv_bytes_per_sequence: float
    flops_per_token: float  # 2 × params
    bandwidth: float  # B/s, all chips
    peak_flops: float  # FLOP/s, all chips

    def memory_s(self, batch: int) -> float:
        return (self.weight_bytes + batch * self.kv_bytes_per_sequence) / self.bandwidth

    def compute_s(self, batch: int) -> float:
        return self.flops_per_token * batch / self.peak_flops

    def step_s(self, batch: int) -> float:
        return max(self.memory_s(batch), self.compute_s(batch))

    def ridge_batch(self) -> int | None:
        slope = self.flops_per_token / self.peak_flops - self.kv_bytes_per_sequence / self.bandwidth
        if slope <= 0:
            return None
        return math.ceil(self.weight_bytes / self.bandwidth / slope - 1e-9)

    def max_batch(self, step_budget_s: float) -> int:
        """The largest batch whose roofline step fits the budget (0 if none does)."""
        by_memory = step_budget_s * self.bandwidth - self.weight_bytes
        by_memory /= self.kv_bytes_per_sequence
        by_compute = step_budget_s * self.peak_flops / self.flops_per_token
        return max(0, math.floor(min(by_memory, by_compute) + 1e-9))


@dataclass(frozen=True, slots=True)
class Plan:
    """The planner's answer; `to_json()` is what `jaxserve plan --json` prints."""

    inputs: PlanInputs
    num_params: int
    weight_bytes: int
    stored_weight_bytes: int  # as jaxserve's engine holds them (see the module docstring)
    kv_bytes_per_token: int
    kv_bytes_per_sequence: int
    kv_free_bytes: int  # HBM left after weights and activations, before the cap
    kv_pool_bytes: int  # usable: kv_cap × kv_free_bytes
    max_sequences_by_kv: int
    roofline: list[dict]  # {batch, step_ms, tokens_per_s, compute_ms, memory_ms}
    ridge_batch: int | None
    max_batch_by_tpot: int
    batch: int  # the smaller of the two bounds
    binding_bound: str  # "tpot" or "kv"
    prefill_ms: float  # one prompt alone, real time
    queue_budget_ms: float
    ttft_ms: float  # queue budget + prefill
    service_rate: float  # admissions/s one replica sustains at `batch`
    replicas_needed: int | None  # None without an arrival rate, or when nothing fits
    admission_rate: float  # arrival rate if given, else one replica's service rate
    queue_bound: int  # Little's law, one queue in front of all replicas
    queue_bound_per_replica: int  # each replica's own queue, at its share of the arrivals

    def to_json(self) -> dict:
        out = asdict(self)
        out["inputs"] = out.pop("inputs")  # last, after the answers
        out["efficiency"] = self.inputs.efficiency
        out["matmul_dtype"] = self.inputs.matmul_dtype
        return out


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str) -> int:
    """One token's K and V in every layer, scales included: what the engine's pool holds
    per token (the engine sizes --kv-cache-bytes' pages with this)."""
    per_head = head_dim * DTYPE_BYTES[kv_dtype] + KV_SCALE_BYTES.get(kv_dtype, 0)
    return round(2 * num_layers * num_kv_heads * per_head)


def stored_weight_bytes(model: ModelShape, weight_dtype: str, dtype: str,
                        packed: bool = False, head_copy: bool = False) -> int:
    """The bytes of weights jaxserve's engine holds: the projections in `weight_dtype` (with
    an f32 scale per output column where quantized), every other parameter in `dtype`.
    `packed`: the projections and the LM head packed for a bf16 CPU kernel instead
    (cpu_kernels/linear.py: bf16, each input dimension padded to whole tiles of 32; with
    `weight_dtype` "q4_1" the projections as a GGUF file's Q4_1 blocks, 320 bytes a tile
    of 512 weights, the head still bf16); a tied model keeps its embedding for the lookup
    beside the packed head. `head_copy`: a tied model's head also held as its own [hidden,
    vocab] copy in `dtype`, as XLA's path on one CPU device holds it (checkpoint/weights.py,
    untie_head)."""
    projections, columns = model.projection_params
    rest = model.num_params - projections
    if packed:
        h = model.hidden_size

        def tiles(k: int) -> int:  # an input dimension, padded to whole tiles
            return -(-k // 32) * 32

        layer = sum(tiles(k) * n for k, n in model.projection_shapes)
        head = 2 * tiles(h) * model.vocab_size
        if not model.tie_word_embeddings:  # the head is packed in place, not copied
            rest -= h * model.vocab_size
        per_weight = 320 / 512 if weight_dtype == "q4_1" else 2
        return round(per_weight * model.num_layers * layer + head + rest * DTYPE_BYTES[dtype])
    scales = 4 * columns if weight_dtype in SCALED_WEIGHTS else 0
    if head_copy and model.tie_word_embeddings:
        rest += model.hidden_size * model.vocab_size
    return round(projections * DTYPE_BYTES[weight_dtype] + scales + rest * DTYPE_BYTES[dtype])


def plan(inputs: PlanInputs) -> Plan:
    """Size a deployment: see the module docstring for every definition."""
    model, chip, chips, eff = inputs.model, inputs.chip, inputs.num_chips, inputs.efficiency
    params = model.num_params
    weight_bytes = math.ceil(params * DTYPE_BYTES[inputs.weight_dtype])
    kv_per_token = kv_bytes_per_token(
        model.num_layers, model.num_kv_heads, model.head_dim, inputs.kv_dtype
    )
    kv_per_sequence = inputs.context * kv_per_token
    kv_free = chips * chip.hbm_bytes - weight_bytes - chips * inputs.activation_gb * GB
    kv_pool = max(0, math.floor(inputs.kv_cap * kv_free))
    max_by_kv = kv_pool // kv_per_sequence

    peak = chips * chip.peak_flops(inputs.matmul_dtype)
    roof = Roofline(weight_bytes, kv_per_sequence, 2 * params, chips * chip.bandwidth, peak)
    points = [
        {
            "batch": b,
            "step_ms": roof.step_s(b) * 1e3,
            "tokens_per_s": b / roof.step_s(b),
            "compute_ms": roof.compute_s(b) * 1e3,
            "memory_ms": roof.memory_s(b) * 1e3,
        }
        for b in ROOFLINE_BATCHES
    ]
    max_by_tpot = roof.max_batch(inputs.tpot_slo_ms / 1e3 / eff)
    batch = min(max_by_tpot, max_by_kv)

    prompt = inputs.context - inputs.output_tokens
    prefill_compute_s = eff * 2 * params * prompt / peak
    prefill_ms = max(eff * weight_bytes / roof.bandwidth, prefill_compute_s) * 1e3
    budget_ms = inputs.queue_budget_ms
    if budget_ms is None:
        budget_ms = max(0.0, inputs.ttft_slo_ms - prefill_ms)
    service_rate = 0.0
    if batch > 0:
        decode_share_s = inputs.output_tokens * eff * roof.step_s(batch) / batch
        service_rate = 1 / (prefill_compute_s + decode_share_s)
    replicas = None
    if inputs.arrival_rate is not None and service_rate > 0:
        replicas = max(1, math.ceil(inputs.arrival_rate / service_rate - 1e-9))
    admission_rate = inputs.arrival_rate if inputs.arrival_rate is not None else service_rate
    return Plan(
        inputs=inputs,
        num_params=params,
        weight_bytes=weight_bytes,
        stored_weight_bytes=stored_weight_bytes(model, inputs.weight_dtype, inputs.dtype),
        kv_bytes_per_token=kv_per_token,
        kv_bytes_per_sequence=kv_per_sequence,
        kv_free_bytes=math.floor(kv_free),
        kv_pool_bytes=kv_pool,
        max_sequences_by_kv=max_by_kv,
        roofline=points,
        ridge_batch=roof.ridge_batch(),
        max_batch_by_tpot=max_by_tpot,
        batch=batch,
        binding_bound="tpot" if max_by_tpot < max_by_kv else "kv",
        prefill_ms=prefill_ms,
        queue_budget_ms=budget_ms,
        ttft_ms=budget_ms + prefill_ms,
        service_rate=service_rate,
        replicas_needed=replicas,
        admission_rate=admission_rate,
        queue_bound=queue_bound(budget_ms / 1e3, admission_rate),
        queue_bound_per_replica=queue_bound(budget_ms / 1e3, admission_rate / (replicas or 1)),
    )


def format_report(result: Plan) -> str:
    """The plan as a few readable paragraphs (what `jaxserve plan` prints)."""
    inp, chip = result.inputs, result.inputs.chip
    n, eff = inp.num_chips, inp.efficiency
    peak = chip.peak_flops(inp.matmul_dtype) / 1e12
    lines = [
        f"{inp.model.name} ({result.num_params / 1e9:.2f} B params) on {n} × {chip.name} "
        f"({chip.hbm_bytes / GB:g} GB, {chip.bandwidth / 1e12:g} TB/s, "
        f"{peak:g} TFLOP/s at {inp.matmul_dtype} matmuls, each)",
        f"weights {inp.weight_dtype}, KV {inp.kv_dtype}, context {inp.context:,} tokens "
        f"({inp.context - inp.output_tokens:,} prompt + {inp.output_tokens:,} output)",
        "",
        "memory",
        f"  weights          {result.weight_bytes / GB:9.2f} GB "
        f"({result.weight_bytes / GB / n:.2f} per chip; as jaxserve stores them, the rest "
        f"in {inp.dtype}: {result.stored_weight_bytes / GB:.2f} GB)",
        f"  activations      {n * inp.activation_gb:9.2f} GB "
        f"({inp.activation_gb:g} per chip, reserved)",
        f"  KV pool          {result.kv_free_bytes / GB:9.2f} GB free, "
        f"{result.kv_pool_bytes / GB:.2f} GB usable at {inp.kv_cap:.0%}",
        f"  KV per token     {result.kv_bytes_per_token:9,d} B",
        f"  KV per sequence  {result.kv_bytes_per_sequence / GB:9.3f} GB "
        f"→ {result.max_sequences_by_kv:,} sequences fit",
        "",
        "roofline decode step (every sequence at its full context)",
        "  batch  memory ms  compute ms   step ms    tokens/s",
    ]
    lines += [
        f"  {p['batch']:5d} {p['memory_ms']:10.2f} {p['compute_ms']:11.2f} "
        f"{p['step_ms']:9.2f} {p['tokens_per_s']:11,.0f}"
        for p in result.roofline
    ]
    ridge = result.ridge_batch
    ttft_missed = result.ttft_ms > inp.ttft_slo_ms + 1e-6
    lines += [
        f"  compute-bound from batch {ridge:,} (the ridge)" if ridge else "  never compute-bound",
        "",
        f"bounds (real step = {eff:g} × roofline; {inp.efficiency_source})",
        f"  {f'TPOT {inp.tpot_slo_ms:g} ms':<16} → batch ≤ {result.max_batch_by_tpot:,}",
        f"  {'KV pages':<16} → batch ≤ {result.max_sequences_by_kv:,}",
        f"  binding: {result.binding_bound.upper()} (batch {result.batch:,})",
        "",
        "queue and replicas",
        f"  prefill of one prompt ≈ {result.prefill_ms:,.1f} ms; queue budget "
        f"{result.queue_budget_ms:,.0f} ms → TTFT ≈ {result.ttft_ms:,.0f} ms "
        f"(SLO {inp.ttft_slo_ms:g} ms{': MISSED' if ttft_missed else ''})",
        f"  one replica admits ≈ {result.service_rate:,.1f} requests/s at batch {result.batch:,}",
    ]
    if result.kv_free_bytes <= 0:
        lines.append("  nothing fits: the weights and activations alone exceed the HBM")
    elif result.batch == 0:
        lines.append("  nothing fits: no batch meets both the TPOT SLO and the KV pool")
    if result.replicas_needed is not None:
        lines.append(
            f"  arrival {inp.arrival_rate:g}/s → {result.replicas_needed} replica(s) "
            f"({result.replicas_needed * n} chips)"
        )
    lines.append(
        f"  queue bound {result.queue_bound:,} for one shared queue (Little's law: "
        f"{result.queue_budget_ms / 1e3:.3g} s × {result.admission_rate:,.1f}/s), "
        f"{result.queue_bound_per_replica:,} for each replica's own"
    )
    return "\n".join(lines)
