// The thread pool behind moe_engine::parallel_items (thread_pool.h explains the scheme).

#include "thread_pool.h"

#include <immintrin.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace moe_engine {
namespace {

// One parallel_items call. Shared (shared_ptr) because a worker may still hold it after the
// caller returned; `body` is only called for claimed items < n, all finished before the caller
// returns, so it never outlives the caller's frame.
struct Job {
  const ItemFn* body;
  int64_t n;
  int threads;                     // workers with id < threads take part
  int64_t batch;                   // the most items one claim takes (claim_batch)
  std::atomic<int64_t> next{0};    // next unclaimed item
  std::atomic<int64_t> done{0};    // finished items
};

// The largest claim: about 8 claims per thread (at least 1 item each). Claiming one item at a
// time made every item cost two round trips of the counters' cache lines between the cores
// (about 0.1-0.2 us each), as much as a decode-size item's work (a 16-column tile of one expert
// at one token).
int64_t claim_batch(int64_t n, int threads) {
  return std::max<int64_t>(1, n / (8 * static_cast<int64_t>(threads)));
}

// Items the next claim takes with `left` unclaimed (guided self-scheduling, Polychronopoulos &
// Kuck 1987): a share of what is left, at most `job.batch`, at least 1/8 of it. A fixed batch
// left the thread that claimed the last one working alone for up to a batch's time (1/16 of a
// 2-thread job: the LM head's 201088 x 2880 at one row, 72 MB of it); shrinking claims end
// both threads within a small claim of each other.
int64_t claim_size(const Job& job, int64_t left) {
  const int64_t share = left / (2 * static_cast<int64_t>(job.threads));
  return std::min(left, std::clamp<int64_t>(share, std::max<int64_t>(1, job.batch / 8),
                                            job.batch));
}

// Claim and run items of `job` as `worker`, `claim_size` at a time, until none are left.
void work_on(Job& job, int worker) {
  int64_t begin = job.next.load(std::memory_order_relaxed);
  for (;;) {
    if (begin >= job.n) return;
    const int64_t take = claim_size(job, job.n - begin);
    if (!job.next.compare_exchange_weak(begin, begin + take, std::memory_order_relaxed)) {
      continue;  // `begin` now holds the counter's value
    }
    const int64_t end = begin + take;
    for (int64_t i = begin; i < end; ++i) (*job.body)(i, worker);
    job.done.fetch_add(take, std::memory_order_release);
    begin = job.next.load(std::memory_order_relaxed);
  }
}

thread_local bool in_job = false;  // the current thread is running a pool item

class Pool {
 public:
  explicit Pool(int64_t spin_us) : spin_(std::chrono::microseconds(spin_us)) {}

  void run(int64_t n, int threads, const ItemFn& body) {
    auto job = std::make_shared<Job>();
    job->body = &body;
    job->n = n;
    job->threads = threads;
    job->batch = claim_batch(n, threads);
    {
      std::lock_guard<std::mutex> lock(mu_);
      grow(threads - 1);
      current_ = job;
      gen_.fetch_add(1, std::memory_order_release);
      if (sleepers_ > 0) cv_.notify_all();
    }
    in_job = true;
    work_on(*job, 0);
    in_job = false;
    // only items some worker has claimed can still be running
    while (job->done.load(std::memory_order_acquire) < n) _mm_pause();
  }

 private:
  void grow(int workers) {  // under mu_
    while (static_cast<int>(threads_.size()) < workers) {
      const int id = static_cast<int>(threads_.size()) + 1;
      threads_.emplace_back([this, id] { loop(id); });
      threads_.back().detach();
    }
  }

  void loop(int id) {
    uint64_t seen = 0;
    for (;;) {
      wait_for(seen);
      std::shared_ptr<Job> job;
      {
        std::lock_guard<std::mutex> lock(mu_);
        job = current_;
        seen = gen_.load(std::memory_order_relaxed);
      }
      if (job && id < job->threads) {
        in_job = true;
        work_on(*job, id);
        in_job = false;
      }
    }
  }

  // Until the generation moves past `seen`: spin for spin_ (yielding the core every 64 polls,
  // so that another runnable thread of this process, e.g. one of torch's OpenMP workers, is
  // never kept waiting by a spinner), then sleep.
  void wait_for(uint64_t seen) {
    const auto until = std::chrono::steady_clock::now() + spin_;
    int polls = 0;
    while (gen_.load(std::memory_order_acquire) == seen) {
      _mm_pause();
      if (++polls % 64 != 0) continue;
      sched_yield();
      if (std::chrono::steady_clock::now() >= until) {
        std::unique_lock<std::mutex> lock(mu_);
        ++sleepers_;
        cv_.wait(lock, [&] { return gen_.load(std::memory_order_relaxed) != seen; });
        --sleepers_;
        return;
      }
    }
  }

  const std::chrono::microseconds spin_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::shared_ptr<Job> current_;  // guarded by mu_
  std::atomic<uint64_t> gen_{0};  // bumped (under mu_) when current_ changes
  int sleepers_ = 0;              // guarded by mu_
  std::vector<std::thread> threads_;  // guarded by mu_
};

int64_t spin_us_from_env() {
  const char* s = std::getenv("MOE_ENGINE_SPIN_US");
  if (!s || !*s) return 200;
  const long v = std::strtol(s, nullptr, 10);
  return v < 0 ? 0 : v;
}

// The process's pool, made on first use; a forked child (whose copy has no threads) makes its
// own. Leaked on purpose: detached workers may still run while static destructors do.
Pool& pool() {
  static std::mutex mu;
  static Pool* p = nullptr;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lock(mu);
  if (p == nullptr || owner != getpid()) {
    p = new Pool(spin_us_from_env());
    owner = getpid();
  }
  return *p;
}

}  // namespace

void parallel_items_impl(int64_t n, int threads, const ItemFn& body) {
  if (threads <= 1 || n <= 1 || in_job) {
    for (int64_t i = 0; i < n; ++i) body(i, 0);
    return;
  }
  pool().run(n, threads, body);
}

}  // namespace moe_engine
