"""bf16 weights on the CPU's bf16 units: linear.cc's kernels through XLA's FFI, and the
packing they read.

XLA:CPU converts a bf16 weight to f32 before every dot, so `--weight-dtype bf16` streamed
half the bytes and still ran 2.3x slower than f32. On a CPU with Intel AMX (Sapphire
Rapids and later) or AVX512-BF16 (AMD Zen 4 and later) the weight is instead packed once,
at load, into the tiles that AMX multiplies (`pack`; a tile's row is also the operand of
AVX512-BF16's `vdpbf16ps`), and `packed_linear` multiplies f32 activations by it: rounded
to bf16 (`passes` 1; reference `bf16(x) @ unpack(w)`), or to f32 precision of x (2: x is
split into two bf16 parts; reference `x @ unpack(w)`; see linear.cc).

A GGUF file's Q4_1 projections can stay Q4_1 (`pack_q4_1`: 0.31x the bytes of bf16) on
either kernel: it widens each tile to bf16 as it multiplies it, exactly as `pack` rounds
the dequantized weight, so the results are the bf16 packing's bit for bit, and a decode
step, which streams every weight once, reads a third of the bytes. On AVX512-VNNI
a Q4_1 weight can instead take int8 activations (`passes` 0: x quantized per row and
block of 32 inputs in two int8 terms, the second the first's remainder, and the nibbles
multiplied as integers; reference `q8_reference`), with no widening at all.

LoRA adapters' stacked A and B (device/adapters.py) are packed like any bf16 weight, and
`slot_linear` multiplies each row by its own adapter slot's part of them only.
"""

import ctypes
import functools
import logging

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxserve.cpu_kernels import paged_attention
from jaxserve.cpu_kernels.build import KernelUnavailable, build, cpu_flags

log = logging.getLogger(__name__)

ROWS, DEPTH = 16, 32  # a packed tile: 16 input pairs × 16 columns × 2 (linear.cc)
Q4_1_TILE = (20, 16)  # a Q4_1 tile's bytes: 16 columns' d and m (f16), 16 rows of pairs
INT8_FLAGS = ("avx512_vnni", "avx512vbmi")  # what int8 activations (passes 0) also need
# backend: (its FFI target, linear.cc's handler symbol, the CPU flags it runs on), in the
# order `auto` prefers them
KERNELS = {
    "amx": ("jaxserve_amx_linear", "JaxserveAmxLinear", ("amx_tile", "amx_bf16", "avx512_bf16")),
    "avx512_bf16": ("jaxserve_avx512_bf16_linear", "JaxserveAvx512Bf16Linear",
                    ("avx512f", "avx512bw", "avx512_bf16")),
}
# each backend's kernel for Q4_1 weights (pack_q4_1): its FFI target and linear.cc's symbol
Q4_1_KERNELS = {
    "amx": ("jaxserve_amx_q4_1_linear", "JaxserveAmxQ41Linear"),
    "avx512_bf16": ("jaxserve_avx512_bf16_q4_1_linear", "JaxserveAvx512Bf16Q41Linear"),
}
# each backend's kernel for LoRA slots' stacks (`slot_linear`): FFI target, linear.cc's symbol
SLOT_KERNELS = {
    "amx": ("jaxserve_amx_slot_linear", "JaxserveAmxSlotLinear"),
    "avx512_bf16": ("jaxserve_avx512_bf16_slot_linear", "JaxserveAvx512Bf16SlotLinear"),
}


def fits(in_features: int, out_features: int) -> bool:
    """Whether a [in, out] weight packs: whole tiles of 16 output columns (inputs are
    zero-padded to whole tiles)."""
    return in_features > 0 and out_features > 0 and out_features % 16 == 0


@functools.cache
def _library() -> ctypes.CDLL | None:
    """linear.cc, built (or found) and loaded once for every kernel in it; None (logged)
    where it cannot be built."""
    try:
        return ctypes.cdll.LoadLibrary(str(build("linear")))
    except (KernelUnavailable, OSError) as e:
        log.warning("the bf16 CPU kernels are unavailable, bf16 weights go through XLA: %s", e)
        return None


@functools.cache
def available(backend: str) -> bool:
    """This CPU runs `backend` (a key of KERNELS) and its kernel builds and registers;
    False (logged once) if not."""
    target, symbol, flags = KERNELS[backend]
    missing = [flag for flag in flags if flag not in cpu_flags().split()]
    if missing:
        log.info("no %s kernel for bf16 weights: the CPU lacks %s", backend, ", ".join(missing))
        return False
    library = _library()
    if library is None:
        return False
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                platform="cpu")
    for other_target, other_symbol in (Q4_1_KERNELS[backend], SLOT_KERNELS[backend]):
        jax.ffi.register_ffi_target(other_target,
                                    jax.ffi.pycapsule(getattr(library, other_symbol)),
                                    platform="cpu")
    job = paged_attention.prefetch_job()  # the next attention call's pages, fetched meanwhile
    if job is not None:
        library.JaxserveSetPrefetchJob(ctypes.c_void_p(job))
    return True


@functools.cache
def int8_available() -> bool:
    """Q4_1 weights can take int8 activations (`passes` 0) on this CPU (on either backend's
    kernel: both run linear.cc's AVX512-VNNI loop for them)."""
    flags = cpu_flags().split()
    return all(flag in flags for flag in INT8_FLAGS) and any(map(available, KERNELS))


def select(requested: str, weight_dtype: str, dtype: jnp.dtype, one_device: bool) -> str:
    """The linear backend to serve with: a kernel of KERNELS for bf16 projections and f32
    activations on one CPU device that runs it (`requested` "auto": the first of KERNELS
    that runs here), else "xla". Asking for a kernel where it cannot run is an error, not
    a silent fallback."""
    if requested == "xla":
        return "xla"
    why = None
    if weight_dtype != "bfloat16":
        why = f"it multiplies bf16 weights (--weight-dtype bf16), not {weight_dtype}"
    elif jnp.dtype(dtype) != jnp.float32:
        why = f"it takes f32 activations (--dtype float32), not {jnp.dtype(dtype).name}"
    elif not one_device:
        why = "it runs unsharded, on one device"
    elif jax.default_backend() != "cpu":
        why = f"it runs on the CPU, not {jax.default_backend()}"
    candidates = list(KERNELS) if requested == "auto" else [requested]
    if why is None:
        runs = [backend for backend in candidates if available(backend)]
        if runs:
            return runs[0]
        why = "; ".join(f"{b} needs {', '.join(KERNELS[b][2])} and its kernel built"
                        for b in candidates)
        why = f"this CPU lacks it ({why})"
    if requested != "auto":
        raise ValueError(f"--linear-backend {requested} cannot serve here: {why}")
    return "xla"


def pack(w: np.ndarray) -> np.ndarray:
    """w [..., in, out] (any float dtype) as the kernel reads it: its bf16 bits, uint16
    [..., out/16, ceil(in/32), 16, 32], each tile holding (input pair, column, member)."""
    *lead, k, n = w.shape
    if not fits(k, n):
        raise ValueError(f"a [{k}, {n}] weight does not pack: out must be a multiple of 16")
    k_blocks = -(-k // DEPTH)
    bits = np.zeros((*lead, k_blocks * DEPTH, n), np.uint16)
    bits[..., :k, :] = np.asarray(w).astype(ml_dtypes.bfloat16).view(np.uint16)
    # [..., kb, pair, member, nb, column] -> [..., nb, kb, pair, column, member]
    tiles = bits.reshape(*lead, k_blocks, ROWS, 2, n // 16, 16)
    order = tuple(range(len(lead)))
    tiles = tiles.transpose(*order, *(len(lead) + i for i in (3, 0, 1, 4, 2)))
    return np.ascontiguousarray(tiles).reshape(*lead, n // 16, k_blocks, ROWS, DEPTH)


def unpack(packed: np.ndarray, in_features: int) -> np.ndarray:
    """`pack`'s inverse: the f32 weight [..., in, out] that a packed one holds."""
    *lead, n_blocks, k_blocks, _, _ = packed.shape
    tiles = np.asarray(packed).reshape(*lead, n_blocks, k_blocks, ROWS, 16, 2)
    order = tuple(range(len(lead)))
    bits = tiles.transpose(*order, *(len(lead) + i for i in (1, 2, 4, 0, 3)))
    bits = np.ascontiguousarray(bits).reshape(*lead, k_blocks * DEPTH, n_blocks * 16)
    return bits[..., :in_features, :].view(ml_dtypes.bfloat16).astype(np.float32)


def pack_q4_1(blocks: np.ndarray) -> np.ndarray:
    """A weight's GGUF Q4_1 blocks, uint8 [..., out, in/32, 20] (per output row and block
    of 32 inputs: d and m as f16, then 16 bytes of quants, input i < 16 in byte i's low
    nibble and input i + 16 in its high one), as the kernel reads them: uint8 [..., out/16,
    in/32, 20, 16], each tile the 16 columns' d, their m, then a row of 16 bytes per input
    pair, the pair's first input in a byte's low nibble (linear.cc)."""
    *lead, n, k_blocks, size = blocks.shape
    if size != 20 or blocks.dtype != np.uint8 or n % 16:
        raise ValueError("not Q4_1 blocks of whole column tiles: "
                         f"{blocks.dtype}{list(blocks.shape)}")
    quants = blocks[..., 4:]
    q = np.concatenate([quants & 0xF, quants >> 4], axis=-1)  # [..., n, kb, 32] by input
    pairs = q[..., 0::2] | (q[..., 1::2] << 4)  # [..., n, kb, 16]

    def by_tile(a: np.ndarray) -> np.ndarray:  # [..., n, kb, w] -> [..., n/16, kb, 16, w]
        return np.moveaxis(a.reshape(*lead, n // 16, 16, k_blocks, a.shape[-1]), -3, -2)

    parts = [by_tile(blocks[..., 0:2]), by_tile(blocks[..., 2:4]),
             np.swapaxes(by_tile(pairs), -1, -2)]  # the quants' rows are input pairs
    tiles = np.concatenate([p.reshape(*lead, n // 16, k_blocks, -1) for p in parts], axis=-1)
    return np.ascontiguousarray(tiles).reshape(*lead, n // 16, k_blocks, *Q4_1_TILE)


def unpack_q4_1(packed: np.ndarray) -> np.ndarray:
    """`pack_q4_1`'s weight, dequantized as gguf does ((d * q) + m in f32): f32 [..., in,
    out]."""
    *lead, n_blocks, k_blocks, _, _ = packed.shape
    tiles = np.asarray(packed).reshape(*lead, n_blocks, k_blocks, -1)
    d = tiles[..., 0:32].copy().view(np.float16).astype(np.float32)  # [..., nb, kb, 16]
    m = tiles[..., 32:64].copy().view(np.float16).astype(np.float32)
    pairs = tiles[..., 64:].reshape(*lead, n_blocks, k_blocks, ROWS, 16)  # pair, column
    q = np.stack([pairs & 0xF, pairs >> 4], axis=-2).reshape(*lead, n_blocks, k_blocks,
                                                              DEPTH, 16).astype(np.float32)
    w = d[..., None, :] * q + m[..., None, :]  # [..., nb, kb, input, column]
    w = np.moveaxis(w, -4, -2)  # [..., kb, input, nb, column]
    return np.ascontiguousarray(w).reshape(*lead, k_blocks * DEPTH, n_blocks * 16)


def q8_reference(x: np.ndarray, packed: np.ndarray) -> np.ndarray:
    """What int8 activations (`passes` 0) compute for x [m, k] and one Q4_1 weight (`pack_q4_1`),
    in float64 from the same quantized values: each row's block of 32 inputs as d = max|x|
    / 127 and q = round(x / d) (to nearest even, in f32), then its remainder r = x - d * q
    (rounded once to f32) as d2 = max|r| / 127 and q2 = round(r / d2); s = d * sum(q) + d2
    * sum(q2); a column's block adds dw * (d * (q_w . q) + d2 * (q_w . q2)) + mw * s. The
    kernel sums the blocks in f32, so it agrees to f32 rounding."""
    n_blocks, k_blocks = packed.shape[:2]
    m, k = x.shape
    tiles = np.asarray(packed).reshape(n_blocks, k_blocks, -1)
    dw = tiles[..., 0:32].copy().view(np.float16).astype(np.float64)  # [nb, kb, 16]
    mw = tiles[..., 32:64].copy().view(np.float16).astype(np.float64)
    pairs = tiles[..., 64:].reshape(n_blocks, k_blocks, ROWS, 16)
    qw = np.stack([pairs & 0xF, pairs >> 4], axis=-2).reshape(n_blocks, k_blocks, DEPTH, 16)
    xb = np.zeros((m, k_blocks * DEPTH), np.float32)
    xb[:, :k] = x
    xb = xb.reshape(m, k_blocks, DEPTH)

    def quantized(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # d, q of each block
        d = np.abs(v).max(-1) / np.float32(127)
        inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
        return d, np.rint(v * inv[..., None])

    d, q = quantized(xb)
    remainder = (xb - d[..., None].astype(np.float64) * q).astype(np.float32)  # exact, rounded
    d2, q2 = quantized(remainder)
    s = d.astype(np.float64) * q.sum(-1) + d2.astype(np.float64) * q2.sum(-1)

    def dots(q: np.ndarray) -> np.ndarray:  # [m, kb, nb, 16]
        return np.einsum("rbi,nbic->rbnc", q.astype(np.float64), qw.astype(np.float64))

    scale = dw[None].transpose(0, 2, 1, 3)
    y = (dots(q) * d[:, :, None, None] + dots(q2) * d2[:, :, None, None]) * scale + (
        mw[None].transpose(0, 2, 1, 3) * s[:, :, None, None])
    return y.sum(1).reshape(m, n_blocks * 16)


def packed_linear(x: jax.Array, packed: jax.Array, layer: jax.Array | int | None = None,
                  backend: str = "amx", passes: int = 2, norm: jax.Array | None = None,
                  eps: float = 0.0, gated: bool = False, residual: jax.Array | None = None,
                  live: jax.Array | int | None = None) -> jax.Array:
    """x [..., in] (f32) @ the packed weight (one [n/16, k/32, 16, 32], or Q4_1's [n/16,
    k/32, 20, 16], or a stack of them with the `layer` to use) → f32 [..., out], on
    `backend`'s kernel (a key of KERNELS), with x rounded to bf16 (`passes` 1), not (2),
    or, for a Q4_1 weight on AVX512-VNNI, quantized to int8 per block of 32 (0). With
    `norm` (a weight [in]), x's rows are RMS-normalized first, in the kernel, with the
    bits models/layers.py's `rms_norm` gives them under XLA; `gated`, x is [..., 2 * in]
    (gate's columns, then up's) and the kernel multiplies silu(gate) * up, with the bits
    of layers.py's `swiglu` under XLA. `residual` (f32 [..., out]) is added to the
    product (`residual + x @ w`, XLA's bits). With `live` (i32[]), only x's first `live`
    rows are computed and the rest of y is zeros: a step's padding tokens, which follow
    its real ones."""
    if x.dtype != jnp.float32:
        raise ValueError(f"the {backend} kernel takes f32 activations, got {x.dtype}")
    q4_1 = packed.dtype == jnp.uint8  # pack_q4_1's tiles, else pack's
    tile = Q4_1_TILE if q4_1 else (ROWS, DEPTH)
    if packed.dtype not in (jnp.uint16, jnp.uint8) or packed.ndim not in (4, 5) or (
            packed.shape[-2:] != tile):
        raise ValueError(f"not a packed weight: {packed.dtype}{list(packed.shape)}")
    if packed.ndim == 4:
        packed, layer = packed[None], 0
    elif layer is None:
        raise ValueError("a packed layer stack needs the layer to read")
    if gated and (norm is not None or x.shape[-1] % 2):
        raise ValueError(f"a gated x is [..., 2 * in] (got {list(x.shape)}), without a norm")
    k = x.shape[-1] // 2 if gated else x.shape[-1]
    if not (packed.shape[2] - 1) * DEPTH < k <= packed.shape[2] * DEPTH:
        raise ValueError(f"x has {k} inputs; the weight takes {packed.shape[2] * DEPTH} (padded)")
    if passes not in (0, 1, 2):
        raise ValueError(f"passes must be 1 (x in bf16), 2 (x in f32) or 0 (x in int8), got "
                         f"{passes}")
    if passes == 0 and not q4_1:
        raise ValueError("int8 activations (passes 0) multiply Q4_1 weights only")
    if passes == 0 and not int8_available():
        raise RuntimeError(f"int8 activations need {', '.join(INT8_FLAGS)}, which this CPU lacks")
    if not available(backend):
        raise RuntimeError(f"the {backend} bf16 kernel is unavailable here (see the log)")
    if norm is not None and norm.shape != (k,):
        raise ValueError(f"the norm's weight is {list(norm.shape)}; x has {k} inputs")
    norm = jnp.zeros((0,), jnp.float32) if norm is None else norm.astype(jnp.float32)
    n = packed.shape[1] * 16
    if residual is not None and residual.shape != (*x.shape[:-1], n):
        raise ValueError(f"the residual is {list(residual.shape)}; the product "
                         f"{[*x.shape[:-1], n]}")
    residual = (jnp.zeros((0,), jnp.float32) if residual is None
                else residual.astype(jnp.float32).reshape(-1, n))
    live = jnp.zeros((0,), jnp.int32) if live is None else jnp.asarray(live, jnp.int32)[None]
    flat = x.reshape(-1, x.shape[-1])
    call = jax.ffi.ffi_call(Q4_1_KERNELS[backend][0] if q4_1 else KERNELS[backend][0],
                            jax.ShapeDtypeStruct((flat.shape[0], n), jnp.float32))
    y = call(flat, packed, jnp.asarray(layer, jnp.int32), norm, residual, live,
             passes=np.int32(passes),
             eps=np.float32(eps), gated=np.int32(gated))
    return y.reshape(*x.shape[:-1], n)


def slot_linear(x: jax.Array, packed: jax.Array, layer: jax.Array | int, slots: jax.Array,
                rank: int, by_inputs: bool, groups: int = 1, backend: str = "amx",
                passes: int = 2) -> jax.Array:
    """A LoRA slots' stack times x [m, in] (f32), each row by the part its slot (`slots`,
    i32[m], 1-based; 0: none, a row of zeros) owns, `rank` a slot: its inputs
    (`by_inputs`, a B stack, where x is zero outside them) or its columns in each of
    `groups` blocks side by side (an A stack; the row's other columns are zeros). The
    product by the whole stack, without the multiplies by other slots' parts (linear.cc's
    SlotLinear); `packed` is a layer stack of `pack`'s tiles, read at `layer`."""
    if x.dtype != jnp.float32 or x.ndim != 2 or slots.shape != x.shape[:1]:
        raise ValueError(f"slot_linear takes f32 x [m, in] and slots [m], got {x.dtype}"
                         f"{list(x.shape)} and {list(slots.shape)}")
    if packed.dtype != jnp.uint16 or packed.ndim != 5 or packed.shape[-2:] != (ROWS, DEPTH):
        raise ValueError(f"not a packed layer stack: {packed.dtype}{list(packed.shape)}")
    if passes not in (1, 2):
        raise ValueError(f"passes must be 1 (x in bf16) or 2 (x in f32), got {passes}")
    if not available(backend):
        raise RuntimeError(f"the {backend} bf16 kernel is unavailable here (see the log)")
    call = jax.ffi.ffi_call(SLOT_KERNELS[backend][0],
                            jax.ShapeDtypeStruct((x.shape[0], packed.shape[1] * 16), jnp.float32))
    return call(x, packed, jnp.asarray(layer, jnp.int32), slots.astype(jnp.int32),
                passes=np.int32(passes), rank=np.int32(rank), groups=np.int32(groups),
                by_inputs=np.int32(by_inputs))
