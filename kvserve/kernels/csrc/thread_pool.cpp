// kvserve::parallel_for (thread_pool.h): one region at a time, chunks claimed from one atomic word.
#include "thread_pool.h"

#include <ATen/Parallel.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sched.h>
#endif

namespace kvserve {
namespace detail {
namespace {

using Clock = std::chrono::steady_clock;

// Spins before sleeping, measured on 2 cores (BENCHMARKS.md, "A machine shared with other work"):
// a decode step's regions come microseconds apart and the host's work between two steps takes
// ~0.5-1 ms, while a sleeping thread took 0.1-0.3 ms to wake up on a VM. Workers that slept
// through every gap (200 us spins) cost a quiet one-stream decode 10%; 1 ms keeps its speed. The
// caller waits only for chunks another thread is running, and on a busy machine that thread may be
// off its core for milliseconds: 200 us, then it sleeps.
constexpr auto kWorkerSpin = std::chrono::microseconds(1000);
constexpr auto kCallerSpin = std::chrono::microseconds(200);
// Chunks per thread: two, so a thread that starts late or runs slowly (a neighbour on its core)
// leaves half its share to the others. Four cost a quiet decode 6%: a memory-bound linear's
// weights then stream in shorter runs.
constexpr int64_t kChunksPerThread = 2;
// Rows up to which model/cpu_linear.py runs a linear on our kernels (SMALL_BATCH); above, a packed
// fp16 one runs on torch's threads (team_for).
constexpr int64_t kSmallBatch = 32;

// Going solo. Beside neighbours that keep both cores busy, a worker is off its core most of the
// time: it ran 8-12% of the chunks where a fair half was 50%, and the caller waited 116-200 us a
// region for chunks it had claimed before it was descheduled. The caller alone then ran a decode
// 1.4-2x faster than the pair (BENCHMARKS.md, issue 38). Where the worker shares the caller's core,
// it ran 0.4% of the chunks and its spins only took the caller's time. A worker that runs so few
// chunks can speed a region up by little (12% at most at a 12% share), so the pool watches windows
// of kProbeRegions regions; when its workers ran under half their fair share of the chunks, regions
// run on the caller alone for a solo period, after which the next window probes again. A period
// doubles while probes keep finding the workers starved (so probing costs ~1% of the time), and is
// back at its base once one finds them well. A quiet machine's worker runs about half the chunks.
constexpr int64_t kProbeRegions = 64;
constexpr auto kSoloBase = std::chrono::milliseconds(20);
constexpr auto kSoloMax = std::chrono::milliseconds(640);

// The claim word: generation (24 bits) | next chunk (20 bits) | chunk count (20 bits). One word,
// so a claim checks the region and the count it claims against in one compare-and-swap: a thread
// that slept through a region can never claim a chunk of the next one with the old one's count.
constexpr int kCountBits = 20;
constexpr uint64_t kCountMask = (uint64_t{1} << kCountBits) - 1;
constexpr int64_t kMaxChunks = static_cast<int64_t>(kCountMask);
constexpr uint64_t kGenerationMask = (uint64_t{1} << (64 - 2 * kCountBits)) - 1;  // wraps around

uint64_t pack(uint64_t generation, uint64_t next, uint64_t count) {
  return (generation << (2 * kCountBits)) | (next << kCountBits) | count;
}
uint64_t generation_of(uint64_t word) { return word >> (2 * kCountBits); }
int64_t next_of(uint64_t word) { return static_cast<int64_t>((word >> kCountBits) & kCountMask); }
int64_t count_of(uint64_t word) { return static_cast<int64_t>(word & kCountMask); }

inline void pause() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

thread_local bool in_region = false;  // nested regions run inline

// Whether this thread runs under a real-time policy (`chrt -f`, `chrt -r`), where threads of one
// priority run until they block: a worker spinning through the Python between a step's regions
// held its core, and `kvserve serve`'s event loop got the other only when the engine thread
// blocked, so streams went out in bursts (multi-turn under `chrt -f 1`: ITL p50 0 ms, p99
// 228-484 ms; without it 15.6 and 191). Read once per thread (a pool's threads inherit the policy,
// except under `chrt -R`, whose flag Linux adds to the policy read back and whose children start
// under the normal one); a policy changed later on a running thread is not seen.
bool realtime_policy() {
#if defined(__linux__)
  thread_local const bool realtime = [] {
    const int policy = sched_getscheduler(0) & ~SCHED_RESET_ON_FORK;
    return policy == SCHED_FIFO || policy == SCHED_RR;
  }();
  return realtime;
#else
  return false;
#endif
}

// A bounded spin: `spinning()` pauses once and says whether the budget of wall time lasts (the
// clock read every 64 pauses, 1-2 us). It yielded the core at each read for a while: that helped
// beside other sessions' jobs until the pool went solo where its workers starve, and then cost
// 1.2-1.5x beside niced neighbours and busy loops, which the yield handed the core (EEVDF lets a
// task it picks run its slice), and nothing beside other sessions' jobs (BENCHMARKS.md, issue 38).
// It yields under a real-time policy only (realtime_policy), where a yield goes to the threads of
// its own priority that wait, and to no one else.
class Spin {
 public:
  explicit Spin(Clock::duration budget) : until_(Clock::now() + budget) {}

  bool spinning() {
    pause();
    if (++spins_ % 64 != 0) return true;
#if defined(__linux__)
    if (realtime_policy()) sched_yield();
#endif
    return Clock::now() < until_;
  }

 private:
  Clock::time_point until_;
  int spins_ = 0;
};

class Pool {
 public:
  PoolStats stats() {
    std::lock_guard<std::mutex> region(busy_);
    PoolStats stats = stats_;
    stats.worker_sleeps = worker_sleeps_.load();
    stats.torch_regions = torch_regions_.load();
    return stats;
  }

  void count_torch_region() { torch_regions_.fetch_add(1, std::memory_order_relaxed); }

  void run(int64_t begin, int64_t end, int64_t grain, ChunkFn fn, const void* ctx) {
    const int64_t threads = at::get_num_threads();
    const int64_t range = end - begin;
    std::unique_lock<std::mutex> region(busy_, std::try_to_lock);
    if (threads <= 1 || range <= grain || in_region || at::in_parallel_region() || !region.owns_lock()) {
      fn(ctx, begin, end);
      return;
    }
    if (Clock::now() < solo_until_) {
      ++stats_.solo_regions;
      fn(ctx, begin, end);
      return;
    }
    const int64_t workers = start_workers(threads - 1);
    const int64_t chunks = (workers + 1) * kChunksPerThread;
    const int64_t chunk =
        std::max<int64_t>({grain, 1, (range + chunks - 1) / chunks, (range + kMaxChunks - 1) / kMaxChunks});
    const int64_t count = (range + chunk - 1) / chunk;
    fn_ = fn;
    ctx_ = ctx;
    begin_ = begin;
    end_ = end;
    chunk_ = chunk;
    error_ = nullptr;
    done_.store(0);
    participants_.store(workers + 1);
    const uint64_t generation = (generation_of(claim_.load()) + 1) & kGenerationMask;
    claim_.store(pack(generation, 0, static_cast<uint64_t>(count)));
    if (sleepers_.load() > 0) {
      { std::lock_guard<std::mutex> lock(sleep_mutex_); }
      wake_.notify_all();
    }
    in_region = true;
    const int64_t own = work(generation);
    in_region = false;
    const auto worked = Clock::now();
    stats_.caller_sleeps += wait_done(count);
    const auto ended = Clock::now();
    ++stats_.parallel_regions;
    stats_.waiting_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(ended - worked).count();
    stats_.caller_chunks += own;
    stats_.worker_chunks += count - own;
    judge(workers, count - own, count, ended);
    if (error_) std::rethrow_exception(error_);
  }

  // Ends a solo period now: the next regions run on every thread (PoolStats).
  void end_solo() {
    std::lock_guard<std::mutex> region(busy_);
    solo_until_ = Clock::time_point{};
    solo_period_ = kSoloBase;
    window_ = Window{};
  }

 private:
  struct Window {
    int64_t regions = 0, worker_chunks = 0, chunks = 0;
  };

  // Adds a parallel region to the window; at its end, goes solo or not (kProbeRegions).
  void judge(int64_t workers, int64_t worker_chunks, int64_t chunks, Clock::time_point now) {
    window_.regions += 1;
    window_.worker_chunks += worker_chunks;
    window_.chunks += chunks;
    if (window_.regions < kProbeRegions) return;
    // Under half their fair share: workers / (workers + 1) of the chunks, halved.
    if (2 * (workers + 1) * window_.worker_chunks < workers * window_.chunks) {
      solo_until_ = now + solo_period_;
      solo_period_ = std::min<Clock::duration>(2 * solo_period_, kSoloMax);
      ++stats_.solo_periods;
    } else {
      solo_period_ = kSoloBase;
    }
    window_ = Window{};
  }

  // Up to `wanted` workers (started once, kept); fewer where the system refuses a thread.
  int64_t start_workers(int64_t wanted) {
    while (static_cast<int64_t>(workers_.size()) < wanted && !refused_) {
      const int64_t index = static_cast<int64_t>(workers_.size());
      try {
        workers_.emplace_back([this, index] { worker(index); });
      } catch (const std::system_error&) {
        refused_ = true;
      }
    }
    return std::min<int64_t>(wanted, static_cast<int64_t>(workers_.size()));
  }

  // Claims and runs chunks of region `generation` until none is left; returns how many it ran.
  int64_t work(uint64_t generation) {
    int64_t ran = 0;
    uint64_t word = claim_.load();
    while (generation_of(word) == generation && next_of(word) < count_of(word)) {
      if (!claim_.compare_exchange_weak(word, word + (uint64_t{1} << kCountBits))) continue;
      const int64_t b = begin_ + next_of(word) * chunk_;
      ++ran;
      try {
        fn_(ctx_, b, std::min(end_, b + chunk_));
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
      if (done_.fetch_add(1) + 1 == count_of(word) && caller_sleeping_.load()) {
        { std::lock_guard<std::mutex> lock(sleep_mutex_); }
        finished_.notify_one();
      }
      word = claim_.load();
    }
    return ran;
  }

  // Returns whether it slept.
  bool wait_done(int64_t count) {
    for (Spin spin(kCallerSpin); done_.load() < count;) {
      if (!spin.spinning()) {
        std::unique_lock<std::mutex> lock(sleep_mutex_);
        caller_sleeping_.store(true);
        finished_.wait(lock, [&] { return done_.load() >= count; });
        caller_sleeping_.store(false);
        return true;
      }
    }
    return false;
  }

  [[noreturn]] void worker(int64_t index) {
    in_region = true;  // a kernel called from a chunk runs its own regions inline
    uint64_t seen = generation_of(claim_.load());
    for (;;) {
      seen = generation_of(await_region(seen));
      if (index + 1 < participants_.load()) work(seen);
    }
  }

  // Spins a bounded time for a region newer than `seen`, then sleeps until one comes.
  uint64_t await_region(uint64_t seen) {
    for (Spin spin(kWorkerSpin); spin.spinning();) {
      const uint64_t word = claim_.load();
      if (generation_of(word) != seen) return word;
    }
    std::unique_lock<std::mutex> lock(sleep_mutex_);
    sleepers_.fetch_add(1);
    worker_sleeps_.fetch_add(1, std::memory_order_relaxed);
    wake_.wait(lock, [&] { return generation_of(claim_.load()) != seen; });
    sleepers_.fetch_sub(1);
    return claim_.load();
  }

  std::mutex busy_;
  PoolStats stats_;  // these four guarded by busy_
  Window window_;
  Clock::time_point solo_until_{};
  Clock::duration solo_period_ = kSoloBase;
  alignas(64) std::atomic<uint64_t> claim_{0};
  // The region: written before its claim word is published; read by a thread only after it has
  // claimed one of its chunks, so stable until that chunk is done.
  ChunkFn fn_ = nullptr;
  const void* ctx_ = nullptr;
  int64_t begin_ = 0, end_ = 0, chunk_ = 1;
  std::atomic<int64_t> participants_{1};
  alignas(64) std::atomic<int64_t> done_{0};
  alignas(64) std::mutex error_mutex_;  // apart from the words every thread reads while spinning
  std::exception_ptr error_;
  std::mutex sleep_mutex_;
  std::condition_variable wake_, finished_;
  std::atomic<int> sleepers_{0};
  std::atomic<int64_t> worker_sleeps_{0};
  std::atomic<int64_t> torch_regions_{0};
  std::atomic<bool> caller_sleeping_{false};
  std::vector<std::thread> workers_;
  bool refused_ = false;
};

// Never destroyed: its workers sleep in it until the process exits. A child of fork() has none
// of its parent's workers (fork copies one thread) and starts a pool of its own, leaving the
// copied one, whose threads do not exist there, untouched.
std::atomic<Pool*> current{nullptr};

Pool& pool() {
  static const bool made = [] {
    current.store(new Pool());
    pthread_atfork(nullptr, nullptr, [] { current.store(new Pool()); });
    return true;
  }();
  (void)made;
  return *current.load();
}

}  // namespace

void run(int64_t begin, int64_t end, int64_t grain, ChunkFn fn, const void* ctx) {
  pool().run(begin, end, grain, fn, ctx);
}

void count_torch_region() { pool().count_torch_region(); }

}  // namespace detail

Team team_for(int64_t rows, c10::ScalarType dtype) {
#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
  constexpr bool packed_bf16 = false;  // SmallBatchLinear: linear_bf16, or linear_rows on the pool
#else
  constexpr bool packed_bf16 = true;
#endif
  const bool packed = dtype == at::kHalf || (dtype == at::kBFloat16 && packed_bf16);
  return packed && rows > detail::kSmallBatch ? Team::torch : Team::pool;
}

PoolStats pool_stats() { return detail::pool().stats(); }

void end_solo() { detail::pool().end_solo(); }

}  // namespace kvserve
