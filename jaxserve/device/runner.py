"""The device side of the engine: weights, the KV pool and the jitted step over buckets.

Every bucket is compiled at warm-up, with jax's persistent compilation cache so a
second start is fast. Backend compiles are counted through jax.monitoring; one
after warm-up means a shape escaped the bucket table, and is logged as an error.

Given a mesh, the weights, the KV pool and the step are laid out by
`sharding.Layout`; without one everything sits on the default device. With dp
data shards the KV pool holds dp pools of `num_pages` pages one after the other
(page ids are shard-local) and the penalty state dp × (num_rows + 1) rows; each
shard's batch is packed on its own and the packs are concatenated, so the step
(`step.jit_step` with the layout) runs each shard's rows on its own devices.
"""

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.checkpoint.adapter import Adapter
from jaxserve.device.adapters import SlotStore, slot_axes
from jaxserve.device.attention import select_backend
from jaxserve.device.batch import pack_step
from jaxserve.device.executables import ExecutableStore, compile_ahead
from jaxserve.device.huge_pages import back_with_huge_pages
from jaxserve.device.kv_cache import (
    CALIBRATED,
    CALIBRATION_HEADROOM,
    CALIBRATION_TOKENS,
    FP8_MAX,
    KV_STORAGE,
    SCALED,
    KVCache,
    init_kv_cache,
    storage_name,
)
from jaxserve.device.multihost import SCORE, STEP, StepChannel, is_leader
from jaxserve.device.sampling import init_row_state
from jaxserve.device.sharding import DATA, Layout
from jaxserve.device.step import StepInputs, jit_score, jit_step
from jaxserve.host.buckets import BucketTable, draft_logits
from jaxserve.host.page_allocator import NULL_PAGE
from jaxserve.host.plan import Chunk, StepPlan
from jaxserve.host.results import RESULT_WIDTH, PendingStep, StepOutput
from jaxserve.models import param_axes
from jaxserve.models.layers import is_packed
from jaxserve.pallas_kernels.storage import dequantize

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WarmupProgress:
    """One bucket compiled (or loaded from the compilation cache) at start-up."""

    done: int  # buckets compiled so far, this one included
    total: int
    kind: str  # "step", or "score" (the prompt-logprob pass of one token size)
    shape: tuple[int, int]  # (num_tokens, num_rows)
    seconds: float  # this bucket's compile (and first run)
    elapsed: float  # since the warm-up began

    @property
    def remaining(self) -> float:
        """Seconds left, at the pace so far (an estimate: larger buckets come last)."""
        return self.elapsed / self.done * (self.total - self.done)


    def __str__(self) -> str:
        tokens, rows = self.shape
        return (f"compiled {self.kind} bucket {tokens}x{rows} in {self.seconds:.1f} s "
                f"({self.done}/{self.total}, ~{self.remaining:.0f} s left)")


_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Counts XLA backend compiles in this process (all threads)."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if event == _BACKEND_COMPILE_EVENT:
            with self._lock:
                self.count += 1


_COMPILES = CompileCounter()


def compile_count() -> int:
    """XLA backend compiles so far in this process."""
    return _COMPILES.count


def enable_compilation_cache(directory: str | Path) -> None:
    """Persist compiled executables under `directory` (every entry, however quick)."""
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


class ModelRunner:
    """Runs step plans on the model; the engine's Runner."""

    def __init__(
        self,
        model: nnx.Module,
        buckets: BucketTable,
        num_pages: int,
        page_size: int,
        max_model_len: int,
        num_rows: int,
        attention_backend: str | None = None,
        dtype: jnp.dtype = jnp.float32,
        mesh: jax.sharding.Mesh | None = None,
        kv_dtype: str | None = None,
        adapter_slots: tuple[int, int] | None = None,
        executable_dir: str | Path | None = None,
        num_speculative_tokens: int = 0,
    ):
        """`kv_dtype` is how pages store K and V (a kv_cache.KV_STORAGE name); None: in
        `dtype`. `adapter_slots`: (slots, max rank) of LoRA adapters to serve; None: none.
        `executable_dir`: where each bucket's executable is kept between starts
        (executables.py); None: compiled each start. `num_speculative_tokens`: the
        drafts a row may carry (speculative decoding; each bucket then verifies
        `buckets.draft_logits` of them)."""
        cfg = model.config
        self.num_speculative_tokens = num_speculative_tokens
        self.graphdef, self.state = nnx.split(model)
        self.buckets = buckets
        self.page_size = page_size
        self.max_pages = -(-max_model_len // page_size)
        self.kv_dtype = kv_dtype or storage_name(dtype)
        self.backend = select_backend(
            attention_backend, dtype, self.kv_dtype, page_size, cfg.head_dim
        )
        self.num_shards = 1 if mesh is None else mesh.shape[DATA]
        pool = num_pages * self.num_shards
        kv_shape = (cfg.num_layers, cfg.num_kv_heads, pool, page_size, cfg.head_dim)
        k_transposed = self.backend == "cpu"  # the C++ kernel reads K so (kv_cache.py)
        self.layout = None if mesh is None else Layout.build(
            mesh, self.state, kv_shape, param_axes(cfg), self.kv_dtype in SCALED,
            self.kv_dtype in CALIBRATED, k_transposed,
        )
        self.kv_cache = init_kv_cache(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, pool, page_size,
            KV_STORAGE[self.kv_dtype],
            *((None, None, None) if self.layout is None else
              (self.layout.kv_cache.k, self.layout.kv_cache.k_scale,
               self.layout.kv_cache.k_center)),
            k_transposed=k_transposed,
        )
        self.spare_row = num_rows  # each shard's last row of the row state
        self.row_state = init_row_state(
            self.num_shards * (num_rows + 1) - 1, cfg.vocab_size
        )
        self.adapter_store = self.adapter_slots = None
        if adapter_slots is not None:
            if jax.process_count() > 1:
                raise ValueError("LoRA adapters are not served across processes yet")
            # the adapters' products run as the projections do: on their kernel if packed
            kernel = next((w for w in jax.tree.leaves(self.state, is_leaf=is_packed)
                           if is_packed(w)), None)
            self.adapter_store = SlotStore(
                cfg, *adapter_slots, mesh, slot_axes(param_axes(cfg)),
                # (bf16 weights: int8 activations, passes 0, multiply Q4_1 ones only)
                *(() if kernel is None else (kernel.backend, max(kernel.passes, 1))),
            )
            self.adapter_slots = self.adapter_store.slots()
            if self.layout is not None:
                self.layout = dataclasses.replace(
                    self.layout, adapters=jax.tree.map(lambda x: x.sharding, self.adapter_slots)
                )
        if self.layout is not None:
            # a no-op for weights loaded into their shardings (loader.load with the mesh)
            self.state = jax.device_put(self.state, self.layout.state)
            self.row_state = jax.device_put(self.row_state, self.layout.data)
        self._weights = jax.tree.leaves(self.state)  # what the jitted calls take
        back_with_huge_pages(self._weights + jax.tree.leaves(self.kv_cache))
        self._step = jit_step(self.graphdef, self.state, self.layout)
        self._score = jit_score(self.graphdef, self.state, self.layout)
        # each (program, bucket)'s executable, compiled (or loaded) on its first call
        self._executables: dict[tuple[str, tuple[int, int]], jax.stages.Compiled] = {}
        self.executable_store = None
        if executable_dir is not None:
            # the layout too: the arguments' shardings are not in the store's key (host
            # arrays), and one model and sizes on one device or on a mesh differ only there
            program = repr((cfg, self.graphdef, jax.tree.structure(self.state), self.backend,
                            self.page_size, self.max_pages, self.kv_dtype, self.spare_row,
                            self.layout, num_speculative_tokens))
            devices = (list(self._weights[0].devices()) if mesh is None
                       else list(mesh.devices.flat))
            self.executable_store = ExecutableStore(executable_dir, program, devices)
        # process 0 of several announces each device call to the others (multihost)
        self.channel = StepChannel() if jax.process_count() > 1 and is_leader() else None
        self.step_times: dict[tuple[int, int], float] = {}  # bucket -> median seconds
        self.warm = False
        self.compiles_after_warmup = 0

    def launch(self, plan: StepPlan) -> PendingStep:
        """Dispatch `plan`'s step and return at once: what is returned waits for its
        results. Steps run in the order they are launched, so the next one may be launched
        before this one's results are read (async scheduling: see `plan.pending_token`)."""
        for slot, adapter in plan.adapter_loads:
            self.write_adapter(slot, adapter)
        if not plan.chunks:  # its requests failed before the step; the writes stand
            return PendingStep(lambda: StepOutput.unpack(np.zeros((0, RESULT_WIDTH), np.float32)))
        # scored before the step, so the K/V the cache keeps are the step's own
        prompt = {
            c.request_id: self._score_chunk(c) for c in plan.chunks if c.score_targets is not None
        }
        pending = self._launch(plan.chunks, plan.bucket)
        if not prompt:
            return pending
        return dataclasses.replace(
            pending, output=lambda: dataclasses.replace(pending.output(), prompt_logprobs=prompt))

    def execute(self, plan: StepPlan) -> StepOutput:
        """`plan`'s step, run to its results."""
        return self.launch(plan).output()

    def write_adapter(self, slot: int, adapter: Adapter | None) -> None:
        """Put `adapter` (None: zeros) into device slot `slot` (1-based)."""
        self.adapter_store.write(slot, adapter)
        self.adapter_slots = self.adapter_store.slots()

    def _score_chunk(self, chunk: Chunk) -> StepOutput:
        """Prompt logprobs of a prefill chunk, one row per token (see `step.score`),
        against its `score_targets`. Other data shards score nothing (padding) meanwhile."""
        n = len(chunk.token_ids)
        num_tokens, _ = self.buckets.choose(n, 1)
        inputs = self._score_inputs(chunk, num_tokens)
        if self.channel is not None:
            self.channel.send(SCORE, (num_tokens, 1), inputs)
        results = self.dispatch_score(inputs, num_tokens)
        rows = np.asarray(jax.device_get(results)).reshape(self.num_shards, num_tokens, -1)
        return StepOutput.unpack(rows[chunk.shard, :n])

    def _score_inputs(self, chunk: Chunk, num_tokens: int) -> tuple:
        """`score`'s inputs for `chunk`, on its shard (the others pad)."""
        packs = [self._score_pack([chunk] if s == chunk.shard else [], num_tokens)
                 for s in range(self.num_shards)]
        packs[chunk.shard][3][: len(chunk.token_ids)] = chunk.score_targets
        return _concatenate(packs)

    def _score_pack(self, chunks: list[Chunk], num_tokens: int) -> tuple:
        """One shard's `score` inputs: tokens, positions, metadata and zero targets."""
        inputs = pack_step(
            chunks, self.page_size, num_tokens, 1, self.max_pages, self.spare_row, self.backend
        )
        every_token = np.arange(num_tokens, dtype=np.int32)
        metadata = dataclasses.replace(inputs.metadata, logits_indices=every_token)
        return (inputs.token_ids, inputs.positions, metadata, np.zeros(num_tokens, np.int32),
                inputs.adapters)

    def empty_score_inputs(self, num_tokens: int) -> tuple:
        """`score` inputs of this shape holding nothing (what followers receive into)."""
        return _concatenate([self._score_pack([], num_tokens)] * self.num_shards)

    def dispatch_score(self, inputs: tuple, num_tokens: int) -> jax.Array:
        args = self._score_args(self._global(inputs))
        results, self.kv_cache = self._executable("score", self._score, (num_tokens, 1), args)(
            *args)
        return results

    def _score_args(self, inputs: tuple) -> tuple:
        return (self._weights, self.kv_cache, *inputs, self.adapter_slots)

    def pack(self, plan: StepPlan) -> StepInputs:
        """The host inputs `execute` would dispatch for `plan` (benchmarks time the device
        alone by dispatching them back to back)."""
        return self._pack(plan.chunks, plan.bucket)[0]

    def _pack(self, chunks: Sequence[Chunk], bucket: tuple[int, int]
              ) -> tuple[StepInputs, list[int], list[int]]:
        """The step inputs of `chunks` (each on its data shard), each chunk's result row,
        and the result row of the token drawn after its first draft (step.py)."""
        packs, rows = [], []
        width = bucket[1] + self._draft_logits(bucket)  # a shard's result rows
        for s in range(self.num_shards):
            mine = [i for i, c in enumerate(chunks) if c.shard == s]
            packs.append(self._step_pack([chunks[i] for i in mine], bucket))
            first_draft = s * width + bucket[1]
            for j, i in enumerate(mine):
                rows.append((i, s * width + j, first_draft))
                first_draft += chunks[i].num_speculative
        rows.sort()
        return _concatenate(packs), [r[1] for r in rows], [r[2] for r in rows]

    def _draft_logits(self, bucket: tuple[int, int]) -> int:
        return draft_logits(bucket, self.num_speculative_tokens)

    def _run(self, chunks: Sequence[Chunk], bucket: tuple[int, int]) -> StepOutput:
        """Run `chunks`; results in the chunks' order."""
        return self._launch(chunks, bucket).output()

    def _launch(self, chunks: Sequence[Chunk], bucket: tuple[int, int]) -> PendingStep:
        """Dispatch `chunks`' step; what is returned waits for its results, in the chunks'
        order, `device_seconds` being the dispatch and the wait (the host's part of the
        time the device computed)."""
        inputs, order, first_drafts = self._pack(chunks, bucket)
        samples = np.array([c.samples for c in chunks], bool)
        if self.channel is not None:
            self.channel.send(STEP, bucket, inputs)
        start = time.perf_counter()
        results = self.dispatch_step(inputs, bucket)
        dispatch = time.perf_counter() - start

        def output() -> StepOutput:
            start = time.perf_counter()
            rows = np.asarray(jax.device_get(results))
            device = dispatch + time.perf_counter() - start
            output = StepOutput.unpack(rows[order], samples)
            if any(c.num_speculative for c in chunks):
                drafts = [c.token_ids[len(c.token_ids) - c.num_speculative :] for c in chunks]
                after = [rows[f : f + len(d), 0].astype(np.int32).tolist()
                         for f, d in zip(first_drafts, drafts)]
                output = output.verified(drafts, after)
            return dataclasses.replace(output, device_seconds=device)

        return PendingStep(output, results.is_ready)

    def _step_pack(self, chunks: list[Chunk], bucket: tuple[int, int]) -> StepInputs:
        num_tokens, num_rows = bucket
        return pack_step(
            chunks, self.page_size, num_tokens, num_rows, self.max_pages, self.spare_row,
            self.backend, self._draft_logits(bucket),
        )

    def empty_step_inputs(self, bucket: tuple[int, int]) -> StepInputs:
        """Step inputs of this bucket holding nothing (what followers receive into)."""
        return _concatenate([self._step_pack([], bucket)] * self.num_shards)

    def dispatch_step(self, inputs: StepInputs, bucket: tuple[int, int]) -> jax.Array:
        args = self._step_args(self._global(inputs))
        results, self.kv_cache, self.row_state = self._executable(
            "step", self._step, bucket, args)(*args)
        return results

    def _step_args(self, inputs: StepInputs) -> tuple:
        return (self._weights, self.kv_cache, self.row_state, inputs, self.adapter_slots)

    def _loaded(self, name: str, fn: Callable, shape: tuple[int, int], args: tuple) -> bool:
        """Whether `name`'s executable for `shape` is now held, read from the store rather
        than compiled (one process only: see `warmup`)."""
        if self.executable_store is None or jax.process_count() > 1:
            return False
        before = self.executable_store.loaded
        self._executable(name, fn, shape, args)
        return self.executable_store.loaded > before

    def _executable(self, name: str, fn: Callable, shape: tuple[int, int], args: tuple
                    ) -> jax.stages.Compiled:
        """`fn`'s executable for this bucket: made on its first call (from the store when
        one is kept, else compiled), the same one afterwards."""
        executable = self._executables.get((name, shape))
        if executable is None:
            before = _COMPILES.count
            if self.executable_store is None:
                executable = compile_ahead(fn, args)
            else:
                executable = self.executable_store.load_or_compile(f"{name} {shape}", fn, args)
            self._executables[(name, shape)] = executable
            self._count_compiles(before, shape)
        return executable

    def _global(self, inputs: object) -> object:
        """Host inputs as arrays split over the data shards. Across processes jax takes
        no numpy input with such a sharding: each process builds its own shards from
        the inputs every process holds (process 0's, broadcast)."""
        if jax.process_count() == 1:
            return inputs
        return jax.tree.map(
            lambda x: jax.make_array_from_callback(x.shape, self.layout.data, x.__getitem__),
            inputs,
        )

    def _count_compiles(self, before: int, bucket: tuple[int, int]) -> None:
        if self.warm and _COMPILES.count > before:
            self.compiles_after_warmup += _COMPILES.count - before
            log.error("compiled while serving: bucket %s (a shape outside the table)", bucket)

    def warmup(
        self,
        repeats: int = 3,
        worst_case: bool = True,
        timed: Collection[tuple[int, int]] | None = None,
        progress: Callable[[WarmupProgress], None] | None = None,
    ) -> dict[tuple[int, int], float]:
        """Compile every bucket on dummy inputs that touch only the null page, and time
        the `timed` ones (default: all) into `step_times`.

        With `worst_case` the dummy rows sit at the end of the longest context, so
        the measured step times are the worst case that the TPOT bound needs (on a
        CPU, minutes per bucket at an 8k context: attention loops over the pages a
        row holds). Without it they sit at the start: the compile is the same, the
        times are the short-context ones. The prompt-logprob pass (`step.score`) is
        compiled for every token size too. Each compile is logged, with an estimate of the
        time left, and told to `progress` if given.

        An untimed bucket whose executable comes from the store is loaded, not run: it ran
        in the start that compiled it, and its run (a 256-token bucket's is a prefill) was
        ~2/3 of a warm restart's 9 s of buckets on a Zen 4. Across processes every bucket
        still runs: that is what has the followers load their steps.
        """
        context = self.max_pages * self.page_size if worst_case else 0
        buckets = self.buckets.buckets()
        total = len(self.buckets.token_sizes) + len(buckets)
        began = time.perf_counter()
        done = 0

        def report(kind: str, shape: tuple[int, int], seconds: float) -> None:
            nonlocal done
            done += 1
            update = WarmupProgress(done, total, kind, shape, seconds, time.perf_counter() - began)
            log.info("%s", update)
            if progress is not None:
                progress(update)

        for num_tokens in self.buckets.token_sizes:
            start = time.perf_counter()
            offset = max(0, context - num_tokens)
            targets = (0,) * num_tokens
            pages = [NULL_PAGE] * self.max_pages
            chunk = Chunk(targets, offset, pages, score_targets=targets)
            inputs = self._score_inputs(chunk, num_tokens)
            if not self._loaded("score", self._score, (num_tokens, 1), self._score_args(inputs)):
                self._score_chunk(chunk)
            report("score", (num_tokens, 1), time.perf_counter() - start)
        for num_tokens, num_rows in buckets:
            n = num_tokens // num_rows
            dummy = [  # a full batch on every shard
                Chunk([0] * n, max(0, context - n), [NULL_PAGE] * self.max_pages, shard=s)
                for s in range(self.num_shards)
                for _ in range(num_rows)
            ]
            start = time.perf_counter()
            untimed = timed is not None and (num_tokens, num_rows) not in timed
            if not (untimed and self._loaded(
                    "step", self._step, (num_tokens, num_rows),
                    self._step_args(self._pack(dummy, (num_tokens, num_rows))[0]))):
                self._run(dummy, (num_tokens, num_rows))  # compile
            report("step", (num_tokens, num_rows), time.perf_counter() - start)
            if untimed:
                continue
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                self._run(dummy, (num_tokens, num_rows))
                times.append(time.perf_counter() - start)
            self.step_times[(num_tokens, num_rows)] = float(np.median(times))
        self.warm = True
        return self.step_times

    def calibrate_kv(self, token_ids: Sequence[int]) -> None:
        """Set an fp8 pool's centers and channel scales (kv_cache.py) from `token_ids`:
        each channel's center is its mean over them, its scale maps CALIBRATION_HEADROOM
        times the largest deviation seen onto e4m3's ±448. Stats are read through the
        current calibration (at first: none), so a pass that clipped a channel is run
        again through the calibration it gave. Before serving only (see `kv_stats`)."""
        if jax.process_count() > 1:  # followers would have to run the read-back too
            log.warning("fp8 KV is not calibrated across processes: centers 0, scales 1")
            return
        for _ in range(3):
            (k_mean, k_dev), (v_mean, v_dev), clipped = self.kv_stats(token_ids)
            calibration = [k_mean, v_mean] + [
                jnp.maximum(dev, 1e-6) * CALIBRATION_HEADROOM / FP8_MAX for dev in (k_dev, v_dev)]
            if self.layout is not None:
                calibration = jax.device_put(calibration, self.layout.kv_cache.k_center)
            self.kv_cache = dataclasses.replace(
                self.kv_cache, k_center=calibration[0], v_center=calibration[1],
                k_channel_scale=calibration[2], v_channel_scale=calibration[3])
            if not clipped:
                break
        log.info("calibrated the fp8 KV on %d tokens", min(len(token_ids), CALIBRATION_TOKENS))

    def kv_stats(self, token_ids: Sequence[int]) -> tuple[tuple[jax.Array, jax.Array],
                                                          tuple[jax.Array, jax.Array], bool]:
        """((mean, largest |deviation| from it) of K, the same of V, whether any stored
        value sat at fp8's ±448) over `token_ids` (up to CALIBRATION_TOKENS, as many as the
        pages hold) run as one prompt: computed into pages 1, 2, ... of the first data
        shard and read back as the pool's calibration stores them. Means and deviations
        are f32[layers, kv_heads, head_dim]. Those pages are free to the allocator, which
        never learns of them: only while nothing is served."""
        pages = list(range(1, min(self.max_pages, self.kv_cache.num_pages // self.num_shards - 1)
                           + 1))
        ids = list(token_ids)[: min(CALIBRATION_TOKENS, len(pages) * self.page_size)]
        if not ids:
            raise ValueError("no tokens to take the KV statistics over")
        step = self.buckets.token_sizes[-1]
        for start in range(0, len(ids), step):
            chunk = Chunk(ids[start : start + step], start, pages,
                          samples=start + step >= len(ids), first=start == 0)
            self._run([chunk], self.buckets.choose(len(chunk.token_ids), 1))
        k, v, clipped = _stats(self.kv_cache, np.array(pages), len(ids))
        return k, v, bool(clipped)

    def max_batch_under(self, tpot_slo_s: float, fraction: float = 0.6) -> int:
        """Largest row count whose slowest bucket stays under `fraction` of the TPOT SLO."""
        best = 0
        for seqs in self.buckets.row_sizes:
            worst = max(t for (_, s), t in self.step_times.items() if s == seqs)
            if worst <= fraction * tpot_slo_s:
                best = seqs
        return best


@functools.partial(jax.jit, static_argnums=2)
def _stats(cache: KVCache, pages: jax.Array, num_tokens: int) -> tuple:
    """`ModelRunner.kv_stats` of the first `num_tokens` K and V stored in `pages`."""
    def stats(pool, scale, center, channel_scale, transposed=False) -> tuple:
        pool = pool[:, :, pages]
        if transposed:  # [.., head_dim, page_size] pages
            pool = jnp.swapaxes(pool, -1, -2)
        stored = dequantize(pool, None if scale is None else scale[:, :, pages], jnp.float32)
        stored = stored.reshape(*stored.shape[:2], -1, stored.shape[-1])[:, :, :num_tokens]
        x = stored if center is None else stored * channel_scale[:, :, None] + center[:, :, None]
        mean = x.mean(2)
        clipped = center is not None and jnp.any(jnp.abs(stored) >= FP8_MAX)
        return (mean, jnp.abs(x - mean[:, :, None]).max(2)), clipped

    k, k_clipped = stats(cache.k, cache.k_scale, cache.k_center, cache.k_channel_scale,
                         cache.k_transposed)
    v, v_clipped = stats(cache.v, cache.v_scale, cache.v_center, cache.v_channel_scale)
    return k, v, jnp.logical_or(k_clipped, v_clipped)


def _concatenate(packs: list) -> object:
    """The data shards' packed inputs as one pytree, shard after shard on each leaf's axis 0."""
    if len(packs) == 1:
        return packs[0]
    return jax.tree.map(lambda *leaves: np.concatenate(leaves), *packs)
