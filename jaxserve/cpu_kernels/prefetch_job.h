// The KV pages the next attention call will read, fetched into the caches while the
// projections before it multiply.
//
// Why: a decode step's attention reads each row's pages, 2 KiB of K and 2 KiB of V a page
// and layer, scattered over the pool as rows grew a page at a time. Read cold, such pages
// came at ~12 GB/s on a Zen 5 (2 cores; 35 GB/s streamed), and attention waited on them:
// 16 rows at context 512, 0.53 ms a layer with the pages scattered, 0.21 ms with them
// cached. The projections between two attention calls are bound by their multiplies and
// leave the memory bus idle. So each attention call publishes the next layer's pages here
// (paged_attention.cc), and linear.cc's AVX512-BF16 decode loops prefetch them as they go
// (StreamBlocks a couple at every k block, WidenQ41 one every other Q4_1 tile). Prefetches
// are hints that never fault, so a page freed or republished meanwhile costs a wasted
// fetch, never a wrong result.
#pragma once

#include <immintrin.h>

#include <atomic>
#include <cstdint>

namespace jaxserve {

struct PrefetchJob {
  static constexpr int64_t kCapacity = 1 << 16;  // pages (K and V count one each)
  // `wanted`: set by the first consumer (Want); until then the attention kernel publishes
  // nothing, so CPUs and backends whose projections do not prefetch (AVX2 only, XLA's
  // dots, the AMX loop) pay nothing for the list
  std::atomic<int64_t> next{0}, count{0}, page_bytes{0}, wanted{0};
  std::atomic<const char*> pages[kCapacity];

  inline void Want() {
    if (!wanted.load(std::memory_order_relaxed)) wanted.store(1, std::memory_order_relaxed);
  }

  // Prefetches the next page not yet claimed, if any, to L2 (_MM_HINT_T1/T2 alike on a
  // Zen 5; into L1 (T0) or non-temporally a 16-row decode step took 4 % longer, not 8 %
  // shorter).
  inline void Step() {
    if (next.load(std::memory_order_relaxed) >= count.load(std::memory_order_relaxed)) return;
    const int64_t page = next.fetch_add(1, std::memory_order_relaxed);
    if (page >= count.load(std::memory_order_acquire)) return;
    const char* start = pages[page].load(std::memory_order_relaxed);
    const int64_t bytes = page_bytes.load(std::memory_order_relaxed);
    for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(start + line, _MM_HINT_T2);
  }
};

}  // namespace jaxserve
