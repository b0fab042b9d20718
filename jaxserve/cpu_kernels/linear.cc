// y = x @ w for f32 activations and bf16 weights, f32 out, through XLA's FFI, on Intel AMX
// (JaxserveAmxLinear) or on AVX512-BF16 (JaxserveAvx512Bf16Linear: AMD Zen 4 and later,
// Intel Cooper Lake and later).
//
// XLA:CPU computes a bf16 dot in f32 (it converts the weight first, which made bf16
// weights 2.3x slower than f32 ones), so a bf16 weight never reached the CPU's bf16 units.
// Here the weight is packed once, at load, into AMX tiles (linear.py's `pack`): for every
// block of 16 output columns and 32 inputs, a 16 x 64-byte tile of (input pair, column,
// pair member), which `tdpbf16ps` takes as its B operand. A row of that tile is one input
// pair of 16 columns: the 512-bit operand `vdpbf16ps` takes, so both paths read one
// layout. Whole layer stacks are passed with a layer index, so a scanned model reads each
// layer's weights in place rather than copying its slice first (XLA's copies of the
// scan's weight slices were 40 % of an f32 decode step on a Zen 5).
//
// The activations are rounded to bf16 (`passes` 1: bf16 x times bf16 w, summed in f32, as
// vLLM's and oneDNN's bf16 matmuls and a TPU's default precision compute it), or not
// (`passes` 2): each block of x is split into hi = bf16(x) and lo = bf16(x - hi) and both
// are multiplied, so the result is x (to ~16 mantissa bits) times the bf16 weight, as
// XLA's weight-only path computes it. A decode step is bound by the weight bytes it
// streams, where the second product costs no extra weight traffic; a prefill is bound by
// the multiplies, where it doubles them (a 256-token SmolLM2 step on a Zen 5: 124 ms with
// one pass, 197 with two).
//
// On AMX, x is laid out as A tiles (each 1 KiB in a row) in line-aligned buffers, and two
// row blocks by two column blocks accumulate at a time where a prefill has them (each tile
// loaded feeds two multiplies). Measured on a Sapphire Rapids (2 cores): a tdpbf16ps fed
// from L1 takes ~6.5 ns, from L2 (a prefill's x and weights) ~15-18 ns; the rows that
// straddled two cache lines (a std::vector's 16-byte alignment) took ~1.4x as long.
//
// A projection also does the model's work around it that XLA did in fusions of its own:
// its input's RMSNorm or SwiGLU as x is split to bf16 (Prologue; Split runs over the pool)
// and the residual add as its columns are written (AddResidual), each with the bits XLA
// gives it, so the LoRA path, which computes them in XLA, reads and adds the same values.
// A 256-token prefill took ~15 % less time, a 16-row decode ~4 % (Intel Xeon).

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "prefetch_job.h"
#include "work_queue.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The library is built for the machine (-march=native); these parts also need AMX and
// AVX512-BF16, which linear.py checks the CPU for before it calls the kernel at all.
#define AMX __attribute__((target("amx-tile,amx-bf16")))
#define AVX512_BF16 __attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))

constexpr int64_t kRows = 16;         // rows of a tile (tokens of x; input pairs of w)
constexpr int64_t kCols = 16;         // f32 columns of an output tile
constexpr int64_t kDepth = 32;        // inputs a tile multiplies (16 bf16 pairs)
constexpr int64_t kTile = kRows * kDepth;  // bf16 values in an A or B tile (1 KiB)
constexpr int64_t kItemBlocks = 8;    // column blocks of an AMX work item (128 columns)
constexpr int64_t kOverlapBlocks = 2;  // x of at most this many row blocks: split beside widening
// AVX512-BF16: a register block of kVecRows rows x kVecBlocks column blocks (16 f32
// accumulators; 4 x 4 measured fastest of 4x4, 6x4 and 8x2 at SmolLM2's shapes), and a
// work item of that many column blocks, so a 576-column output makes 9 items for 2 cores.
constexpr int64_t kVecRows = 4;
constexpr int64_t kVecBlocks = 4;
// A decode batch of up to kStreamRows rows by a bf16 weight takes StreamBlocks, which
// prefetches the weights kAhead k blocks ahead (measured on a Zen 5: 2 and 4 alike, 8 no
// better than none; 64 rows gained nothing, 128 lost).
constexpr int64_t kStreamRows = 32;
constexpr int64_t kAhead = 2;

// Buffers on a cache line's boundary: AMX loads a tile a 64-byte row at a time, and rows
// that straddle two lines took ~1.4x as long (a 256-row prefill's gate/up, Sapphire Rapids).
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64}));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
};
template <typename T>
using AlignedVector = std::vector<T, LineAligned<T>>;

// A buffer of this thread's, grown to `size` and never shrunk (a 16-row decode step makes
// ~150 kernel calls, whose fresh buffers' allocation and zero-fill were ~1-2 % of it), its
// first `size` zeroed only when `zero` (padding that its writer leaves).
template <typename T>
T* Grown(AlignedVector<T>& buffer, size_t size, bool zero) {
  if (buffer.size() < size) buffer.resize(size);
  if (zero) std::fill_n(buffer.data(), size, T{0});
  return buffer.data();
}

// Tiles: 0-3 accumulate; then x's and the weights' tiles (Columns says which is which).
AMX void ConfigureTiles() {
  jaxserve::TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kRows;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// XLA:CPU's rsqrt of v, bit for bit: the hardware estimate (rsqrtss) refined by Newton
// steps whose multiply-adds are fused, for a positive normal v (or a NaN); the bare
// estimate otherwise (its emitter's choice, read from the assembly it writes). Two steps
// on Intel, one on AMD, whose SSE estimate is more accurate: XLA tells the two apart by
// SSE4a, which only AMD's CPUs have (xla/codegen/math/rsqrt.cc; with two steps on a Zen
// 4, a fifth of the rows' factors were an ulp off XLA's).
inline float XlaRsqrt(float v) {
  static const int steps = __builtin_cpu_supports("sse4a") ? 1 : 2;
  const float estimate = _mm_cvtss_f32(_mm_rsqrt_ss(_mm_set_ss(v)));
  if (!std::isnan(v) && !(std::isnormal(v) && v > 0)) return estimate;
  float y = estimate;
  for (int step = 0; step < steps; ++step)
    y = std::fma(y * -0.5f, std::fma(v * y, y, -1.0f), y);
  return y;
}

// Round to nearest, for the rounding intrinsics that keep the compiler from contracting
// a multiply into an add where XLA's bits are reproduced.
constexpr int kNear = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// The lanes of inputs [c, c + 16) that are below k.
inline __mmask16 Live(int64_t c, int64_t k) {
  return c >= k ? 0 : k - c >= kCols ? 0xffff : (1u << (k - c)) - 1;
}

// An RMSNorm (models/layers.py's `rms_norm`) that a projection applies to its input rows.
// Here it gives a row the bits XLA gives it, so a projection may take its norm here or
// before: the kernel's own (in XLA the norm was a fusion whose sum ran a scalar add at a
// time) and a LoRA adapter's terms (which read the normalized rows) agree.
struct RowNorm {
  const float* weight;  // [k]
  float eps;
  int64_t k;

  // 1 / sqrt(mean(row²) + eps) as XLA computes it: the squares summed by halving the row,
  // zero-padded to a power of two (`row_sum`'s order; a zero added leaves a sum's bits as
  // they are), its first halving a multiply-add (XLA contracts the lower half's squares
  // into their add to the upper half's rounded ones); the mean times k's f32 reciprocal
  // (XLA's form of a division by a constant), eps added in the same multiply-add; then
  // XLA's rsqrt. Rounding intrinsics keep the compiler from contracting anything else.
  AVX512_BF16 float Factor(const float* row) const {
    int64_t width = 1;
    while (width < k) width *= 2;
    thread_local AlignedVector<float> sums;
    float* s = Grown(sums, std::max<int64_t>(width, kCols), false);
    int64_t half = width / 2;
    for (int64_t c = 0; c < std::max<int64_t>(half, 1); c += kCols) {
      const __m512 lower = _mm512_maskz_loadu_ps(Live(c, k), row + c);
      const __m512 upper = _mm512_maskz_loadu_ps(half ? Live(c + half, k) : 0, row + c + half);
      _mm512_store_ps(s + c, _mm512_fmadd_round_ps(lower, lower,
                                                   _mm512_mul_round_ps(upper, upper, kNear), kNear));
    }
    for (half /= 2; half >= kCols; half /= 2)
      for (int64_t c = 0; c < half; c += kCols)
        _mm512_store_ps(s + c, _mm512_add_round_ps(_mm512_load_ps(s + c),
                                                   _mm512_load_ps(s + half + c), kNear));
    for (; half >= 1; half /= 2)
      for (int64_t c = 0; c < half; ++c) s[c] += s[half + c];
    // (one input: XLA drops the multiply by 1/1 and fuses the square into the add)
    return XlaRsqrt(k == 1 ? std::fma(row[0], row[0], eps)
                           : std::fma(s[0], 1.0f / static_cast<float>(k), eps));
  }

  // Inputs [c, c + 16) of a row whose Factor is `factor`, normalized: (x * factor) * weight.
  AVX512_BF16 __m512 Apply(__m512 x, float factor, int64_t c, __mmask16 live) const {
    return _mm512_mul_round_ps(_mm512_mul_round_ps(x, _mm512_set1_ps(factor), kNear),
                               _mm512_maskz_loadu_ps(live, weight + c), kNear);
  }
};

// SwiGLU's silu(gate) * up as XLA:CPU computes `jax.nn.silu(gate) * up`, bit for bit (so
// the down projection may take it here, as the kernel does, or from XLA, as a LoRA
// adapter's terms do): gate * 1 / (1 + exp(-gate)), exp by XLA's Cephes-style
// polynomial with the multiply-adds it contracts (read from the assembly it writes for
// that fusion), then times up. In XLA it was a fusion of ~6 % of a 256-token prefill.
AVX512_BF16 __m512 XlaSwiglu(__m512 gate, __m512 up) {
  auto splat = [](uint32_t bits) { return _mm512_castsi512_ps(_mm512_set1_epi32(bits)); };
  // -gate clamped (the operands in XLA's order: a NaN passes through)
  __m512 t = _mm512_xor_ps(gate, splat(0x80000000));
  t = _mm512_min_ps(_mm512_set1_ps(88.8f), _mm512_max_ps(_mm512_set1_ps(-87.8f), t));
  // exp(t) = 2^n * e^z, n = floor(t * log2(e) + 1/2) clamped, z = t - n * ln(2) in two parts
  __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(t, splat(0x3FB8AA3B), _mm512_set1_ps(0.5f)),
                                  _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  n = _mm512_min_ps(_mm512_set1_ps(127.0f), _mm512_max_ps(_mm512_set1_ps(-127.0f), n));
  __m512 z = _mm512_fmadd_ps(n, splat(0xBF318000), t);
  z = _mm512_fmadd_ps(n, splat(0x395E8083), z);
  __m512 y = _mm512_fmadd_ps(z, splat(0x39506967), splat(0x3AB743CE));
  for (const uint32_t c : {0x3C088908u, 0x3D2AA9C1u, 0x3E2AAAAAu, 0x3F000000u})
    y = _mm512_fmadd_ps(y, z, splat(c));
  const __m512 e_z = _mm512_add_round_ps(
      _mm512_fmadd_ps(y, _mm512_mul_round_ps(z, z, kNear), z), _mm512_set1_ps(1.0f), kNear);
  const __m512 two_n = _mm512_castsi512_ps(_mm512_add_epi32(
      _mm512_slli_epi32(_mm512_cvttps_epi32(n), 23), _mm512_set1_epi32(0x3F800000)));
  const __m512 sigmoid = _mm512_div_round_ps(
      _mm512_set1_ps(1.0f), _mm512_fmadd_ps(e_z, two_n, _mm512_set1_ps(1.0f)), kNear);
  return _mm512_mul_round_ps(up, _mm512_mul_round_ps(gate, sigmoid, kNear), kNear);
}

// What a projection does to its input rows first: an RMSNorm (`norm`), or SwiGLU
// (`gated`: a row is gate's k inputs, then up's), or nothing.
struct Prologue {
  const RowNorm* norm = nullptr;
  bool gated = false;

  bool any() const { return norm || gated; }
  // the per-row part (the norm's factor) of the row at `row`
  AVX512_BF16 float Begin(const float* row) const { return norm ? norm->Factor(row) : 1.0f; }
  // inputs [c, c + 16) of that row
  AVX512_BF16 __m512 Load(const float* row, float factor, int64_t c, int64_t k,
                          __mmask16 live) const {
    const __m512 v = _mm512_maskz_loadu_ps(live, row + c);
    if (norm) return norm->Apply(v, factor, c, live);
    if (gated) return XlaSwiglu(v, _mm512_maskz_loadu_ps(live, row + k + c));
    return v;
  }
};

// x's rows [m, k] (`stride` floats apart) through `prologue`, into `out` [m, k] (for the
// int8 path, which quantizes whole rows; the bf16 paths apply it as they Split).
AVX512_BF16 void Prepare(const float* x, int64_t m, int64_t k, int64_t stride,
                         const Prologue& prologue, float* out) {
  for (int64_t r = 0; r < m; ++r) {
    const float* row = x + r * stride;
    const float factor = prologue.Begin(row);
    for (int64_t c = 0; c < k; c += kCols) {
      const __mmask16 live = Live(c, k);
      _mm512_mask_storeu_ps(out + r * k + c, live, prologue.Load(row, factor, c, k, live));
    }
  }
}

// Split for one prologue (kNorm, kGated, or neither) and one part or two (kLo), so that
// its loop tests neither a vector at a time (in one function for all, a 256-token
// prefill's Splits spent ~1/4 of their samples on those tests and on lo's inputs where
// there was no lo).
template <bool kNorm, bool kGated, bool kLo>
AVX512_BF16 void SplitAs(const float* x, int64_t m, int64_t k, int64_t stride,
                         const int64_t* rows, int64_t depth, bool tiled, uint16_t* hi,
                         uint16_t* lo, const Prologue& prologue) {
  const int64_t k_blocks = depth / kDepth;
  for (int64_t r = 0; r < m; ++r) {
    const float* row = x + (rows ? rows[r] : r) * stride;
    float factor = 1.0f;
    if constexpr (kNorm) factor = prologue.norm->Factor(row);
    for (int64_t c = 0; c < k; c += 16) {
      const int64_t at = tiled ? ((r / kRows * k_blocks + c / kDepth) * kRows + r % kRows) *
                                         kDepth + c % kDepth
                               : r * depth + c;
      const __mmask16 live = Live(c, k);
      __m512 v = _mm512_maskz_loadu_ps(live, row + c);
      if constexpr (kNorm) v = prologue.norm->Apply(v, factor, c, live);
      if constexpr (kGated) v = XlaSwiglu(v, _mm512_maskz_loadu_ps(live, row + k + c));
      const __m256bh h = _mm512_cvtneps_pbh(v);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + at), reinterpret_cast<__m256i>(h));
      if constexpr (kLo) {
        const __m512 back = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(h)), 16));
        const __m256bh l = _mm512_cvtneps_pbh(_mm512_sub_ps(v, back));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + at), reinterpret_cast<__m256i>(l));
      }
    }
  }
}

// x [m, k] (rows `stride` floats apart; row r is x's row rows[r] where `rows` is given),
// through `prologue`, into bf16 hi and (unless `lo` is null) lo = bf16(x - hi), rows of
// `depth` (k rounded up to 32) whose padding, like the rows past m, the caller has zeroed;
// `tiled` lays them out as AMX's A tiles ([m/16, depth/32, 16, 32]: a tile loads 1 KiB
// in a row), else row-major [m, depth].
AVX512_BF16 void Split(const float* x, int64_t m, int64_t k, int64_t stride,
                       const int64_t* rows, int64_t depth, bool tiled, uint16_t* hi,
                       uint16_t* lo, const Prologue& prologue = {}) {
  const auto as = [&](auto norm, auto gated) {
    constexpr bool kNorm = decltype(norm)::value, kGated = decltype(gated)::value;
    if (lo) SplitAs<kNorm, kGated, true>(x, m, k, stride, rows, depth, tiled, hi, lo, prologue);
    else SplitAs<kNorm, kGated, false>(x, m, k, stride, rows, depth, tiled, hi, lo, prologue);
  };
  using Yes = std::true_type;
  using No = std::false_type;
  if (prologue.norm) as(Yes{}, No{});
  else if (prologue.gated) as(No{}, Yes{});
  else as(No{}, No{});
}

struct Problem {
  const uint16_t* x_hi;  // zero-padded [m_blocks * 16, k_blocks * 32] (AMX: as A tiles)
  const uint16_t* x_lo;  // null: one pass, x rounded to bf16
  const uint16_t* w;     // this layer's [n_blocks, w_stride, 16, 32], from its first k block
  float* y;              // [m, n]
  int64_t m, n, m_blocks, n_blocks, k_blocks;
  int64_t w_stride;      // w's k blocks per column block (k_blocks, unless a part of them)
  // the input pairs of each k block that AVX512-BF16's loops multiply (a LoRA slot's part
  // of a block: SlotLinear), else all
  int64_t pair0 = 0, pairs = kRows;
};

// Accumulator tile T into output rows [0, rows) at `out` (row stride n floats); a partial
// last row block lands in a spill buffer first. (A macro: a tile is named by an immediate.)
#define STORE_TILE(T, out, rows, n)                                              \
  do {                                                                           \
    if ((rows) == kRows) {                                                       \
      _tile_stored(T, out, (n) * sizeof(float));                                 \
    } else {                                                                     \
      alignas(64) float spill[kRows * kCols];                                    \
      _tile_stored(T, spill, kCols * sizeof(float));                             \
      for (int64_t r = 0; r < (rows); ++r)                                       \
        std::memcpy((out) + r * (n), spill + r * kCols, kCols * sizeof(float));  \
    }                                                                            \
  } while (0)

// Output columns [16 * b0, 16 * b1) for every row. Two row blocks by two column blocks at a
// time where there are (one pass: tiles 0-3 accumulate, 4-5 hold x, 6-7 the weights), so
// each tile loaded feeds two multiplies; else one row block by up to two column blocks
// (tiles 0-1 accumulate, 4-5 hold x's hi and lo, 6-7 the weights).
AMX void Columns(const Problem& p, int64_t b0, int64_t b1) {
  const int64_t depth = p.k_blocks * kDepth;  // x's A tiles: a row block's are depth * 16
  for (int64_t b = b0; b < b1; b += 2) {
    const bool pair = b + 1 < b1;
    const uint16_t* w0 = p.w + b * p.w_stride * kTile;
    const uint16_t* w1 = w0 + p.w_stride * kTile;
    int64_t mb = 0;
    for (; pair && !p.x_lo && mb + 1 < p.m_blocks; mb += 2) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const uint16_t* x0 = p.x_hi + mb * kRows * depth;
      const uint16_t* x1 = x0 + kRows * depth;
      for (int64_t kb = 0; kb < p.k_blocks; ++kb) {
        _tile_loadd(4, x0 + kb * kTile, 64);
        _tile_loadd(6, w0 + kb * kTile, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, w1 + kb * kTile, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, x1 + kb * kTile, 64);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      float* out = p.y + mb * kRows * p.n + b * kCols;
      const int64_t rows = std::min(kRows, p.m - (mb + 1) * kRows);
      STORE_TILE(0, out, kRows, p.n);
      STORE_TILE(1, out + kCols, kRows, p.n);
      STORE_TILE(2, out + kRows * p.n, rows, p.n);
      STORE_TILE(3, out + kRows * p.n + kCols, rows, p.n);
    }
    for (; mb < p.m_blocks; ++mb) {
      _tile_zero(0);
      _tile_zero(1);
      const uint16_t* hi = p.x_hi + mb * kRows * depth;
      const uint16_t* lo = p.x_lo ? p.x_lo + mb * kRows * depth : nullptr;
      for (int64_t kb = 0; kb < p.k_blocks; ++kb) {
        _tile_loadd(4, hi + kb * kTile, 64);
        if (lo) _tile_loadd(5, lo + kb * kTile, 64);
        _tile_loadd(6, w0 + kb * kTile, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (lo) _tile_dpbf16ps(0, 5, 6);
        if (pair) {
          _tile_loadd(7, w1 + kb * kTile, 64);
          _tile_dpbf16ps(1, 4, 7);
          if (lo) _tile_dpbf16ps(1, 5, 7);
        }
      }
      float* out = p.y + mb * kRows * p.n + b * kCols;
      const int64_t rows = std::min(kRows, p.m - mb * kRows);
      STORE_TILE(0, out, rows, p.n);
      if (pair) STORE_TILE(1, out + kCols, rows, p.n);
    }
  }
}

// One input pair `pair` of k block `kb`: acc[r][c] += x_hi[r] . w (+ x_lo[r] . w with kLo)
// for R rows of x (from `row`) and the C column blocks of w from `w`, each pair of x
// broadcast to the 16 lanes that `vdpbf16ps` multiplies by a row of a tile. VecBlock and
// StreamBlocks both take this step, so they sum the same products in the same order.
template <int R, int C, bool kLo>
AVX512_BF16 inline __attribute__((always_inline)) void MultiplyPair(
    const Problem& p, __m512 (&acc)[R][C], const uint16_t* w, int64_t row, int64_t kb,
    int64_t pair) {
  const int64_t depth = p.k_blocks * kDepth, at = kb * kDepth + 2 * pair;
  __m512bh wv[C];
  for (int c = 0; c < C; ++c)
    wv[c] = reinterpret_cast<__m512bh>(
        _mm512_loadu_si512(w + (c * p.w_stride + kb) * kTile + pair * kDepth));
  for (int r = 0; r < R; ++r) {
    int32_t h;
    std::memcpy(&h, p.x_hi + (row + r) * depth + at, sizeof h);
    const __m512bh xh = reinterpret_cast<__m512bh>(_mm512_set1_epi32(h));
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xh, wv[c]);
    if constexpr (kLo) {
      int32_t l;
      std::memcpy(&l, p.x_lo + (row + r) * depth + at, sizeof l);
      const __m512bh xl = reinterpret_cast<__m512bh>(_mm512_set1_epi32(l));
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xl, wv[c]);
    }
  }
}

// Rows [0, R) (of a block whose rows past `rows` hold zeros) times column blocks
// [b, b + C), over every k block (MultiplyPair).
// kPairs: only p's pair range of each k block (a LoRA slot's B), else every pair (a
// branch between the two in the loop made a 256-token prefill ~6 % slower on a Zen 5).
template <int R, int C, bool kLo, bool kPairs>
AVX512_BF16 void VecBlock(const Problem& p, int64_t row, int64_t b, int64_t rows) {
  const uint16_t* w = p.w + b * p.w_stride * kTile;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < p.k_blocks; ++kb) {
    if constexpr (kPairs) {
      for (int64_t pair = p.pair0; pair < p.pair0 + p.pairs; ++pair)
        MultiplyPair<R, C, kLo>(p, acc, w, row, kb, pair);
    } else {
      for (int64_t pair = 0; pair < kRows; ++pair)
        MultiplyPair<R, C, kLo>(p, acc, w, row, kb, pair);
    }
  }
  for (int64_t r = 0; r < std::min<int64_t>(R, rows); ++r)
    for (int c = 0; c < C; ++c)
      _mm512_storeu_ps(p.y + (row + r) * p.n + (b + c) * kCols, acc[r][c]);
}

// Output columns [16 * b0, 16 * b1) for every row, on AVX512-BF16. A lone last row takes
// a one-row block (a decode of one sequence computes no padding rows). Column blocks past
// the last whole kVecBlocks (a LoRA slot's few: SlotLinear) take kTallRows rows at a time,
// as kVecRows rows by one block keep only 4 accumulators (measured on a Zen 5: a 256-token
// prefill's A products, 16-column runs, 11.3 ms instead of 12.3).
constexpr int64_t kTallRows = 16;

template <bool kLo, bool kPairs>
AVX512_BF16 void VecColumns(const Problem& p, int64_t b0, int64_t b1) {
  const int64_t whole = b0 + (b1 - b0) / kVecBlocks * kVecBlocks;
  for (int64_t row = 0; row < p.m; row += kVecRows) {
    const int64_t rows = p.m - row;
    for (int64_t b = b0; b < whole; b += kVecBlocks) {
      if (rows == 1) VecBlock<1, kVecBlocks, kLo, kPairs>(p, row, b, rows);
      else VecBlock<kVecRows, kVecBlocks, kLo, kPairs>(p, row, b, rows);
    }
  }
  for (int64_t b = whole; b < b1; ++b)
    for (int64_t row = 0; row < p.m; row += kTallRows) {
      const int64_t rows = p.m - row;
      if (rows == 1) VecBlock<1, 1, kLo, kPairs>(p, row, b, rows);
      else if (rows <= kVecRows) VecBlock<kVecRows, 1, kLo, kPairs>(p, row, b, rows);
      else VecBlock<kTallRows, 1, kLo, kPairs>(p, row, b, rows);
    }
}

// The attention kernel's list of the KV pages its next call reads (prefetch_job.h; set by
// JaxserveSetPrefetchJob), of which a decode's loops fetch some as they go: StreamBlocks
// kJobPages at each k block, WidenQ41 one every kJobTiles tiles (the same rate for an item
// of 4 column blocks). 16 rows at context 512 publish up to 3,072 pages a layer, and a
// layer's projections run ~1,700 k blocks (one page a block fetched ~56 % of them: a
// decode step 0.92x as long with the pages scattered; two, all: 0.89x).
jaxserve::PrefetchJob* prefetch_job = nullptr;
constexpr int kJobPages = 2;
constexpr int64_t kJobTiles = 2;

// A decode batch (a few row blocks) by a bf16 weight (the head; Q4_1 weights are widened
// into L2 first and take VecColumns): VecColumns would stream an item's weights from
// memory for its first row block and multiply them from cache for the others, one phase
// after the other. Here each k block of the item is multiplied into every row block while
// it is in L1 (the accumulators wait in `acc` between k blocks), so the memory stream runs
// beside the multiplies. The same products, summed in the same order. Beside them, each k
// block fetches a few of the KV pages the next attention call will read (prefetch_job).
template <int C, bool kLo>
AVX512_BF16 void StreamBlocks(const Problem& p, int64_t b) {
  alignas(64) float acc[kStreamRows][C][kCols];
  const int64_t row_blocks = (p.m + kVecRows - 1) / kVecRows;  // rows past m hold zeros
  const uint16_t* w = p.w + b * p.w_stride * kTile;
  if (prefetch_job) prefetch_job->Want();
  const int64_t depth = p.k_blocks * kDepth;
  for (int64_t kb = 0; kb < p.k_blocks; ++kb) {
    if (prefetch_job)
      for (int i = 0; i < kJobPages; ++i) prefetch_job->Step();
    // the next k block's x, a line a row: a decode's rows are k_blocks lines apart, too
    // many streams for the hardware's prefetcher, and their broadcasts waited on L2
    // (a 16-row decode step 0.98x, Zen 4)
    if (kb + 1 < p.k_blocks)
      for (int64_t r = 0; r < p.m; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(p.x_hi + r * depth + (kb + 1) * kDepth),
                     _MM_HINT_T0);
    for (int64_t rb = 0; rb < row_blocks; ++rb) {
      const int64_t row = rb * kVecRows;
      __m512 a[kVecRows][C];
      for (int r = 0; r < kVecRows; ++r)
        for (int c = 0; c < C; ++c)
          a[r][c] = kb ? _mm512_load_ps(acc[row + r][c]) : _mm512_setzero_ps();
      const auto multiply = [&](int64_t pair) AVX512_BF16 __attribute__((always_inline)) {
        if (rb == 0)
          for (int c = 0; c < C; ++c) {
            const uint16_t* ahead = w + (c * p.w_stride + kb) * kTile + pair * kDepth;
            _mm_prefetch(reinterpret_cast<const char*>(ahead + kAhead * kTile), _MM_HINT_T0);
            // and into L2 as far again ahead: more lines in flight than L1's misses can
            // track (the head, 56.6 MB at 16 rows: a decode step 0.992x, Zen 4)
            _mm_prefetch(reinterpret_cast<const char*>(ahead + 2 * kAhead * kTile), _MM_HINT_T1);
          }
        MultiplyPair<kVecRows, C, kLo>(p, a, w, row, kb, pair);
      };
      if (p.pairs == kRows)  // a constant trip count, as in VecBlock
        for (int64_t pair = 0; pair < kRows; ++pair) multiply(pair);
      else
        for (int64_t pair = p.pair0; pair < p.pair0 + p.pairs; ++pair) multiply(pair);
      for (int r = 0; r < kVecRows; ++r)
        for (int c = 0; c < C; ++c) _mm512_store_ps(acc[row + r][c], a[r][c]);
    }
  }
  for (int64_t r = 0; r < p.m; ++r)
    for (int c = 0; c < C; ++c)
      std::memcpy(p.y + r * p.n + (b + c) * kCols, acc[r][c], kCols * sizeof(float));
}

// Output columns [16 * b0, 16 * b1) for every row of a decode batch (StreamBlocks).
template <bool kLo>
AVX512_BF16 void StreamColumns(const Problem& p, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1;) {
    if (b1 - b >= kVecBlocks) {
      StreamBlocks<kVecBlocks, kLo>(p, b);
      b += kVecBlocks;
    } else {
      StreamBlocks<1, kLo>(p, b);
      ++b;
    }
  }
}

// A Q4_1 tile (linear.py's `pack_q4_1`): the same 16 columns x 32 inputs as a bf16 tile,
// in 320 bytes instead of 1024. A column's 32 inputs are one Q4_1 block of a GGUF file:
// w = d * q + m, q in [0, 15]. Bytes [0, 32): the 16 columns' d (f16); [32, 64): their m;
// then one row of 16 bytes per input pair, a byte per column, the pair's first input in
// its low nibble and the second in its high one.
constexpr int64_t kQ4Scales = 64;
constexpr int64_t kQ4Tile = kQ4Scales + kRows * kCols;
constexpr int64_t kQ4Ahead = 16;  // tiles a widening prefetches ahead

// Column blocks [0, blocks) of `w` (Q4_1 tiles from this item's first) widened into bf16
// tiles at `out` ([blocks, k_blocks, kTile]), which the multiplies then read as they read
// a packed bf16 weight: d * q + m rounded once to f32 (a fused multiply-add of exact
// operands, as gguf's dequantize computes (d * q) + m, d * q being exact), then to bf16
// to nearest even, as `pack` rounds. So a Q4_1 weight multiplies exactly as the bf16
// packing of its dequantized values does, from under a third of the bytes.
AVX512_BF16 void WidenQ41(const uint8_t* w, int64_t tiles, uint16_t* out, bool fetch_pages) {
  alignas(64) static constexpr int16_t kInterleave[32] = {
      0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  const __m512i low = _mm512_set1_epi32(0xf);
  for (int64_t t = 0; t < tiles; ++t, w += kQ4Tile, out += kTile) {
    if (fetch_pages && t % kJobTiles == 0) prefetch_job->Step();
    for (int64_t line = 0; line < kQ4Tile; line += 64)  // the stream runs ahead of the widening
      _mm_prefetch(reinterpret_cast<const char*>(w + kQ4Ahead * kQ4Tile + line), _MM_HINT_T0);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
    const __m512 m =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32)));
    for (int64_t pair = 0; pair < kRows; ++pair) {
      const __m512i q = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + kQ4Scales + pair * kCols)));
      const __m512 first = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(q, low)), m);
      const __m512 second = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), m);
      // [first's 16 | second's 16] as bf16, then (column, member) pairs
      const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(second, first));
      _mm512_storeu_si512(out + pair * kDepth, _mm512_permutexvar_epi16(interleave, both));
    }
  }
}

// Column blocks [b0, b1) of a Q4_1 weight widened (WidenQ41) into this thread's buffer:
// the sub-problem whose weight is the buffer and whose output starts at column block b0,
// which the bf16 loops (AMX's or AVX512-BF16's) then multiply as a packed bf16 weight.
// With `fetch_pages` (AVX512-BF16's decode batches), the widening also fetches KV pages
// for the next attention call (prefetch_job).
// (Widening each k block into L1 just before its multiplies, as StreamBlocks reads a bf16
// weight, measured 1.1-1.2x the time of this on a Zen 5: its prefetches did not keep ahead
// of it. Widening each pair in a register, multiplied at once into 16 rows, ~1.04x on a
// Zen 4: a broadcast of x for every multiply instead of every 4 cost more than the store.)
AVX512_BF16 Problem Widened(const Problem& p, const uint8_t* w, int64_t b0, int64_t b1,
                            bool fetch_pages) {
  // (a buffer resized to each item's size zero-filled what WidenQ41 then overwrites, as
  // projections of other depths took turns on a thread: 1.4 % of a 16-row decode step)
  thread_local AlignedVector<uint16_t> widened;
  uint16_t* out = Grown(widened, (b1 - b0) * p.k_blocks * kTile, false);
  fetch_pages = fetch_pages && prefetch_job;
  if (fetch_pages) prefetch_job->Want();
  WidenQ41(w + b0 * p.k_blocks * kQ4Tile, (b1 - b0) * p.k_blocks, out, fetch_pages);
  Problem part = p;
  part.w = out;
  part.w_stride = p.k_blocks;
  part.y = p.y + b0 * kCols;
  part.n_blocks = b1 - b0;
  return part;
}

// Output columns [16 * b0, 16 * b1) of a bf16 weight on AVX512-BF16: a decode batch's
// rows by StreamColumns, others by VecColumns. A weight already `cached` (a widened Q4_1
// item, in L2 for every row block) takes VecColumns for a decode batch too, whose
// accumulators stay in registers over all k blocks (StreamBlocks' ~0.87x of the bf16
// units' rate, in cache, is for a weight streamed from memory; a 16-row decode step 0.95x,
// Zen 4).
AVX512_BF16 void Bf16Columns(const Problem& p, int64_t b0, int64_t b1, bool cached = false) {
  const bool stream = !cached && p.m > kVecRows && p.m <= kStreamRows;
  if (stream && p.x_lo) StreamColumns<true>(p, b0, b1);
  else if (stream) StreamColumns<false>(p, b0, b1);
  else if (p.pairs != kRows && p.x_lo) VecColumns<true, true>(p, b0, b1);
  else if (p.pairs != kRows) VecColumns<false, true>(p, b0, b1);
  else if (p.x_lo) VecColumns<true, false>(p, b0, b1);
  else VecColumns<false, false>(p, b0, b1);
}

// int8 activations (`passes` 0) against Q4_1 weights, on AVX512-VNNI. Each row's block of
// 32 inputs is quantized in two int8 terms, x ~ d * q + d2 * q2: q as llama.cpp quantizes
// a Q4_1 file's activations (d = max|x| / 127, q = round(x / d) to nearest even), q2 the
// same of the remainder x - d * q (one rounding), so a block's error is at most
// max|x| / 64,516. One term (llama.cpp's, max|x| / 254) took SmolLM2's greedy tokens off
// f32's within 14-30 of 32 on 4 of 5 reference prompts; two terms kept all 32, closer to
// f32 than bf16 activations, with Q4_1's own weight values where bf16's paths round them.
// s = d * sum(q) + d2 * sum(q2); a column's block then adds dw * (d * (q_w . q) + d2 *
// (q_w . q2)) + mw * s, the integer dot products exact (`vpdpbusd`: the weight's nibbles
// as u8 times x's int8, four products a lane). The nibbles need no widening to bf16, and
// a vpdpbusd does 64 products where a vdpbf16ps does 32: the second term costs ~7 % of a
// 16-row decode step over one (Intel Xeon).
#define AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")))

struct Int8Rows {
  const int8_t* q;   // [rows, k_blocks * 32]: each 8 inputs' even ones, then their odd ones
  const float* d;    // [rows, k_blocks]
  const int8_t* q2;  // the remainder's term, laid out as q
  const float* d2;
  const float* s;    // [rows, k_blocks]: d * the sum of the block's q + d2 * that of q2
  int64_t k_blocks;
};

// The largest |value| of a block's two halves.
AVX512_VNNI inline float AbsMax(__m512 a, __m512 b) {
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
}

// round(v / d) to nearest even, as int32 (d 0: zeros).
AVX512_VNNI inline __m512i Quantize(__m512 v, float d) {
  return _mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f)));
}

// A term's two halves stored as 32 int8 at `dst` in `order`; the sum of its values.
AVX512_VNNI inline int32_t StoreTerm(__m512i lo, __m512i hi, __m256i order, int8_t* dst) {
  const __m256i bytes = _mm256_set_m128i(_mm512_cvtepi32_epi8(hi), _mm512_cvtepi32_epi8(lo));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permutexvar_epi8(order, bytes));
  return _mm512_reduce_add_epi32(_mm512_add_epi32(lo, hi));
}

// x [m, k] quantized per row and block of 32 inputs in two terms (Int8Rows); inputs past k
// are zeros.
AVX512_VNNI void QuantizeRows(const float* x, int64_t m, int64_t k, int64_t k_blocks,
                              int8_t* q, float* d, int8_t* q2, float* d2, float* s) {
  // within 8 inputs, the evens (bytes 0-3) then the odds (4-7), as a Q4_1 tile's pair
  // rows hold them: four pair rows' low nibbles are inputs 0, 2, 4, 6
  alignas(32) static constexpr int8_t kOrder[32] = {
      0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15,
      16, 18, 20, 22, 17, 19, 21, 23, 24, 26, 28, 30, 25, 27, 29, 31};
  const __m256i order = _mm256_load_si256(reinterpret_cast<const __m256i*>(kOrder));
  for (int64_t r = 0; r < m; ++r)
    for (int64_t kb = 0; kb < k_blocks; ++kb) {
      const int64_t c = kb * kDepth;
      const __m512 v0 = _mm512_maskz_loadu_ps(Live(c, k), x + r * k + c);
      const __m512 v1 = _mm512_maskz_loadu_ps(Live(c + 16, k), x + r * k + c + 16);
      // an inf or NaN input (x * 0 is NaN) makes the block's scale NaN: non-finite in, out
      const __m512 zero = _mm512_setzero_ps();
      const bool finite = !(_mm512_cmp_ps_mask(_mm512_mul_ps(v0, zero), zero, _CMP_NEQ_UQ) |
                            _mm512_cmp_ps_mask(_mm512_mul_ps(v1, zero), zero, _CMP_NEQ_UQ));
      const int64_t at = (r * k_blocks + kb) * kDepth;
      const float dd = finite ? AbsMax(v0, v1) / 127.0f : std::numeric_limits<float>::quiet_NaN();
      const float scale = finite ? dd : 0.0f;  // a non-finite block's q: zeros
      const __m512i q0 = Quantize(v0, scale), q1 = Quantize(v1, scale);
      // the remainders x - d * q, rounded once (a fused multiply-add)
      const __m512 r0 = _mm512_fnmadd_ps(_mm512_set1_ps(scale), _mm512_cvtepi32_ps(q0), v0);
      const __m512 r1 = _mm512_fnmadd_ps(_mm512_set1_ps(scale), _mm512_cvtepi32_ps(q1), v1);
      const float dd2 = finite ? AbsMax(r0, r1) / 127.0f : 0.0f;
      const __m512i p0 = Quantize(r0, dd2), p1 = Quantize(r1, dd2);
      const int32_t sum = StoreTerm(q0, q1, order, q + at);
      const int32_t sum2 = StoreTerm(p0, p1, order, q2 + at);
      d[r * k_blocks + kb] = dd;
      d2[r * k_blocks + kb] = dd2;
      s[r * k_blocks + kb] = dd * static_cast<float>(sum) + dd2 * static_cast<float>(sum2);
    }
}

// Rows [row, row + R) times column blocks [b, b + C) of a Q4_1 weight, int8 activations.
template <int R, int C>
AVX512_VNNI void Int8Block(const Problem& p, const Int8Rows& x, const uint8_t* w, int64_t row,
                         int64_t b, int64_t rows) {
  // a pair-row group's 64 bytes (4 pair rows x 16 columns) turned into a column a lane:
  // byte 4c + j of the result is byte 16j + c
  alignas(64) static constexpr uint8_t kGather[64] = {
      0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51,
      4, 20, 36, 52, 5, 21, 37, 53, 6, 22, 38, 54, 7, 23, 39, 55,
      8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59,
      12, 28, 44, 60, 13, 29, 45, 61, 14, 30, 46, 62, 15, 31, 47, 63};
  const __m512i gather = _mm512_load_si512(kGather);
  const __m512i low = _mm512_set1_epi8(0xf);
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t kbs = x.k_blocks;
  for (int64_t kb = 0; kb < kbs; ++kb) {
    const uint8_t* t[C];
    for (int c = 0; c < C; ++c) {
      t[c] = w + ((b + c) * kbs + kb) * kQ4Tile;
      for (int64_t line = 0; line < kQ4Tile; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(t[c] + kQ4Ahead * kQ4Tile + line), _MM_HINT_T0);
    }
    __m512i dot[R][C], dot2[R][C];  // x's two terms
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) dot[r][c] = dot2[r][c] = _mm512_setzero_si512();
    for (int g = 0; g < 4; ++g) {
      __m512i lo[C], hi[C];
      for (int c = 0; c < C; ++c) {
        const __m512i raw = _mm512_permutexvar_epi8(
            gather, _mm512_loadu_si512(t[c] + kQ4Scales + 64 * g));
        lo[c] = _mm512_and_si512(raw, low);
        hi[c] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
      }
      for (int r = 0; r < R; ++r) {
        const int64_t at = ((row + r) * kbs + kb) * kDepth + 8 * g;
        int32_t evens, odds, evens2, odds2;
        std::memcpy(&evens, x.q + at, 4);
        std::memcpy(&odds, x.q + at + 4, 4);
        std::memcpy(&evens2, x.q2 + at, 4);
        std::memcpy(&odds2, x.q2 + at + 4, 4);
        const __m512i a = _mm512_set1_epi32(evens), o = _mm512_set1_epi32(odds);
        const __m512i a2 = _mm512_set1_epi32(evens2), o2 = _mm512_set1_epi32(odds2);
        for (int c = 0; c < C; ++c) {
          dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], lo[c], a);
          dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], hi[c], o);
          dot2[r][c] = _mm512_dpbusd_epi32(dot2[r][c], lo[c], a2);
          dot2[r][c] = _mm512_dpbusd_epi32(dot2[r][c], hi[c], o2);
        }
      }
    }
    __m512 dw[C], mw[C];
    for (int c = 0; c < C; ++c) {
      dw[c] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t[c])));
      mw[c] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t[c] + 32)));
    }
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(x.d[(row + r) * kbs + kb]);
      const __m512 dx2 = _mm512_set1_ps(x.d2[(row + r) * kbs + kb]);
      const __m512 sx = _mm512_set1_ps(x.s[(row + r) * kbs + kb]);
      for (int c = 0; c < C; ++c) {
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][c]), _mm512_mul_ps(dw[c], dx), acc[r][c]);
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot2[r][c]), _mm512_mul_ps(dw[c], dx2),
                                    acc[r][c]);
        acc[r][c] = _mm512_fmadd_ps(mw[c], sx, acc[r][c]);
      }
    }
  }
  for (int64_t r = 0; r < std::min<int64_t>(R, rows); ++r)
    for (int c = 0; c < C; ++c)
      _mm512_storeu_ps(p.y + (row + r) * p.n + (b + c) * kCols, acc[r][c]);
}

// Output columns [16 * b0, 16 * b1) for every row, int8 activations: register blocks of
// kVecRows rows x kInt8Blocks column blocks (16 int32 dot products and 16 f32 sums; 2 x 4
// measured alike on a Zen 5), a lone last row in a one-row block.
constexpr int64_t kInt8Blocks = 2;

AVX512_VNNI void Int8Columns(const Problem& p, const Int8Rows& x, const uint8_t* w, int64_t b0,
                           int64_t b1) {
  for (int64_t row = 0; row < p.m; row += kVecRows) {
    const int64_t rows = p.m - row;
    for (int64_t b = b0; b < b1;) {
      const bool whole = b1 - b >= kInt8Blocks;
      if (whole && rows == 1) Int8Block<1, kInt8Blocks>(p, x, w, row, b, rows);
      else if (whole) Int8Block<kVecRows, kInt8Blocks>(p, x, w, row, b, rows);
      else if (rows == 1) Int8Block<1, 1>(p, x, w, row, b, rows);
      else Int8Block<kVecRows, 1>(p, x, w, row, b, rows);
      b += whole ? kInt8Blocks : 1;
    }
  }
}

// y's columns [16 * b0, 16 * b1) of every row plus `residual`'s (a residual stream, [m, n]),
// once a work item has written them (still in cache): the model's x + o, and x + down,
// with the bits XLA's add gives (in XLA they were separate passes over the stream).
AVX512_BF16 void AddResidual(const float* residual, float* y, int64_t m, int64_t n, int64_t b0,
                             int64_t b1) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = b0 * kCols; c < b1 * kCols; c += kCols)
      _mm512_storeu_ps(y + r * n + c, _mm512_add_ps(_mm512_loadu_ps(y + r * n + c),
                                                    _mm512_loadu_ps(residual + r * n + c)));
}

// Claims work items (runs of column blocks) from `next` until none is left (RunOnPool);
// returns how many it ran. A Q4_1 weight (`w8` not null) is widened an item at a time
// (Widened), before the item waits for x (`x_ready`, when the caller is still writing
// it). A thread's tiles are configured at its first item only.
AMX int64_t DrainColumns(const Problem& p, const uint8_t* w8, const float* residual,
                         const std::atomic<bool>* x_ready, std::atomic<int64_t>& next,
                         int64_t items) {
  int64_t finished = 0;
  for (int64_t i = next.fetch_add(1); i < items; i = next.fetch_add(1)) {
    if (!finished) ConfigureTiles();
    const int64_t b0 = i * kItemBlocks, b1 = std::min(p.n_blocks, b0 + kItemBlocks);
    const Problem part = w8 ? Widened(p, w8, b0, b1, false) : p;
    jaxserve::AwaitFlag(x_ready);
    if (w8) Columns(part, 0, b1 - b0);
    else Columns(p, b0, b1);
    if (residual) AddResidual(residual, p.y, p.m, p.n, b0, b1);
    ++finished;
  }
  if (finished) _tile_release();
  return finished;
}

enum class Isa { kAmx, kAvx512Bf16 };

template <Isa isa, ffi::DataType kWeight>
ffi::Error Linear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<kWeight> w,
                  ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::F32> norm,
                  ffi::Buffer<ffi::F32> residual, ffi::Buffer<ffi::S32> live,
                  ffi::ResultBuffer<ffi::F32> y, int32_t passes, float eps, int32_t gated) {
  constexpr bool kQ41 = kWeight == ffi::U8;  // Q4_1 tiles, else bf16 ones
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 5 ||
      (kQ41 ? wd[3] != kQ4Tile / kCols || wd[4] != kCols : wd[3] != kRows || wd[4] != kDepth))
    return ffi::Error::InvalidArgument(
        kQ41 ? "q4_1 linear: x must be [m, k], w [layers, n/16, k/32, 20, 16] (bytes)"
             : "packed linear: x must be [m, k], w [layers, n/16, k/32, 16, 32]");
  if (gated && (xd.size() != 2 || xd[1] % 2 || norm.element_count()))
    return ffi::Error::InvalidArgument("packed linear: a gated x is [m, 2k], without a norm");
  // x's rows: k inputs (gated: gate's k, then up's)
  const int64_t rows = xd[0], k = gated ? xd[1] / 2 : xd[1], stride = xd[1];
  const int64_t n_blocks = wd[1], k_blocks = wd[2];
  if (k > k_blocks * kDepth || k <= (k_blocks - 1) * kDepth)
    return ffi::Error::InvalidArgument("packed linear: x's inputs do not match w's");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("packed linear: layer out of range");
  if (passes != 1 && passes != 2 && !(kQ41 && passes == 0))
    return ffi::Error::InvalidArgument("packed linear: passes must be 1 or 2 (or 0, Q4_1 only)");
  if (isa == Isa::kAmx && !jaxserve::RequestAmx())
    return ffi::Error::Internal("amx linear: the kernel refused AMX's tile state");
  if (norm.element_count() != 0 && norm.element_count() != static_cast<size_t>(k))
    return ffi::Error::InvalidArgument("packed linear: the norm's weight must have x's inputs");
  if (residual.element_count() != 0 &&
      residual.element_count() != static_cast<size_t>(rows * n_blocks * kCols))
    return ffi::Error::InvalidArgument("packed linear: the residual must be y's shape, [m, n]");
  if (live.element_count() > 1)
    return ffi::Error::InvalidArgument("packed linear: live rows must be [1], or [0] for all");
  // the rows computed: a step's real tokens come first and its bucket's padding after
  // them, which gets zeros (a 200-token prompt in a 224-token bucket multiplied 12 % more
  // rows than it has)
  const int64_t m = live.element_count()
                        ? std::clamp<int64_t>(live.typed_data()[0], 0, rows) : rows;
  std::fill(y->typed_data() + m * n_blocks * kCols, y->typed_data() + rows * n_blocks * kCols,
            0.0f);
  if (m == 0) return ffi::Error::Success();
  const int64_t m_blocks = (m + kRows - 1) / kRows, depth = k_blocks * kDepth;
  const RowNorm row_norm{norm.typed_data(), eps, k};
  const Prologue prologue{norm.element_count() ? &row_norm : nullptr, gated != 0};
  // x as the kernels take it: int8 blocks (passes 0, Q4_1 only), or bf16 (hi, and lo) in
  // this thread's buffers (the pool's tasks read them before this call returns)
  thread_local AlignedVector<uint16_t> hi, lo;
  uint16_t* x_hi = nullptr;
  std::vector<int8_t> q8, q8b;  // x's two terms
  std::vector<float> d8, d8b, s8;
  Int8Rows int8{};
  uint16_t* x_lo = nullptr;
  if (passes == 0) {
    if constexpr (kQ41) {
      const int64_t m_pad = (m + kVecRows - 1) / kVecRows * kVecRows;  // whole row blocks
      q8.assign(m_pad * depth, 0);
      q8b.assign(m_pad * depth, 0);
      d8.assign(m_pad * k_blocks, 0.0f);
      d8b.assign(m_pad * k_blocks, 0.0f);
      s8.assign(m_pad * k_blocks, 0.0f);
      const float* xs = x.typed_data();
      thread_local AlignedVector<float> prepared;
      if (prologue.any()) {
        Prepare(xs, m, k, stride, prologue, Grown(prepared, m * k, false));
        xs = prepared.data();
      }
      QuantizeRows(xs, m, k, k_blocks, q8.data(), d8.data(), q8b.data(), d8b.data(),
                   s8.data());
      int8 = {q8.data(), d8.data(), q8b.data(), d8b.data(), s8.data(), k_blocks};
    }
  }
  if (passes != 0) {
    const size_t size = m_blocks * kRows * depth;
    const bool padded = m % kRows != 0 || k % kDepth != 0;  // else Split writes it all
    x_hi = Grown(hi, size, padded);
    if (passes == 2) x_lo = Grown(lo, size, padded);
  }
  const float* x0 = x.typed_data();
  const auto split = [=](int64_t b) {  // row block b of x into x_hi (and x_lo)
    const int64_t r0 = b * kRows;
    Split(x0 + r0 * stride, std::min(kRows, m - r0), k, stride, nullptr, depth,
          isa == Isa::kAmx, x_hi + r0 * depth, x_lo ? x_lo + r0 * depth : nullptr, prologue);
  };
  // x is split on this thread while the pool's threads widen their first Q4_1 items,
  // where it has a decode's few rows (a 16-row decode's Splits, 4-18 us a call, kept the
  // other core waiting ~1 ms a step); else a row block an item over the pool, before the
  // products (a 256-token prefill's Splits, on one thread, were ~6 % of its step)
  const bool overlap = kQ41 && passes != 0 && m_blocks <= kOverlapBlocks;
  std::atomic<bool> x_ready{false};
  const auto split_here = [&] {
    if (!overlap) return;
    for (int64_t b = 0; b < m_blocks; ++b) split(b);
    x_ready.store(true, std::memory_order_release);
  };
  if (passes != 0 && !overlap)
    jaxserve::RunOnPool(pool, m_blocks, [=](std::atomic<int64_t>& next, int64_t total) {
      int64_t finished = 0;
      for (int64_t b = next.fetch_add(1); b < total; b = next.fetch_add(1), ++finished)
        split(b);
      return finished;
    });
  const std::atomic<bool>* ready = overlap ? &x_ready : nullptr;
  const uint16_t* w16 = nullptr;  // a bf16 weight's layer, or a Q4_1 one's
  const uint8_t* w8 = nullptr;
  if constexpr (kQ41) w8 = w.typed_data() + l * n_blocks * k_blocks * kQ4Tile;
  else w16 = w.typed_data() + l * n_blocks * k_blocks * kTile;
  const Problem p{x_hi, x_lo, w16, y->typed_data(), m, n_blocks * kCols, m_blocks,
                  n_blocks, k_blocks, k_blocks};
  const float* res = residual.element_count() ? residual.typed_data() : nullptr;
  if (isa == Isa::kAmx && !int8.q) {  // int8 activations take AVX512-VNNI's loop below
    const int64_t items = (n_blocks + kItemBlocks - 1) / kItemBlocks;
    jaxserve::RunOnPool(
        pool, items,
        [p, w8, res, ready](std::atomic<int64_t>& next, int64_t total) {
          return DrainColumns(p, w8, res, ready, next, total);
        },
        split_here);
  } else {
    const int64_t items = (n_blocks + kVecBlocks - 1) / kVecBlocks;
    jaxserve::RunOnPool(
        pool, items,
        [p, w8, int8, res, ready](std::atomic<int64_t>& next, int64_t total) {
          int64_t finished = 0;
          for (int64_t i = next.fetch_add(1); i < total; i = next.fetch_add(1), ++finished) {
            const int64_t b0 = i * kVecBlocks, b1 = std::min(p.n_blocks, b0 + kVecBlocks);
            if constexpr (kQ41) {
              if (int8.q) {
                Int8Columns(p, int8, w8, b0, b1);
              } else {
                const Problem part = Widened(p, w8, b0, b1, p.m <= kStreamRows);
                jaxserve::AwaitFlag(ready);
                Bf16Columns(part, 0, b1 - b0, /*cached=*/true);
              }
            } else {
              Bf16Columns(p, b0, b1);
            }
            if (res) AddResidual(res, p.y, p.m, p.n, b0, b1);
          }
          return finished;
        },
        split_here);
  }
  return ffi::Error::Success();
}

// LoRA adapters' products (device/adapters.py): each row of x belongs to one adapter slot
// (`slots`, 1-based; 0: none, and its row of y is zeros) and multiplies only the part of
// the stacked weight that its slot owns, `rank` columns or inputs a slot:
// - by outputs (an A stack, x @ A): w's columns are `groups` blocks side by side (q/k/v's
//   A's), slot s owning columns [(s - 1) * rank, s * rank) of each; a row computes the
//   column blocks that hold its slot's, and its other columns are zeros;
// - by inputs (a B stack, (x @ A * scale) @ B): slot s owns inputs [(s - 1) * rank,
//   s * rank), where the caller has zeroed every other input of the row, so the k blocks
//   that hold its slot's give the row's whole sum.
// Rows are gathered by slot, each slot's a sub-problem of the bf16 loops above, and their
// column blocks are the work items of one pool call (by inputs, an item runs its columns
// for every slot: a decode's slots have a few rows each, too little work for an item). A
// row multiplies what it would alone, in the same order, whatever the other rows' slots
// (the dense product by every slot's columns that this replaces added only exact zeros to
// it), with 1/slots of the dense product's multiplies.
struct SlotItem {
  int64_t part0, part1, b0, b1;  // slots' sub-problems [part0, part1), column blocks [b0, b1)
};

AMX int64_t DrainSlotItems(const std::vector<Problem>& parts, const std::vector<SlotItem>& items,
                           std::atomic<int64_t>& next, int64_t total) {
  int64_t finished = 0;
  for (int64_t i = next.fetch_add(1); i < total; i = next.fetch_add(1)) {
    if (!finished) ConfigureTiles();
    for (int64_t q = items[i].part0; q < items[i].part1; ++q)
      Columns(parts[q], items[i].b0, items[i].b1);
    ++finished;
  }
  if (finished) _tile_release();
  return finished;
}

template <Isa isa>
ffi::Error SlotLinear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> w,
                      ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> slots,
                      ffi::ResultBuffer<ffi::F32> y, int32_t passes, int32_t rank,
                      int32_t groups, int32_t by_inputs) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 5 || wd[3] != kRows || wd[4] != kDepth ||
      static_cast<int64_t>(slots.element_count()) != xd[0])
    return ffi::Error::InvalidArgument(
        "slot linear: x must be [m, k], w [layers, n/16, k/32, 16, 32], slots [m]");
  const int64_t m = xd[0], k = xd[1], n_blocks = wd[1], k_blocks = wd[2], n = n_blocks * kCols;
  if (k > k_blocks * kDepth || k <= (k_blocks - 1) * kDepth)
    return ffi::Error::InvalidArgument("slot linear: x's inputs do not match w's");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("slot linear: layer out of range");
  if (passes != 1 && passes != 2)
    return ffi::Error::InvalidArgument("slot linear: passes must be 1 or 2");
  if (rank < 1 || groups < 1 || n_blocks % groups != 0)
    return ffi::Error::InvalidArgument("slot linear: rank and groups must divide the weight");
  if (isa == Isa::kAmx && !jaxserve::RequestAmx())
    return ffi::Error::Internal("amx linear: the kernel refused AMX's tile state");
  const int64_t extent = by_inputs ? k : n / groups;  // what the slots split
  const int32_t* slot = slots.typed_data();
  int64_t num_slots = 0;
  for (int64_t r = 0; r < m; ++r) {
    if (slot[r] < 0 || int64_t{slot[r]} * rank > extent)
      return ffi::Error::InvalidArgument("slot linear: a row's slot is out of range");
    num_slots = std::max<int64_t>(num_slots, slot[r]);
  }
  // the rows of each slot (a counting sort, in row order)
  std::vector<int64_t> first(num_slots + 2, 0), order(m);
  for (int64_t r = 0; r < m; ++r) ++first[slot[r] + 1];
  for (int64_t s = 1; s <= num_slots + 1; ++s) first[s] += first[s - 1];
  {
    std::vector<int64_t> at(first.begin(), first.end() - 1);
    for (int64_t r = 0; r < m; ++r) order[at[slot[r]]++] = r;
  }
  // y's rows that no slot writes whole are zeros: by outputs, every row (its slot's column
  // blocks are all it writes); by inputs, the rows of no slot
  float* out = y->typed_data();
  if (by_inputs) {
    for (int64_t i = 0; i < first[1]; ++i) std::fill_n(out + order[i] * n, n, 0.0f);
  } else {
    std::fill_n(out, m * n, 0.0f);
  }
  // each slot's sub-problem: its k blocks and rows, and where its buffers start. A slot's
  // rows that are one run of x's (a prefill's) are read and written in place; others are
  // gathered from x and their products scattered to y from a buffer.
  struct Part {
    int64_t slot, kb0, kb1, x16, y;  // y: the buffer's offset, or -1 for in place
  };
  std::vector<Part> layout;
  int64_t x16_size = 0, y_size = 0;
  bool padded = false;  // some part's rows or inputs short of whole tiles: zero the buffers
  for (int64_t s = 1; s <= num_slots; ++s) {
    const int64_t rows = first[s + 1] - first[s];
    if (rows == 0) continue;
    const int64_t lo = (s - 1) * rank, hi = s * rank;
    const int64_t kb0 = by_inputs ? lo / kDepth : 0;
    const int64_t kb1 = by_inputs ? (hi + kDepth - 1) / kDepth : k_blocks;
    const bool in_place = order[first[s + 1] - 1] - order[first[s]] == rows - 1;
    layout.push_back({s, kb0, kb1, x16_size, in_place ? -1 : y_size});
    x16_size += (rows + kRows - 1) / kRows * kRows * (kb1 - kb0) * kDepth;
    if (!in_place) y_size += rows * n;
    padded |= rows % kRows != 0 || (std::min(kb1 * kDepth, k) - kb0 * kDepth) % kDepth != 0;
  }
  if (layout.empty()) return ffi::Error::Success();
  // this thread's buffers (the pool's tasks read them before this call returns)
  thread_local AlignedVector<float> y_buffer;
  thread_local AlignedVector<uint16_t> hi_buffer, lo_buffer;
  float* ys = Grown(y_buffer, y_size, !by_inputs);
  uint16_t* x_hi = Grown(hi_buffer, x16_size, padded);
  uint16_t* x_lo = passes == 2 ? Grown(lo_buffer, x16_size, padded) : nullptr;
  const uint16_t* w16 = w.typed_data() + l * n_blocks * k_blocks * kTile;
  const int64_t per_item = isa == Isa::kAmx ? kItemBlocks : kVecBlocks;
  std::vector<Problem> parts;
  std::vector<SlotItem> items;
  for (const Part& part : layout) {
    const int64_t* rows_of = order.data() + first[part.slot];
    const int64_t rows = first[part.slot + 1] - first[part.slot];
    const int64_t k0 = part.kb0 * kDepth, cols = std::min(part.kb1 * kDepth, k) - k0;
    const int64_t depth = (part.kb1 - part.kb0) * kDepth;
    const bool in_place = part.y < 0;
    Split(x.typed_data() + k0 + (in_place ? rows_of[0] * k : 0), rows, cols, k,
          in_place ? nullptr : rows_of, depth, isa == Isa::kAmx, x_hi + part.x16,
          x_lo ? x_lo + part.x16 : nullptr);
    parts.push_back({x_hi + part.x16, x_lo ? x_lo + part.x16 : nullptr,
                     w16 + part.kb0 * kTile, in_place ? out + rows_of[0] * n : ys + part.y,
                     rows, n, (rows + kRows - 1) / kRows, n_blocks, part.kb1 - part.kb0,
                     k_blocks});
    // AVX512-BF16 multiplies a slot's inputs only, where they are whole pairs of one k
    // block (so a decode's slots read B's bytes once between them, not a block each)
    const int64_t lo = (part.slot - 1) * rank - k0, hi = part.slot * rank - k0;
    if (isa == Isa::kAvx512Bf16 && by_inputs && hi <= kDepth && lo % 2 == 0 && hi % 2 == 0) {
      parts.back().pair0 = lo / 2;
      parts.back().pairs = (hi - lo) / 2;
    }
    if (!by_inputs) {
      const int64_t group_blocks = n_blocks / groups, q = parts.size() - 1;
      const int64_t c0 = (part.slot - 1) * rank / kCols;
      const int64_t c1 = (part.slot * rank + kCols - 1) / kCols;
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t b = g * group_blocks + c0; b < g * group_blocks + c1; b += per_item)
          items.push_back({q, q + 1, b, std::min(g * group_blocks + c1, b + per_item)});
    }
  }
  for (int64_t b = 0; by_inputs && b < n_blocks; b += per_item)
    items.push_back({0, static_cast<int64_t>(parts.size()), b, std::min(n_blocks, b + per_item)});
  const int64_t total = items.size();
  if constexpr (isa == Isa::kAmx) {
    jaxserve::RunOnPool(pool, total, [parts, items](std::atomic<int64_t>& next, int64_t total) {
      return DrainSlotItems(parts, items, next, total);
    });
  } else {
    jaxserve::RunOnPool(pool, total, [parts, items](std::atomic<int64_t>& next, int64_t total) {
      int64_t finished = 0;
      for (int64_t i = next.fetch_add(1); i < total; i = next.fetch_add(1), ++finished)
        for (int64_t q = items[i].part0; q < items[i].part1; ++q)
          Bf16Columns(parts[q], items[i].b0, items[i].b1);
      return finished;
    });
  }
  for (const Part& part : layout) {
    if (part.y < 0) continue;  // written in place
    for (int64_t i = first[part.slot]; i < first[part.slot + 1]; ++i)
      std::memcpy(out + order[i] * n, ys + part.y + (i - first[part.slot]) * n, n * sizeof(float));
  }
  return ffi::Error::Success();
}

}  // namespace

// paged_attention.cc's JaxservePrefetchJob, set once both libraries are loaded (linear.py)
extern "C" void JaxserveSetPrefetchJob(void* job) {
  prefetch_job = static_cast<jaxserve::PrefetchJob*>(job);
}

#define JAXSERVE_LINEAR_BINDING(weight)            \
  ffi::Ffi::Bind()                                 \
      .Ctx<ffi::ThreadPool>()                      \
      .Arg<ffi::Buffer<ffi::F32>>() /* x */        \
      .Arg<ffi::Buffer<weight>>() /* w, packed */  \
      .Arg<ffi::Buffer<ffi::S32>>() /* layer */    \
      .Arg<ffi::Buffer<ffi::F32>>() /* RMSNorm's weight [k], or [0]: x as it is */ \
      .Arg<ffi::Buffer<ffi::F32>>() /* a residual [m, n] added to y, or [0] */ \
      .Arg<ffi::Buffer<ffi::S32>>() /* [1]: the rows to compute (the rest: zeros); [0]: all */ \
      .Ret<ffi::Buffer<ffi::F32>>() /* y */        \
      .Attr<int32_t>("passes") /* 1: x in bf16; 2: hi + lo; 0: int8 (Q4_1) */ \
      .Attr<float>("eps") /* RMSNorm's epsilon */ \
      .Attr<int32_t>("gated") /* 1: x is [m, 2k], its input silu(gate) * up */

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveAmxLinear, (Linear<Isa::kAmx, ffi::U16>),
                              JAXSERVE_LINEAR_BINDING(ffi::U16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveAvx512Bf16Linear, (Linear<Isa::kAvx512Bf16, ffi::U16>),
                              JAXSERVE_LINEAR_BINDING(ffi::U16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveAmxQ41Linear, (Linear<Isa::kAmx, ffi::U8>),
                              JAXSERVE_LINEAR_BINDING(ffi::U8));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveAvx512Bf16Q41Linear,
                              (Linear<Isa::kAvx512Bf16, ffi::U8>),
                              JAXSERVE_LINEAR_BINDING(ffi::U8));

#define JAXSERVE_SLOT_LINEAR_BINDING                                       \
  ffi::Ffi::Bind()                                                         \
      .Ctx<ffi::ThreadPool>()                                              \
      .Arg<ffi::Buffer<ffi::F32>>() /* x */                                \
      .Arg<ffi::Buffer<ffi::U16>>() /* w, packed */                        \
      .Arg<ffi::Buffer<ffi::S32>>() /* layer */                            \
      .Arg<ffi::Buffer<ffi::S32>>() /* each row's slot, 0: none */         \
      .Ret<ffi::Buffer<ffi::F32>>() /* y */                                \
      .Attr<int32_t>("passes") /* 1: x in bf16; 2: hi + lo */              \
      .Attr<int32_t>("rank") /* columns or inputs a slot owns */           \
      .Attr<int32_t>("groups") /* blocks of columns side by side */        \
      .Attr<int32_t>("by_inputs") /* 1: slots own inputs; 0: columns */

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveAmxSlotLinear, SlotLinear<Isa::kAmx>,
                              JAXSERVE_SLOT_LINEAR_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveAvx512Bf16SlotLinear, SlotLinear<Isa::kAvx512Bf16>,
                              JAXSERVE_SLOT_LINEAR_BINDING);
