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

// Per-thread buffers, sized once per call.
struct Scratch {
  std::vector<float> q, acc, m, l, s;
  std::vector<float> k, v;  // one page dequantized, as stored; not for f32
  std::vector<int64_t> pos, valid;
  std::vector<float> qt;  // AttendLanes: q transposed, [blocks of kLanes queries, D, kLanes]
  std::vector<int32_t> lane_pos;  // and each query's position (-1: none)
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
  const int64_t row_end = p.cu_q_lens[it.row + 1];
  const int64_t kv_len = std::min<int64_t>(p.kv_lens[it.row], p.max_pages * PS);
  int64_t last_pos = -1;
  for (int64_t i = 0; i < tokens; ++i) {
    sc.pos[i] = kv_len - (row_end - (it.begin + i));
    last_pos = std::max(last_pos, sc.pos[i]);
  }
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
                          ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out,
                          float scale) {
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
            page_table.typed_data(), out->typed_data(), qd[1], qd[2], vd[1], vd[2], vd[3],
            pd[1], layer.typed_data()[0], scale};
  const int64_t num_tokens = qd[0], num_rows = pd[0];
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
    const ItemFn run = ItemFor(p);
    int64_t finished = 0;
    for (int64_t i = next.fetch_add(1); i < total; i = next.fetch_add(1)) {
      run(p, items[i], scratch);
      ++finished;
    }
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
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<float>("scale"));
