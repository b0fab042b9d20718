// Ragged paged attention on the CPU, called from XLA through its FFI.
//
// Why C++: XLA:CPU can only express paged attention as gathers of K/V pages into a
// contiguous copy, then small batched dots; at a SmolLM2-size decode step that copy
// and the dots' per-call overhead made attention ~40% of the step, several times the
// time its bytes take to read. Here each (row, KV head, tile of the row's tokens) reads
// its pages in place, one page at a time, with an online softmax: K and V are read once.
//
// Semantics are those of `ragged_paged_attention` (pallas_kernels/ragged_attention.py):
// row r's tokens are q[cu_q_lens[r]:cu_q_lens[r+1]], the last of its kv_lens[r] keys;
// token t sits at position kv_lens[r] - (cu_q_lens[r+1] - t) and sees keys 0..position.
// Padding tokens (from cu_q_lens[num_rows] on) and tokens with no key get zeros.
//
// K is stored transposed (kv_cache.py's `k_transposed`): a page is [head_dim, page_size],
// a key a column, so that the few queries of a decode take a page's scores as vector FMAs
// with its keys on the lanes, reading it as it is (a [page_size, head_dim] page was
// transposed in scratch for them: ~22 % of a 16-row decode's attention time on a Zen 5).
// V stays [page_size, head_dim].
//
// Storage (kv_cache.py's --kv-dtype): f32 pages are read in place as above, and so are
// bf16 and int8 pages on the AVX-512 path's AttendPage (a decode's few queries), which
// widens each row as it loads it (int8 times its f32 scale per token and head: the
// product that dequantizing gives). Elsewhere bf16 and int8, and fp8 e4m3fn pages always,
// are first dequantized, one page's K and V at a time, into f32 scratch of the thread:
// the same attention loops then run on every storage, a page's [page_size, head_dim] tile
// is converted once however many queries read it, and the scratch stays in L1. q and the
// output are f32.
//
// On a CPU with AMX, the rows that the step flags as a prompt's (`is_prompt`) and that read
// bf16 pages of 16 keys take AmxItem instead: q and the softmax weights in two bf16 parts
// each, by AMX's tile products (see there); generated tokens stay on the loops above.
//
// Each call then publishes the pages that the next layer's call will read (prefetch_job.h),
// for linear.cc's decode loop to fetch while the projections between the two multiply.

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "prefetch_job.h"
#include "work_queue.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTileTokens = 16;  // tokens of one row per work item
constexpr int64_t kMaxPageSize = 256;
constexpr int64_t kLanes = 16;  // queries a vector holds, one a lane (AttendLanes)
constexpr int64_t kLaneQueries = 16;  // queries of an item from which AttendLanes takes them

// exp(x) for the x <= 0 of an online softmax (a score minus the running max), written
// with plain arithmetic so that the compiler vectorizes the loops calling it (Cephes'
// expf: a degree-6 polynomial on [-ln2/2, ln2/2], scaled by 2^n; ~1 ulp).
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);  // below, exp underflows: 2^n stays a normal float
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(bits);
}

// How pages are stored, and how one page's first `keys` keys become f32 (`scale`: the
// page's scales, int8 only). F32 is read in place, never converted.
struct F32 {
  using Stored = float;
};

// Load(src, scale, PS, D, keys_minor, dst): a page of PS keys (K: [D, PS], keys_minor;
// V: [PS, D]) into dst in the same layout.
struct Bf16 {
  using Stored = uint16_t;
  static void Load(const uint16_t* __restrict src, const float*, int64_t PS, int64_t D, bool,
                   float* __restrict dst) {
#pragma omp simd
    for (int64_t i = 0; i < PS * D; ++i)
      dst[i] = std::bit_cast<float>(static_cast<uint32_t>(src[i]) << 16);
  }
};

struct Int8 {
  using Stored = int8_t;
  static void Load(const int8_t* __restrict src, const float* __restrict scale, int64_t PS,
                   int64_t D, bool keys_minor, float* __restrict dst) {
    if (keys_minor) {
      for (int64_t d = 0; d < D; ++d)
#pragma omp simd
        for (int64_t j = 0; j < PS; ++j)
          dst[d * PS + j] = static_cast<float>(src[d * PS + j]) * scale[j];
      return;
    }
    for (int64_t j = 0; j < PS; ++j) {
      const float s = scale[j];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) dst[j * D + d] = static_cast<float>(src[j * D + d]) * s;
    }
  }
};

// Every fp8 e4m3fn byte's value: 1 sign, 4 exponent (bias 7), 3 mantissa bits; exponent 0
// is subnormal (mantissa × 2^-9), S.1111.111 is NaN, and there are no infinities.
constexpr float DecodeE4M3FN(uint8_t b) {
  const uint32_t exponent = (b >> 3) & 0xF, mantissa = b & 0x7;
  float x;
  if (exponent == 0xF && mantissa == 0x7)
    x = std::numeric_limits<float>::quiet_NaN();
  else if (exponent == 0)
    x = static_cast<float>(mantissa) * (1.0f / 512.0f);
  else
    x = std::bit_cast<float>((exponent - 7 + 127) << 23 | mantissa << 20);
  return b & 0x80 ? -x : x;
}

constexpr std::array<float, 256> kE4M3FN = [] {
  std::array<float, 256> table{};
  for (int b = 0; b < 256; ++b) table[b] = DecodeE4M3FN(static_cast<uint8_t>(b));
  return table;
}();

struct Fp8E4M3FN {
  using Stored = uint8_t;
  static void Load(const uint8_t* __restrict src, const float*, int64_t PS, int64_t D, bool,
                   float* __restrict dst) {
    for (int64_t i = 0; i < PS * D; ++i) dst[i] = kE4M3FN[src[i]];
  }
};

struct Problem {
  const float* q;       // [num_tokens, num_heads, head_dim]
  const void* k;        // [num_layers, num_kv_heads, num_pages, head_dim, page_size]
  const void* v;        // [num_layers, num_kv_heads, num_pages, page_size, head_dim], both
                        //   in the storage of `dtype`
  const float* k_scale;  // [num_layers, num_kv_heads, num_pages, page_size] int8 only
  const float* v_scale;
  ffi::DataType dtype;  // F32, BF16, S8 or F8E4M3FN
  const int32_t* cu_q_lens;   // [num_rows + 1]
  const int32_t* kv_lens;     // [num_rows]
  const int32_t* page_table;  // [num_rows, max_pages]
  const int32_t* is_prompt;   // [num_rows]: 1 where the row's tokens are prompt tokens; or null
  float* out;                 // [num_tokens, num_heads, head_dim]
  int64_t num_heads, head_dim, num_kv_heads, num_pages, page_size, max_pages, layer;
  float scale;
};

// The pool page that holds `row`'s key block `block`; an entry outside the pool (padding)
// reads page 0, so that no kernel reads outside the pool.
inline int64_t PageAt(const Problem& p, int64_t row, int64_t block) {
  const int64_t page = p.page_table[row * p.max_pages + block];
  return page < 0 || page >= p.num_pages ? 0 : page;
}

struct Item {
  int64_t row, kv_head, begin, end;  // tokens [begin, end) of `row`
};

// The positions of an item's tokens (`pos`, one a token) in a row of pages of `page_size`
// keys; returns the last (-1 for none).
inline int64_t Positions(const Problem& p, const Item& it, int64_t page_size, int64_t* pos) {
  const int64_t row_end = p.cu_q_lens[it.row + 1];
  const int64_t kv_len = std::min<int64_t>(p.kv_lens[it.row], p.max_pages * page_size);
  int64_t last = -1;
  for (int64_t i = 0; i < it.end - it.begin; ++i) {
    pos[i] = kv_len - (row_end - (it.begin + i));
    last = std::max(last, pos[i]);
  }
  return last;
}

// Per-thread buffers, sized once per call.
struct Scratch {
  std::vector<float> q, acc, m, l, s;
  std::vector<float> k, v;  // one page dequantized, as stored; not for f32
  std::vector<int64_t> pos, valid;
  std::vector<float> qt;  // AttendLanes: q transposed, [blocks of kLanes queries, D, kLanes]
  std::vector<int32_t> lane_pos;  // and each query's position (-1: none)
  // AmxItem: q's two bf16 parts as A tiles, the scores and the weights' two parts of a
  // group of pages (each [blocks of 16 queries, 16, kAmxKeys], line-aligned: LineUp), and
  // each query's factor for its outputs so far; the rows its tiles are configured for
  std::vector<uint16_t> q_hi, q_lo, w_hi, w_lo;
  std::vector<float> scores, correction;
  int tile_rows = 0;
  Scratch(const Problem& p, int64_t group)
      : q(kTileTokens * group * p.head_dim),
        acc(kTileTokens * group * p.head_dim),
        m(kTileTokens * group),
        l(kTileTokens * group),
        s(kTileTokens * group * p.page_size),
        k(p.dtype == ffi::DataType::F32 ? 0 : p.page_size * p.head_dim),
        v(p.dtype == ffi::DataType::F32 ? 0 : p.page_size * p.head_dim),
        pos(kTileTokens),
        valid(kTileTokens * group),
        qt(kTileTokens * group * p.head_dim),
        lane_pos(kTileTokens * group) {}
};

constexpr int64_t kAmxKeys = 64;  // keys of AmxItem's softmax steps: 4 pages of 16

#ifdef __AVX512F__
// Pages of 16 keys, AVX-512 (every SmolLM2/Llama-shaped step). A prefill tile's queries
// go 16 at a time, a query a lane (AttendLanes); fewer (a decode's GQA group) up to 7 at a
// time with the page's keys on the lanes (AttendPage, K as stored: a key a lane), in the
// same arithmetic. Each V row is loaded (and widened from bf16) once for all the queries.
// The first version of AttendPage (a query's 16 dot products as vectors of partial sums
// over the head, added by a transposing tree; measured against the scalar-indexed loops
// below, 30 layers, 16 decode rows at context 256: f32 pages 21 -> 14-17 ms, bf16 17 ->
// 13-14 ms, with the next page prefetched) took every query: ~3x AttendLanes' time on a
// 256-token prefill, where a scalar exp per key was ~40 % of it.
constexpr int64_t kPageQueries = 7;  // a page's queries at a time: their weights fit on the stack
constexpr int64_t kPagesAhead = 4;  // a decode's pages fetched to L2 this far ahead (RunItem)

// ExpNonPositive on 16 lanes at once. (The compiler left the scalar one unvectorized in
// AttendPage's loop over a page's 16 weights, a branch and 20 scalar operations a key:
// ~40 % of a 256-token prefill's attention time.)
inline __m512 ExpNonPositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// 16 stored values as f32; int8 times `scale` (a lane's own: Int8::Load's product)
template <typename Row>
inline __m512 LoadRow(const Row* src, __m512 scale) {
  if constexpr (std::is_same_v<Row, float>) {
    return _mm512_loadu_ps(src);
  } else if constexpr (std::is_same_v<Row, int8_t>) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), scale);
  } else {  // bf16 bits: the f32 with the same top half
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
}

// A page read in place by AttendPage: its K ([D][16]) and V ([16][D]) as stored, and for
// int8 their scales (a key's, 16 a page; f32 and bf16 pages have none).
template <typename Row>
struct PageView {
  const Row* __restrict k;
  const Row* __restrict v;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
};

// Queries whose outputs AddValues keeps in registers: up to 16 vectors of accumulators
// (4 queries of 64 values, 2 of 128), and at most 4.
template <int64_t D>
constexpr int64_t kValueQueries = std::clamp<int64_t>(16 / (D / 16), 1, 4);

// acc[qi] = acc[qi] * correction[qi] + the sum over the page's keys j < valid[qi] of
// e[qi][j] * v[j], for NB queries at once: their outputs stay in registers across the 16
// keys, and each V row is loaded once for all of them. (Walking the keys outside the
// queries instead loaded and stored every output vector once a key: the stores bounded
// the loop.) A key a query does not see is masked out of its sum, not multiplied by a
// zero weight, so a stale slot's NaN stays out.
template <typename Row, int64_t D, int64_t NB>
inline void AddValues(const PageView<Row>& page, const float (*e)[16], const int64_t* valid,
                      const float* correction, float* __restrict acc) {
  constexpr int64_t C = D / 16;
  __m512 out[NB][C];
  int64_t keys = 0;
  for (int64_t b = 0; b < NB; ++b) {
    keys = std::max(keys, valid[b]);
    const __m512 corr = _mm512_set1_ps(correction[b]);
    for (int64_t c = 0; c < C; ++c)
      out[b][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + b * D + 16 * c), corr);
  }
  for (int64_t j = 0; j < keys; ++j) {
    __m512 vr[C];
    __m512 scale{};
    if constexpr (std::is_same_v<Row, int8_t>) scale = _mm512_set1_ps(page.v_scale[j]);
    for (int64_t c = 0; c < C; ++c) vr[c] = LoadRow(page.v + j * D + 16 * c, scale);
    for (int64_t b = 0; b < NB; ++b) {
      const __mmask16 sees = j < valid[b] ? 0xffff : 0;
      const __m512 p = _mm512_set1_ps(e[b][j]);
      for (int64_t c = 0; c < C; ++c)
        out[b][c] = _mm512_mask3_fmadd_ps(p, vr[c], out[b][c], sees);
    }
  }
  for (int64_t b = 0; b < NB; ++b)
    for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(acc + b * D + 16 * c, out[b][c]);
}

// A page's 16 weights summed as AttendLanes sums its 16 vectors of weights: j + j+8,
// then + 4, + 2, + 1.
inline float SumTree(__m512 w) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(w),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w), 1)));
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// The 16 scores of NQ queries on a page (kt: its K, [D][16], a key a lane), each summed
// over the two halves of the head as AttendLanes sums it; the queries side by side, so
// that their chains of FMAs overlap (one query's two chains of D/2 left the FMA units
// waiting on their latency: ~20 % of a decode's attention time).
template <typename Row, int64_t NQ, int64_t D>
inline void Scores(const PageView<Row>& page, const float* __restrict q, __m512* out) {
  constexpr int64_t Q = D / 2;
  const Row* __restrict kt = page.k;
  __m512 scale{};
  if constexpr (std::is_same_v<Row, int8_t>) scale = _mm512_loadu_ps(page.k_scale);
  __m512 half[NQ][2];
  for (int64_t i = 0; i < NQ; ++i) half[i][0] = half[i][1] = _mm512_setzero_ps();
  for (int64_t d = 0; d < Q; ++d) {
    const __m512 k0 = LoadRow(kt + d * 16, scale), k1 = LoadRow(kt + (Q + d) * 16, scale);
    for (int64_t i = 0; i < NQ; ++i) {
      half[i][0] = _mm512_fmadd_ps(_mm512_set1_ps(q[i * D + d]), k0, half[i][0]);
      half[i][1] = _mm512_fmadd_ps(_mm512_set1_ps(q[i * D + Q + d]), k1, half[i][1]);
    }
  }
  for (int64_t i = 0; i < NQ; ++i) out[i] = _mm512_add_ps(half[i][0], half[i][1]);
}

// A few queries on one page, its keys on the lanes (page.k: its K, [D][16]): the
// arithmetic of AttendLanes for each query, operation for operation, so that a token's
// output never depends on how many others its tile holds, i.e. on how its prompt was
// chunked (batch invariance). valid[qi]: the keys of this page query qi sees (0: none);
// q is scaled already.
template <typename Row, int64_t D>
void AttendPage(const PageView<Row>& page, int64_t n, const float* __restrict q,
                const int64_t* valid, float* __restrict m, float* __restrict l,
                float* __restrict acc, const char* next_v = nullptr, int64_t next_v_bytes = 0) {
  static_assert(D % 16 == 0);
  alignas(64) float e[kPageQueries][16] = {};  // a query that sees no key keeps zeros
  __m512 sums[kPageQueries];
  for (int64_t q0 = 0; q0 < n; q0 += 4) {
    switch (std::min<int64_t>(4, n - q0)) {
      case 4: Scores<Row, 4, D>(page, q + q0 * D, sums + q0); break;
      case 3: Scores<Row, 3, D>(page, q + q0 * D, sums + q0); break;
      case 2: Scores<Row, 2, D>(page, q + q0 * D, sums + q0); break;
      default: Scores<Row, 1, D>(page, q + q0 * D, sums + q0);
    }
  }
  // the next page's V, fetched once this page's K is read (RunItem fetched the next K):
  // fetching both at once stalled on the fill buffers (~0.96x a 16-row decode step)
  for (int64_t line = 0; line < next_v_bytes; line += 64) _mm_prefetch(next_v + line, _MM_HINT_T0);
  // each query's factor for its outputs so far (AddValues applies it as it loads them):
  // exp(m - m_new) as AttendLanes computes it, but 1 where the running max stayed, which
  // is what that exp gives (exactly: ExpNonPositive(0) is 1), without computing it
  float correction[kPageQueries];
  for (int64_t qi = 0; qi < n; ++qi) {
    correction[qi] = 1.0f;
    if (!valid[qi]) continue;
    const __mmask16 live = valid[qi] >= 16 ? 0xffff : (1u << valid[qi]) - 1;
    const __m512 scores = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, sums[qi]);
    const float m_new = std::max(m[qi], _mm512_reduce_max_ps(scores));
    if (m[qi] == -INFINITY)
      correction[qi] = 0.0f;
    else if (m_new != m[qi])
      correction[qi] = _mm512_cvtss_f32(ExpNonPositive(_mm512_set1_ps(m[qi] - m_new)));
    const __m512 weights =
        _mm512_maskz_mov_ps(live, ExpNonPositive(_mm512_sub_ps(scores, _mm512_set1_ps(m_new))));
    _mm512_store_ps(e[qi], weights);
    m[qi] = m_new;
    l[qi] = std::fma(l[qi], correction[qi], SumTree(weights));
  }
  for (int64_t q0 = 0; q0 < n; q0 += kValueQueries<D>) {
    float* out = acc + q0 * D;
    switch (std::min(kValueQueries<D>, n - q0)) {
      case 4: AddValues<Row, D, 4>(page, e + q0, valid + q0, correction + q0, out); break;
      case 3: AddValues<Row, D, 3>(page, e + q0, valid + q0, correction + q0, out); break;
      case 2: AddValues<Row, D, 2>(page, e + q0, valid + q0, correction + q0, out); break;
      default: AddValues<Row, D, 1>(page, e + q0, valid + q0, correction + q0, out);
    }
  }
}

// A prefill tile's queries (16 tokens × the GQA group) 16 at a time, one per lane: a key's
// scores for 16 queries are one vector (D FMAs of its broadcast K values into qt, the
// queries transposed), so the online softmax runs down the lanes with no horizontal
// reduction or scalar exp, and the values add into the outputs transposed as well
// (acc[d][lane]). AttendPage instead takes one query at a time: measured on a 256-token
// prefill, its horizontal sums and per-query softmax cost ~3x the multiplies.
// kt and v: the page's K ([D][16]) and V ([16][D]) in f32; keys: how many keys any lane
// sees; pos: each lane's position (-1: no query); m, l: each lane's running max and sum.
template <int64_t D>
void AttendLanes(const float* __restrict kt, const float* __restrict v, int64_t keys,
                 int64_t first_key, const float* __restrict qt, const int32_t* pos,
                 float* __restrict m, float* __restrict l, float* __restrict acc) {
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  // eight keys at a time, each summed over the halves of the head in two vectors (one
  // chain over all of D missed the float64 reference by 1e-4 relative on int8 pages)
  constexpr int64_t Q = D / 2;
  __m512 s[16];
  for (int j0 = 0; j0 < 16; j0 += 8) {
    __m512 part[8][2];
    for (int j = 0; j < 8; ++j)
      for (int c = 0; c < 2; ++c) part[j][c] = _mm512_setzero_ps();
    for (int64_t d = 0; d < Q; ++d) {
      __m512 qd[2];
      for (int c = 0; c < 2; ++c) qd[c] = _mm512_loadu_ps(qt + (c * Q + d) * kLanes);
      for (int j = 0; j < 8; ++j)
        for (int c = 0; c < 2; ++c)
          part[j][c] = _mm512_fmadd_ps(_mm512_set1_ps(kt[(c * Q + d) * 16 + j0 + j]), qd[c],
                                       part[j][c]);
    }
    for (int j = 0; j < 8; ++j) s[j0 + j] = _mm512_add_ps(part[j][0], part[j][1]);
  }
  const __m512i lane_pos = _mm512_loadu_si512(pos);
  __mmask16 sees[16];
  __m512 top = neg_inf;
  for (int j = 0; j < 16; ++j) {
    sees[j] = _mm512_cmp_epi32_mask(lane_pos, _mm512_set1_epi32(static_cast<int32_t>(first_key + j)),
                                    _MM_CMPINT_NLT);
    s[j] = _mm512_mask_mov_ps(neg_inf, sees[j], s[j]);  // a key a lane does not see
    top = _mm512_max_ps(top, s[j]);
  }
  const __m512 m_old = _mm512_loadu_ps(m), m_new = _mm512_max_ps(m_old, top);
  // a lane that has seen no key yet keeps -inf, and all its weights are masked to zero
  const __m512 shift = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m_new, neg_inf, _CMP_NEQ_OQ), m_new);
  const __m512 correction = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m_old, neg_inf, _CMP_NEQ_OQ),
                                                ExpNonPositive(_mm512_sub_ps(m_old, shift)));
  alignas(64) float e[16][kLanes];
  for (int j = 0; j < 16; ++j) {
    s[j] = _mm512_maskz_mov_ps(sees[j], ExpNonPositive(_mm512_sub_ps(s[j], shift)));
    _mm512_store_ps(e[j], s[j]);
  }
  for (int width = 8; width; width /= 2)  // the weights' sum as a tree
    for (int j = 0; j < width; ++j) s[j] = _mm512_add_ps(s[j], s[j + width]);
  const __m512 sum = s[0];
  _mm512_storeu_ps(m, m_new);
  _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), correction, sum));
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
    __m512 out[16];
    for (int i = 0; i < 16; ++i)
      out[i] = _mm512_mul_ps(_mm512_loadu_ps(acc + (d0 + i) * kLanes), correction);
    for (int64_t j = 0; j < keys; ++j) {
      const __m512 w = _mm512_load_ps(e[j]);
      // masked rather than multiplied by a zero weight: a stale slot's NaN stays out
      for (int i = 0; i < 16; ++i)
        out[i] = _mm512_mask3_fmadd_ps(_mm512_set1_ps(v[j * D + d0 + i]), w, out[i], sees[j]);
    }
    for (int i = 0; i < 16; ++i) _mm512_storeu_ps(acc + (d0 + i) * kLanes, out[i]);
  }
}
#endif

// Storage is how the pages are stored (F32, Bf16, Int8, Fp8E4M3FN). kPageSize and
// kHeadDim are the common shapes as constants, so that the compiler unrolls and
// vectorizes the loops over them; 0 reads them from the problem.
template <typename Storage, int64_t kPageSize, int64_t kHeadDim>
void RunItem(const Problem& p, const Item& it, Scratch& sc) {
  const int64_t PS = kPageSize ? kPageSize : p.page_size;
  const int64_t D = kHeadDim ? kHeadDim : p.head_dim;
  const int64_t H = p.num_heads;
  const int64_t group = H / p.num_kv_heads;
  const int64_t tokens = it.end - it.begin;
  const int64_t n = tokens * group;  // query vectors: token-major, then group
  const int64_t last_pos = Positions(p, it, PS, sc.pos.data());
  float* __restrict q = sc.q.data();
  float* __restrict acc = sc.acc.data();
  float* __restrict s = sc.s.data();  // [n, PS] one page's scores
  for (int64_t i = 0; i < tokens; ++i) {
    for (int64_t g = 0; g < group; ++g) {
      const float* src = p.q + ((it.begin + i) * H + it.kv_head * group + g) * D;
      float* dst = q + (i * group + g) * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * p.scale;
    }
  }
#ifdef __AVX512F__
  constexpr bool kFast = kPageSize == 16 && kHeadDim > 0 && kHeadDim % 16 == 0;
  const bool lanes = kFast && n >= kLaneQueries;
#else
  const bool lanes = false;
#endif
  // AttendLanes keeps acc transposed, [block, D, kLanes], and fills whole blocks of lanes
  const int64_t slots = lanes ? (n + kLanes - 1) / kLanes * kLanes : n;
  std::fill(acc, acc + slots * D, 0.0f);
  std::fill(sc.m.begin(), sc.m.begin() + slots, -INFINITY);
  std::fill(sc.l.begin(), sc.l.begin() + slots, 0.0f);
  if (lanes) {
    for (int64_t qi = 0; qi < slots; ++qi) {
      sc.lane_pos[qi] = qi < n ? static_cast<int32_t>(sc.pos[qi / group]) : -1;
      float* dst = sc.qt.data() + qi / kLanes * D * kLanes + qi % kLanes;
      for (int64_t d = 0; d < D; ++d) dst[d * kLanes] = qi < n ? q[qi * D + d] : 0.0f;
    }
  }
  const int64_t num_blocks = last_pos < 0 ? 0 : last_pos / PS + 1;
  const int64_t layer_offset = (p.layer * p.num_kv_heads + it.kv_head) * p.num_pages;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t page = PageAt(p, it.row, b);
    const int64_t first_key = b * PS;
    using Stored = typename Storage::Stored;
    const Stored* k_page = static_cast<const Stored*>(p.k) + (layer_offset + page) * PS * D;
    const Stored* v_page = static_cast<const Stored*>(p.v) + (layer_offset + page) * PS * D;
    const int64_t scales = (layer_offset + page) * PS;  // its int8 scales' offset
#ifdef __AVX512F__
    // pages of 16 keys: a prefill tile's queries AttendLanes, 16 at a time, from the page
    // in f32 (bf16, int8 and fp8 dequantized into scratch); fewer queries AttendPage, a
    // few at a time, reading f32, bf16 and int8 pages in place (fp8 from the scratch)
    // the next page is elsewhere in the pool: fetch it while this one is computed (on
    // AttendPage's path its V only once this page's scores are taken: next_v)
    constexpr bool kScaled = std::is_same_v<Storage, Int8>;
    const int64_t page_bytes = PS * D * int64_t{sizeof(Stored)};
    const char* next_v = nullptr;
    if (kFast && b + 1 < num_blocks) {
      const int64_t next = PageAt(p, it.row, b + 1);
      const char* nk = static_cast<const char*>(p.k) + (layer_offset + next) * page_bytes;
      const char* nv = static_cast<const char*>(p.v) + (layer_offset + next) * page_bytes;
      for (int64_t line = 0; line < page_bytes; line += 64) {
        _mm_prefetch(nk + line, _MM_HINT_T0);
        if (lanes) _mm_prefetch(nv + line, _MM_HINT_T0);
      }
      if (kScaled)  // a page's 16 scales: a line each
        for (const float* scales : {p.k_scale, p.v_scale})
          _mm_prefetch(reinterpret_cast<const char*>(scales + (layer_offset + next) * PS),
                       _MM_HINT_T0);
      if (!lanes) next_v = nv;
    }
    // a decode's pages further ahead, to L2: one page ahead alone left the loop waiting
    // on memory (a 16-row decode at context 512 reads 6.3 MB of pages a layer: 0.38-0.5 ms
    // a layer from memory against 0.2 from cache); 4 ahead took the step 25.2-25.9 ->
    // 23.3-24.0 ms on an AMX Xeon (2 and 32 ahead: less). The item's first pages at its
    // start: page 1 above, 2..4 here.
    if (kFast && !lanes)
      for (int64_t a = b == 0 ? 2 : b + kPagesAhead; a <= b + kPagesAhead && a < num_blocks;
           ++a) {
        const int64_t ahead = PageAt(p, it.row, a);
        for (const void* pages : {p.k, p.v}) {
          const char* at = static_cast<const char*>(pages) + (layer_offset + ahead) * page_bytes;
          for (int64_t line = 0; line < page_bytes; line += 64)
            _mm_prefetch(at + line, _MM_HINT_T1);
        }
      }
    int64_t* valid = sc.valid.data();
    if (kFast && !lanes)
      for (int64_t qi = 0; qi < n; ++qi)
        valid[qi] = std::clamp<int64_t>(sc.pos[qi / group] - first_key + 1, 0, PS);
    auto fast = [&]<typename Row>(const PageView<Row>& page_view) {
      for (int64_t q0 = 0; q0 < n; q0 += kPageQueries)
        AttendPage<Row, kHeadDim ? kHeadDim : 16>(
            page_view, std::min(kPageQueries, n - q0), q + q0 * D, valid + q0,
            sc.m.data() + q0, sc.l.data() + q0, acc + q0 * D, next_v,
            q0 == 0 && next_v ? page_bytes : 0);
    };
    if constexpr (kFast && !std::is_same_v<Storage, Fp8E4M3FN>) {
      if (!lanes) {
        if constexpr (kScaled)
          fast(PageView<Stored>{k_page, v_page, p.k_scale + scales, p.v_scale + scales});
        else
          fast(PageView<Stored>{k_page, v_page});
        continue;
      }
    }
#endif
    // the keys that some query sees; the rest of the page (stale slots, converted too) the
    // loops below mask out as they do an f32 page's
    const int64_t keys = std::min(PS, last_pos - first_key + 1);
    if constexpr (!std::is_same_v<Storage, F32>) {
      const bool scaled = std::is_same_v<Storage, Int8>;  // else a dummy buffer
      Storage::Load(k_page, scaled ? p.k_scale + scales : nullptr, PS, D, true, sc.k.data());
      Storage::Load(v_page, scaled ? p.v_scale + scales : nullptr, PS, D, false, sc.v.data());
    }
    const float* __restrict kp;
    const float* __restrict vp;
    if constexpr (std::is_same_v<Storage, F32>) {
      kp = k_page;
      vp = v_page;
    } else {
      kp = sc.k.data();
      vp = sc.v.data();
    }
#ifdef __AVX512F__
    if constexpr (kFast) {
      if (lanes)
        for (int64_t q0 = 0; q0 < slots; q0 += kLanes)
          AttendLanes<kHeadDim>(kp, vp, keys, first_key, sc.qt.data() + q0 * D,
                                sc.lane_pos.data() + q0, sc.m.data() + q0, sc.l.data() + q0,
                                acc + q0 * D);
      else
        fast(PageView<float>{kp, vp});
      continue;
    }
#endif
    for (int64_t qi = 0; qi < n; ++qi) {
      const int64_t pos = sc.pos[qi / group];
      if (pos < first_key) continue;
      const int64_t valid = std::min(PS, pos - first_key + 1);
      const float* __restrict qv = q + qi * D;
      float* __restrict sq = s + qi * PS;
      // four partial sums over the head dimension, each a vector of the page's keys
      float p0[kPageSize ? kPageSize : kMaxPageSize], p1[kPageSize ? kPageSize : kMaxPageSize];
      float p2[kPageSize ? kPageSize : kMaxPageSize], p3[kPageSize ? kPageSize : kMaxPageSize];
      for (int64_t j = 0; j < PS; ++j) p0[j] = p1[j] = p2[j] = p3[j] = 0.0f;
      for (int64_t d = 0; d < D; d += 4) {
        const float x0 = qv[d], x1 = qv[d + 1], x2 = qv[d + 2], x3 = qv[d + 3];
        const float* __restrict c = kp + d * PS;
#pragma omp simd
        for (int64_t j = 0; j < PS; ++j) {
          p0[j] += x0 * c[j];
          p1[j] += x1 * c[PS + j];
          p2[j] += x2 * c[2 * PS + j];
          p3[j] += x3 * c[3 * PS + j];
        }
      }
#pragma omp simd
      for (int64_t j = 0; j < PS; ++j)
        sq[j] = j < valid ? (p0[j] + p1[j]) + (p2[j] + p3[j]) : -INFINITY;
      float block_max = -INFINITY;
#pragma omp simd reduction(max : block_max)
      for (int64_t j = 0; j < PS; ++j) block_max = std::max(block_max, sq[j]);
      const float m_old = sc.m[qi];
      const float m_new = std::max(m_old, block_max);
      const float correction = m_old == -INFINITY ? 0.0f : ExpNonPositive(m_old - m_new);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < PS; ++j) {
        const float e = j < valid ? ExpNonPositive(sq[j] - m_new) : 0.0f;
        sq[j] = e;
        sum += e;
      }
      sc.m[qi] = m_new;
      sc.l[qi] = sc.l[qi] * correction + sum;
      float* __restrict a = acc + qi * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) {
        float t = a[d] * correction;
        for (int64_t j = 0; j < valid; ++j) t += sq[j] * vp[j * D + d];
        a[d] = t;
      }
    }
  }
  for (int64_t i = 0; i < tokens; ++i) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t qi = i * group + g;
      float* dst = p.out + ((it.begin + i) * H + it.kv_head * group + g) * D;
      const float inv = sc.l[qi] > 0.0f ? 1.0f / sc.l[qi] : 0.0f;
      if (lanes) {
        const float* src = acc + qi / kLanes * D * kLanes + qi % kLanes;
        for (int64_t d = 0; d < D; ++d) dst[d] = src[d * kLanes] * inv;
        continue;
      }
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) dst[d] = acc[qi * D + d] * inv;
    }
  }
}

#ifdef __AVX512F__
// A prompt's tokens on AMX (bf16 pages of 16 keys; head sizes 64 and 128): a 256-token
// prefill's attention took ~14 ms of its ~62 on AttendLanes' f32 multiply-adds, at a
// sixth of the rate the projections reach on AMX. q and the softmax weights are each two
// bf16 parts (x ~ hi + lo, lo = bf16(x - hi): the f32 value to ~2^-17 of it) multiplied
// by the bf16 K and V by tdpbf16ps, so the result is f32-close (not AttendLanes' bits).
// Every query is a row of the A tiles with a softmax of its own, so its output does not
// depend on the other queries of its item, its step or its chunking; prompt tokens take
// this path and generated ones RunItem's, whatever their number, so no token's output
// depends on how its prompt was split (`is_prompt`, from the scheduler's chunks).
#define AMX __attribute__((target("amx-tile,amx-bf16,avx512bf16")))

// Tiles: 0-3 accumulate (scores of 4 blocks of 16 queries, or 4 blocks of 16 of the
// head's outputs), 4 and 7 the A operands (q's or the weights' hi and lo parts, `rows`
// queries), 5 and 6 the B operands (K's or V's, 16 rows).
AMX void ConfigureAttentionTiles(int rows) {
  jaxserve::TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = t == 5 || t == 6 ? 16 : rows;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

AMX void ReleaseAttentionTiles() { _tile_release(); }

// accumulator t (a run-time index: the intrinsics take immediates)
AMX inline void TileZero(int64_t t) {
  switch (t) {
    case 0: _tile_zero(0); break;
    case 1: _tile_zero(1); break;
    case 2: _tile_zero(2); break;
    default: _tile_zero(3);
  }
}

AMX inline void TileStore(int64_t t, void* at, int64_t stride) {
  switch (t) {
    case 0: _tile_stored(0, at, stride); break;
    case 1: _tile_stored(1, at, stride); break;
    case 2: _tile_stored(2, at, stride); break;
    default: _tile_stored(3, at, stride);
  }
}

// accumulator t += (tile 4) x b, then += (tile 7) x b: both parts of A by B in tile 5 or 6
AMX inline void TileProducts(int64_t t, bool b5) {
#define JAXSERVE_PRODUCTS(T)                                            \
  if (b5) {                                                             \
    _tile_dpbf16ps(T, 4, 5);                                            \
    _tile_dpbf16ps(T, 7, 5);                                            \
  } else {                                                              \
    _tile_dpbf16ps(T, 4, 6);                                            \
    _tile_dpbf16ps(T, 7, 6);                                            \
  }
  switch (t) {
    case 0: JAXSERVE_PRODUCTS(0) break;
    case 1: JAXSERVE_PRODUCTS(1) break;
    case 2: JAXSERVE_PRODUCTS(2) break;
    default: JAXSERVE_PRODUCTS(3)
  }
#undef JAXSERVE_PRODUCTS
}

template <typename T>
T* LineUp(std::vector<T>& buffer, size_t size) {
  if (buffer.size() < size + 64 / sizeof(T)) buffer.resize(size + 64 / sizeof(T));
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) &
                              ~uintptr_t{63});
}

// x's two bf16 parts (hi, lo = bf16(x - hi)) for 32 values (a, then b): A tiles' rows
AMX inline void SplitPair(__m512 a, __m512 b, uint16_t* hi, uint16_t* lo) {
  const __m512bh h = _mm512_cvtne2ps_pbh(b, a);
  const __m512i bits = reinterpret_cast<__m512i>(h);
  const __m512 back_a = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(bits)), 16));
  const __m512 back_b = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(bits, 1)), 16));
  _mm512_store_si512(hi, bits);
  _mm512_store_si512(lo, reinterpret_cast<__m512i>(
                             _mm512_cvtne2ps_pbh(_mm512_sub_ps(b, back_b),
                                                 _mm512_sub_ps(a, back_a))));
}

template <int64_t D>
AMX void AmxItem(const Problem& p, const Item& it, Scratch& sc) {
  constexpr int64_t PS = 16, G = kAmxKeys / PS, C = D / 32;  // pages a group; head chunks
  const int64_t H = p.num_heads, group = H / p.num_kv_heads;
  const int64_t tokens = it.end - it.begin, n = tokens * group, blocks = (n + 15) / 16;
  const int64_t last_pos = Positions(p, it, PS, sc.pos.data());
  // q scaled in f32 (as RunItem scales it), in two parts, as A tiles [blocks, C, 16, 32]
  uint16_t* __restrict q_hi = LineUp(sc.q_hi, blocks * C * 512);
  uint16_t* __restrict q_lo = LineUp(sc.q_lo, blocks * C * 512);
  const __m512 scale = _mm512_set1_ps(p.scale);
  for (int64_t qi = 0; qi < blocks * 16; ++qi) {
    const float* src = p.q + ((it.begin + qi / group) * H + it.kv_head * group + qi % group) * D;
    for (int64_t c = 0; c < C; ++c) {
      const int64_t at = ((qi / 16 * C + c) * 16 + qi % 16) * 32;
      const __m512 a = qi < n ? _mm512_mul_ps(_mm512_loadu_ps(src + 32 * c), scale)
                              : _mm512_setzero_ps();
      const __m512 b = qi < n ? _mm512_mul_ps(_mm512_loadu_ps(src + 32 * c + 16), scale)
                              : _mm512_setzero_ps();
      SplitPair(a, b, q_hi + at, q_lo + at);
    }
  }
  float* __restrict acc = sc.acc.data();
  std::fill(acc, acc + n * D, 0.0f);
  std::fill(sc.m.begin(), sc.m.begin() + n, -INFINITY);
  std::fill(sc.l.begin(), sc.l.begin() + n, 0.0f);
  float* correction = LineUp(sc.correction, blocks * 16);
  alignas(64) uint16_t kb[C][16 * 32];  // a page's K as B tiles: [pair of head][key, member]
  alignas(64) uint16_t vb[2][D / 16][16 * 32];  // V: [32 keys][16 of head][key pair][value, member]
  alignas(64) float o[4][16][16];  // a row block's outputs, 4 blocks of 16 of the head
  static const __m512i kPairs = _mm512_set_epi16(  // K rows d, d+1 -> (d, d+1) per key
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  static const __m512i kLow = _mm512_set_epi16(  // V rows j, j+1 -> pairs, values 0-15
      47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  static const __m512i kHigh = _mm512_set_epi16(  // values 16-31
      63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24,
      55, 23, 54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
  const int64_t num_pages = last_pos < 0 ? 0 : last_pos / PS + 1;
  const int64_t layer_offset = (p.layer * p.num_kv_heads + it.kv_head) * p.num_pages;
  const int64_t page_bytes = PS * D * 2;
  const int tile_rows = static_cast<int>(std::min<int64_t>(16, n));
  if (sc.tile_rows != tile_rows) {
    ConfigureAttentionTiles(tile_rows);
    sc.tile_rows = tile_rows;
  }
  const auto fetch = [&](int64_t a, const void* pool, int hint) {  // page a of the row
    if (a >= num_pages) return;
    const char* at =
        static_cast<const char*>(pool) + (layer_offset + PageAt(p, it.row, a)) * page_bytes;
    for (int64_t line = 0; line < page_bytes; line += 64)
      if (hint == _MM_HINT_T0) _mm_prefetch(at + line, _MM_HINT_T0);
      else _mm_prefetch(at + line, _MM_HINT_T1);
  };
  const size_t tile_values = blocks * 16 * kAmxKeys;
  float* __restrict s = LineUp(sc.scores, tile_values);  // [blocks][16 queries][kAmxKeys]
  uint16_t* __restrict w_hi = LineUp(sc.w_hi, tile_values);  // the weights' parts, the same
  uint16_t* __restrict w_lo = LineUp(sc.w_lo, tile_values);
  std::fill(w_hi, w_hi + tile_values, uint16_t{0});  // rows past n stay zero
  std::fill(w_lo, w_lo + tile_values, uint16_t{0});
  for (int64_t g0 = 0; g0 < num_pages; g0 += G) {
    const int64_t first_key = g0 * PS;
    // the keys some query sees; past them a slot is stale (maybe NaN) or absent: its K
    // and V are read as zeros (its weight is zero, but 0 x NaN is not)
    const int64_t keys = std::min(kAmxKeys, last_pos - first_key + 1);
    for (int64_t j = 0; j < G; ++j) {
      const int64_t b = g0 + j, page_keys = std::clamp<int64_t>(keys - j * PS, 0, PS);
      uint16_t* v_rows = vb[j / 2][0] + j % 2 * 8 * 32;  // this page's 8 key-pair rows
      if (!page_keys) {
        for (int64_t db = 0; db < D / 16; ++db) std::fill_n(v_rows + db * 512, 8 * 32, 0);
        continue;
      }
      for (int64_t a = b == 0 ? 2 : b + kPagesAhead; a <= b + kPagesAhead; ++a)
        for (const void* pool : {p.k, p.v}) fetch(a, pool, _MM_HINT_T1);
      fetch(b + 1, p.k, _MM_HINT_T0);
      const int64_t page = PageAt(p, it.row, b);
      const uint16_t* k_page = static_cast<const uint16_t*>(p.k) + (layer_offset + page) * PS * D;
      const uint16_t* v_page = static_cast<const uint16_t*>(p.v) + (layer_offset + page) * PS * D;
      const __mmask32 live =
          page_keys >= 16 ? ~__mmask32{0} : (__mmask32{1} << 2 * page_keys) - 1;
      for (int64_t d2 = 0; d2 < D / 2; ++d2)  // rows 2 d2, 2 d2 + 1 of K: 64 bytes
        _mm512_store_si512(kb[d2 / 16] + d2 % 16 * 32,
                           _mm512_maskz_permutexvar_epi16(
                               live, kPairs, _mm512_loadu_si512(k_page + d2 * 32)));
      // this page's scores, up to 4 blocks of 16 queries at a time
      for (int64_t rb0 = 0; rb0 < blocks; rb0 += 4) {
        const int64_t nb = std::min<int64_t>(4, blocks - rb0);
        for (int64_t c = 0; c < C; ++c) {
          if (c % 2 == 0) _tile_loadd(5, kb[c], 64);
          else _tile_loadd(6, kb[c], 64);
          for (int64_t t = 0; t < nb; ++t) {
            if (c == 0) TileZero(t);
            const int64_t at = ((rb0 + t) * C + c) * 512;
            _tile_loadd(4, q_hi + at, 64);
            _tile_loadd(7, q_lo + at, 64);
            TileProducts(t, c % 2 == 0);
          }
        }
        for (int64_t t = 0; t < nb; ++t)
          TileStore(t, s + (rb0 + t) * 16 * kAmxKeys + j * PS, kAmxKeys * 4);
      }
      fetch(b + 1, p.v, _MM_HINT_T0);
      for (int64_t r = 0; r < 8; ++r)  // keys 2r, 2r + 1 of the page
        for (int64_t h = 0; h < D / 32; ++h) {
          const __m512i a = 2 * r < page_keys ? _mm512_loadu_si512(v_page + 2 * r * D + 32 * h)
                                              : _mm512_setzero_si512();
          const __m512i z = 2 * r + 1 < page_keys
                                ? _mm512_loadu_si512(v_page + (2 * r + 1) * D + 32 * h)
                                : _mm512_setzero_si512();
          _mm512_store_si512(v_rows + 2 * h * 512 + r * 32, _mm512_permutex2var_epi16(a, kLow, z));
          _mm512_store_si512(v_rows + (2 * h + 1) * 512 + r * 32,
                             _mm512_permutex2var_epi16(a, kHigh, z));
        }
    }
    // each query's softmax step over the group's keys: weights in f32, then in two parts
    for (int64_t qi = 0; qi < n; ++qi) {
      const float* row_s = s + qi * kAmxKeys;  // blocks of 16 queries are contiguous
      uint16_t* row_hi = w_hi + qi * kAmxKeys;
      uint16_t* row_lo = w_lo + qi * kAmxKeys;
      const int64_t valid = std::clamp<int64_t>(sc.pos[qi / group] - first_key + 1, 0, kAmxKeys);
      correction[qi] = 1.0f;
      if (!valid) {
        std::fill_n(row_hi, kAmxKeys, uint16_t{0});
        std::fill_n(row_lo, kAmxKeys, uint16_t{0});
        continue;
      }
      __m512 scores[G];
      __mmask16 live[G];
      __m512 top = _mm512_set1_ps(-INFINITY);
      for (int64_t j = 0; j < G; ++j) {
        const int64_t v = std::clamp<int64_t>(valid - 16 * j, 0, 16);
        live[j] = v >= 16 ? 0xffff : (1u << v) - 1;
        scores[j] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live[j],
                                       _mm512_load_ps(row_s + 16 * j));
        top = _mm512_max_ps(top, scores[j]);
      }
      float& m = sc.m[qi];
      const float m_new = std::max(m, _mm512_reduce_max_ps(top));
      if (m == -INFINITY) correction[qi] = 0.0f;
      else if (m_new != m) correction[qi] = ExpNonPositive(m - m_new);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t j = 0; j < G; j += 2) {
        const __m512 a = _mm512_maskz_mov_ps(
            live[j], ExpNonPositive(_mm512_sub_ps(scores[j], _mm512_set1_ps(m_new))));
        const __m512 b = _mm512_maskz_mov_ps(
            live[j + 1], ExpNonPositive(_mm512_sub_ps(scores[j + 1], _mm512_set1_ps(m_new))));
        SplitPair(a, b, row_hi + 16 * j, row_lo + 16 * j);
        sum = _mm512_add_ps(sum, _mm512_add_ps(a, b));
      }
      m = m_new;
      sc.l[qi] = std::fma(sc.l[qi], correction[qi], SumTree(sum));
    }
    // the group's values: weights [16 queries, 64 keys] by V [64 keys, 16 of the head],
    // in two halves of 32 keys, four blocks of the head at a time
    for (int64_t rb = 0; rb < blocks; ++rb) {
      const int64_t rows = std::min<int64_t>(16, n - rb * 16);
      for (int64_t d0 = 0; d0 < D / 16; d0 += 4) {
        for (int64_t t = 0; t < 4; ++t) TileZero(t);
        for (int64_t half = 0; half < 2; ++half) {
          const int64_t at = rb * 16 * kAmxKeys + 32 * half;
          _tile_loadd(4, w_hi + at, kAmxKeys * 2);
          _tile_loadd(7, w_lo + at, kAmxKeys * 2);
          for (int64_t t = 0; t < 4; ++t) {
            if (t % 2 == 0) _tile_loadd(5, vb[half][d0 + t], 64);
            else _tile_loadd(6, vb[half][d0 + t], 64);
            TileProducts(t, t % 2 == 0);
          }
        }
        for (int64_t t = 0; t < 4; ++t) TileStore(t, o[t][0], 64);
        for (int64_t row = 0; row < rows; ++row) {
          const __m512 corr = _mm512_set1_ps(correction[rb * 16 + row]);
          float* a = acc + (rb * 16 + row) * D + 16 * d0;
          for (int64_t t = 0; t < 4; ++t)
            _mm512_storeu_ps(a + 16 * t, _mm512_fmadd_ps(_mm512_loadu_ps(a + 16 * t), corr,
                                                          _mm512_load_ps(o[t][row])));
        }
      }
    }
  }
  for (int64_t qi = 0; qi < n; ++qi) {
    float* dst = p.out + ((it.begin + qi / group) * H + it.kv_head * group + qi % group) * D;
    const float inv = sc.l[qi] > 0.0f ? 1.0f / sc.l[qi] : 0.0f;
    for (int64_t d = 0; d < D; ++d) dst[d] = acc[qi * D + d] * inv;
  }
}
#undef AMX
#endif

jaxserve::PrefetchJob prefetch_job;  // linear.cc's kernels take it (JaxservePrefetchJob)

// The K and V pages of the next layer (after the last, the first: the next step's) that
// the rows read, for the projections' kernels to fetch before the next call (prefetch_job.h).
// A page that follows the row's previous one in the pool is left out: the hardware's
// stream prefetcher fetches a run (16 rows whose pages were runs: all pages published
// made a decode step 1.04x and 0.99x as long, these 1.005x and 1.008x; scattered, 0.93x
// and 0.90x alike, at context 256 and 512 on a Zen 5).
void PublishNextLayer(const Problem& p, int64_t num_rows, int64_t num_layers, int64_t width) {
  if (!prefetch_job.wanted.load(std::memory_order_relaxed)) return;
  prefetch_job.count.store(0, std::memory_order_relaxed);
  const int64_t layer = (p.layer + 1) % num_layers;
  const int64_t page_bytes = p.page_size * p.head_dim * width;
  int64_t n = 0;
  const auto room = [&] { return n + 2 <= jaxserve::PrefetchJob::kCapacity; };
  for (int64_t r = 0; r < num_rows && room(); ++r) {
    const int64_t kv_len = std::min<int64_t>(p.kv_lens[r], p.max_pages * p.page_size);
    const int64_t blocks = (kv_len + p.page_size - 1) / p.page_size;
    for (int64_t h = 0; h < p.num_kv_heads && room(); ++h)
      for (int64_t b = 0; b < blocks && room(); ++b) {
        const int64_t page = PageAt(p, r, b);
        if (b > 0 && page == PageAt(p, r, b - 1) + 1) continue;
        const int64_t offset = ((layer * p.num_kv_heads + h) * p.num_pages + page) * page_bytes;
        for (const void* pool : {p.k, p.v})
          prefetch_job.pages[n++].store(static_cast<const char*>(pool) + offset,
                                        std::memory_order_relaxed);
      }
  }
  prefetch_job.page_bytes.store(page_bytes, std::memory_order_relaxed);
  prefetch_job.next.store(0, std::memory_order_relaxed);
  prefetch_job.count.store(n, std::memory_order_release);
}

using ItemFn = void (*)(const Problem&, const Item&, Scratch&);

template <typename Storage>
ItemFn ItemFor(const Problem& p) {
  if (p.page_size == 16 && p.head_dim == 64) return RunItem<Storage, 16, 64>;
  if (p.page_size == 16 && p.head_dim == 128) return RunItem<Storage, 16, 128>;
  return RunItem<Storage, 0, 0>;
}

// AmxItem for a step's prompt rows, where the CPU has AMX and the pages are bf16 of 16
// keys; else null (every row takes ItemFor's).
ItemFn PromptItemFor(const Problem& p) {
#ifdef __AVX512F__
  if (p.is_prompt && p.dtype == ffi::DataType::BF16 && p.page_size == 16 &&
      (p.head_dim == 64 || p.head_dim == 128) && jaxserve::RequestAmx())
    return p.head_dim == 64 ? AmxItem<64> : AmxItem<128>;
#endif
  return nullptr;
}

ItemFn ItemFor(const Problem& p) {
  switch (p.dtype) {
    case ffi::DataType::BF16:
      return ItemFor<Bf16>(p);
    case ffi::DataType::S8:
      return ItemFor<Int8>(p);
    case ffi::DataType::F8E4M3FN:
      return ItemFor<Fp8E4M3FN>(p);
    default:
      return ItemFor<F32>(p);
  }
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                          ffi::AnyBuffer v, ffi::Buffer<ffi::F32> k_scale,
                          ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> cu_q_lens,
                          ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_table,
                          ffi::Buffer<ffi::S32> is_prompt, ffi::Buffer<ffi::S32> layer,
                          ffi::ResultBuffer<ffi::F32> out, float scale) {
  // vd: [layers, kv_heads, pages, page_size, head_dim]; K has the last two swapped
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(),
             pd = page_table.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || vd.size() != 5 || pd.size() != 2)
    return ffi::Error::InvalidArgument("paged_attention: q must be 3-D, k/v 5-D, page_table 2-D");
  if (v.element_type() != k.element_type() || !(kd.first(3) == vd.first(3)) ||
      kd[3] != vd[4] || kd[4] != vd[3])
    return ffi::Error::InvalidArgument(
        "paged_attention: k must be v's dtype, shaped [L, H, P, head_dim, page_size]");
  // the engine keeps bf16 and fp8 pools as their bits (u16, u8: see kv_cache.py)
  ffi::DataType dtype = k.element_type();
  if (dtype == ffi::DataType::U16) dtype = ffi::DataType::BF16;
  if (dtype == ffi::DataType::U8) dtype = ffi::DataType::F8E4M3FN;
  if (dtype != ffi::DataType::F32 && dtype != ffi::DataType::BF16 &&
      dtype != ffi::DataType::S8 && dtype != ffi::DataType::F8E4M3FN)
    return ffi::Error::InvalidArgument(
        "paged_attention: k/v must be f32, bf16 (or its u16 bits), s8 or f8e4m3fn (or its u8 "
        "bits)");
  if (dtype == ffi::DataType::S8 &&
      !(k_scale.dimensions() == vd.first(4) && v_scale.dimensions() == vd.first(4)))
    return ffi::Error::InvalidArgument("paged_attention: s8 k/v need scales shaped [L, H, P, S]");
  Problem p{q.typed_data(), k.untyped_data(), v.untyped_data(), k_scale.typed_data(),
            v_scale.typed_data(), dtype, cu_q_lens.typed_data(), kv_lens.typed_data(),
            page_table.typed_data(), is_prompt.element_count() ? is_prompt.typed_data() : nullptr,
            out->typed_data(), qd[1], qd[2], vd[1], vd[2], vd[3], pd[1],
            layer.typed_data()[0], scale};
  const int64_t num_tokens = qd[0], num_rows = pd[0];
  if (is_prompt.element_count() != 0 &&
      is_prompt.element_count() != static_cast<size_t>(num_rows))
    return ffi::Error::InvalidArgument("paged_attention: is_prompt must have one flag a row");
  if (p.page_size > kMaxPageSize || p.page_size % 4 || p.head_dim % 4 ||
      p.num_heads % p.num_kv_heads || vd[4] != p.head_dim)
    return ffi::Error::InvalidArgument("paged_attention: unsupported shapes");
  if (p.layer < 0 || p.layer >= kd[0])
    return ffi::Error::InvalidArgument("paged_attention: layer out of range");
  std::vector<Item> items;
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t begin = p.cu_q_lens[r], end = std::min<int64_t>(p.cu_q_lens[r + 1], num_tokens);
    for (int64_t h = 0; h < p.num_kv_heads; ++h)
      for (int64_t t = begin; t < end; t += kTileTokens)
        items.push_back({r, h, t, std::min(end, t + kTileTokens)});
  }
  const int64_t live = std::clamp<int64_t>(p.cu_q_lens[num_rows], 0, num_tokens);
  std::memset(p.out + live * p.num_heads * p.head_dim, 0,
              (num_tokens - live) * p.num_heads * p.head_dim * sizeof(float));
  if (items.empty()) return ffi::Error::Success();
  const int64_t num_items = static_cast<int64_t>(items.size());
  jaxserve::RunOnPool(pool, num_items, [p, items = std::move(items)](
                                           std::atomic<int64_t>& next, int64_t total) {
    Scratch scratch(p, p.num_heads / p.num_kv_heads);
    const ItemFn run = ItemFor(p), run_prompt = PromptItemFor(p);
    int64_t finished = 0;
    for (int64_t i = next.fetch_add(1); i < total; i = next.fetch_add(1)) {
      const Item& it = items[i];
      (run_prompt && p.is_prompt[it.row] ? run_prompt : run)(p, it, scratch);
      ++finished;
    }
#ifdef __AVX512F__
    if (scratch.tile_rows) ReleaseAttentionTiles();
#endif
    return finished;
  });
  PublishNextLayer(p, num_rows, kd[0], ffi::ByteWidth(k.element_type()));
  return ffi::Error::Success();
}

}  // namespace

extern "C" void* JaxservePrefetchJob() { return &prefetch_job; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k cache
                                  .Arg<ffi::AnyBuffer>()         // v cache
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k scales (s8 only)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v scales (s8 only)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_table
                                  .Arg<ffi::Buffer<ffi::S32>>()  // is_prompt (or empty)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<float>("scale"));
