// Work items spread over XLA's intra-op pool (the FFI's ThreadPool), for every CPU kernel
// here. Items are handed out through one counter and the calling thread works too, so a
// call completes even when the pool runs none of the tasks it is given. (Threads of our
// own instead measured slower: XLA's idle workers spin a while before they sleep, on the
// cores the extra threads needed.)

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

// ~0.2-1 ms of pause instructions (an item takes ~10-100 us)
constexpr int kSpins = 1 << 14;

// What RunOnPool runs first when the caller has no work of its own before the items.
struct Nothing {
  void operator()() const {}
};

// Runs drain(next, items) on this thread and on up to the pool's threads: each claims
// item indices with next.fetch_add(1) until one is >= items, runs them, and returns how
// many it ran; this returns when all have run. `drain` is kept in a state that outlives
// the call (a pool task may start after it returned, and then claims nothing), so it
// holds by value whatever the items read. `first` runs on this thread once the helpers
// are asked for and before it claims items: work that the items wait for while
// they do their own first part (AwaitFlag).
template <typename Drain, typename First = Nothing>
void RunOnPool(xla::ffi::ThreadPool pool, int64_t items, Drain drain, First first = {}) {
  struct State {
    State(int64_t n, Drain d) : items(n), drain(std::move(d)) {}
    const int64_t items;
    const Drain drain;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable all_done;

    void Run() {
      const int64_t finished = drain(next, items);
      if (finished && done.fetch_add(finished) + finished == items) {
        std::lock_guard<std::mutex> lock(mu);
        all_done.notify_all();
      }
    }
  };
  if (items <= 0) return;
  auto state = std::make_shared<State>(items, std::move(drain));
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), items - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([state] { state->Run(); });
  first();
  state->Run();
  // What is left is a helper's last item: wait for it awake first (sleeping on the
  // condition variable, a 16-row decode step switched threads ~200 times instead of ~65,
  // and took ~13 % longer on an Intel Xeon), then asleep should the helper have lost its
  // core.
  for (int spins = 0; spins < kSpins && state->done.load() != items; ++spins) _mm_pause();
  std::unique_lock<std::mutex> lock(state->mu);
  state->all_done.wait(lock, [&] { return state->done.load() == items; });
}

// Waits until `flag` (if any) is set by RunOnPool's `first`: awake a while, then yielding
// the core, which the thread that sets it may be waiting for (two cores, three threads).
inline void AwaitFlag(const std::atomic<bool>* flag) {
  for (int spins = 0; flag && !flag->load(std::memory_order_acquire); ++spins)
    if (spins < kSpins) _mm_pause();
    else std::this_thread::yield();
}

}  // namespace jaxserve
