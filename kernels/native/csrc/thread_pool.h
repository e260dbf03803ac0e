// A parallel-for whose caller never waits for a thread that has not started.
//
// OpenMP's `parallel for` ends with a barrier: the calling thread waits until every thread of
// the team has arrived, including one the OS has not scheduled yet. On a machine whose cores
// are shared (a 2-core CPU with the gRPC front end, or a noisy neighbour), a decode step's ~60
// small parallel regions each stall for the other process's time slice: measured here, a
// [1, 512] x [512, 32] bf16 linear took 12 us on one thread and 3.2 ms as a 2-thread OpenMP
// region while another process ran (bench/NOTES.md, "Parallel regions under contention").
//
// `parallel_items(n, threads, body)` instead publishes the job and works on it itself: items
// are claimed from an atomic counter, a few at a time (at most about an eighth of a thread's
// share, fewer as the job nears its end: thread_pool.cpp `claim_size`), by the caller and by
// whichever pool workers are awake, and the caller returns once every item is FINISHED, so it
// only waits for items a worker has actually claimed (a small share of the work). A worker
// that wakes up late finds nothing left and goes back to waiting. This is the work-claiming
// scheme of ATen's and llama.cpp's thread pools (ggml-cpu's `ggml_graph_compute_thread` claims
// chunks from an atomic counter) with the straggler-free completion rule made explicit.
//
// Workers spin for `spin_us` (MOE_ENGINE_SPIN_US, default 200 us, about the gap between two
// kernels of a decode step) and then sleep on a condition variable, so an idle engine leaves
// its cores to other processes. The pool is created on first use in each process (a forked
// child makes its own) and holds at most `threads - 1` workers; the caller is worker 0.
#pragma once

#include <cstdint>

namespace moe_engine {

// A non-owning reference to a callable `void(int64_t item, int worker)`.
class ItemFn {
 public:
  template <typename F>
  explicit ItemFn(const F& f)
      : obj_(&f),
        call_([](const void* o, int64_t i, int w) { (*static_cast<const F*>(o))(i, w); }) {}
  void operator()(int64_t item, int worker) const { call_(obj_, item, worker); }

 private:
  const void* obj_;
  void (*call_)(const void*, int64_t, int);
};

// Runs body(item, worker) for every item in [0, n), on up to `threads` threads (the caller
// included), `worker` in [0, threads) naming the thread (for per-thread scratch). Returns when
// every item has finished. Inline (worker 0) when threads <= 1, n <= 1, or when called from
// inside a pool job. Exceptions must not leave `body`.
void parallel_items_impl(int64_t n, int threads, const ItemFn& body);

template <typename F>
inline void parallel_items(int64_t n, int threads, const F& body) {
  if (n <= 0) return;
  parallel_items_impl(n, threads, ItemFn(body));
}

}  // namespace moe_engine
