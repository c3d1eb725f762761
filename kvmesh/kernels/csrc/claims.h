// Work handed out in claims that shrink as it runs out (guided scheduling), for the kernels'
// parallel loops: a thread that the OS takes off its core mid-call (the mesh's router, scheduler
// and clients share the worker's cores) holds back at most its current claim while the others
// take the rest, and items of uneven cost (sequences of different lengths) even out at the end;
// with a fixed split a late thread's whole share waits for it while the others spin at the barrier.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace kvmesh {

class Claims {
 public:
  // Items [0, total) for `threads` threads, at least `least` items a claim (the last may be short).
  Claims(int64_t total, int64_t threads, int64_t least)
      : total_(total), threads_(std::max<int64_t>(1, threads)), least_(std::max<int64_t>(1, least)) {}

  // The next claim [begin, end); false when every item has been claimed.
  bool next(int64_t& begin, int64_t& end) {
    int64_t at = next_.load(std::memory_order_relaxed);
    for (;;) {
      if (at >= total_) return false;
      const int64_t size = std::max(least_, (total_ - at) / (2 * threads_));
      if (next_.compare_exchange_weak(at, at + size, std::memory_order_relaxed)) {
        begin = at;
        end = std::min(total_, at + size);
        return true;
      }
    }
  }

 private:
  const int64_t total_, threads_, least_;
  std::atomic<int64_t> next_{0};
};

// Runs body(thread_state, begin, end) over items [0, total) by claims of at least `least` items,
// on as many of torch's threads as there are such claims; `make_state` gives each thread its
// scratch once. One claim's worth of work stays on the calling thread.
template <typename MakeState, typename Body>
void parallel_claims(int64_t total, int64_t least, const MakeState& make_state, const Body& body) {
  if (total <= 0) return;
  least = std::max<int64_t>(1, least);
  const int64_t team = std::min<int64_t>(at::get_num_threads(), (total + least - 1) / least);
  Claims claims(total, team, least);
  auto work = [&](int64_t, int64_t) {
    auto state = make_state();
    int64_t begin, end;
    while (claims.next(begin, end)) body(state, begin, end);
  };
  if (team <= 1)
    work(0, 1);
  else
    at::parallel_for(0, team, 1, work);
}

}  // namespace kvmesh
