// The kernels' own thread pool, for a machine shared with other work.
//
// at::parallel_for runs on OpenMP: a region splits its range once among the team and ends at a
// barrier that waits for every thread, and a thread between regions spins (GNU OpenMP: 300,000
// iterations by default) before it sleeps. A decode step runs ~150 short regions. On a busy
// machine one of the team is often off its core, so each region waited for it to be scheduled
// again, and the spinners ate the time slices of the threads they waited for: a 48-token decode
// beside six busy processes on 2 cores took 28 s where its fair share of the cores was 3
// (BENCHMARKS.md, benchmarks/shared_machine.py).
//
// Here the calling thread works too, and every thread claims chunks of the range one at a time:
// the caller waits only for chunks another thread has claimed and not finished, never for a
// worker that has not woken up (the caller then does its share). Workers spin a short, bounded
// time between regions (a decode step's regions come microseconds apart), then sleep (llama.cpp's
// threadpool spins, then sleeps, too). Where its workers stay starved of cores even so, the pool runs regions on the
// caller alone for a while and probes again (thread_pool.cpp, "Going solo").
#pragma once

#include <ATen/Parallel.h>
#include <c10/core/ScalarType.h>

#include <cstdint>

namespace kvserve {

// Which threads run a region: the pool's, or torch's own (at::parallel_for, OpenMP).
enum class Team { pool, torch };

// The team for a region of a step of `rows` token rows in `dtype`: torch's where oneDNN runs that
// step's linears on torch's threads (model/cpu_linear.py, PackedLinear: fp16, and bf16 on a CPU
// without our bf16 kernels, over SMALL_BATCH = 32 rows), so its regions and its matmuls share one
// team; the pool's otherwise, prefills included (a bf16 prefill's linears run on the pool too,
// linear_rows). Two teams on two cores took turns: the pool's worker spun through the matmul after
// each of its regions on the core torch's worker needed, and a 2-thread prefill lost a third of
// its speed (BENCHMARKS.md, issue 38). fp16 decode steps, whose linears oneDNN runs at every size,
// still use both.
Team team_for(int64_t rows, c10::ScalarType dtype);

// f(chunk_begin, chunk_end) over [begin, end) in contiguous chunks of at least `grain` items,
// on the calling thread and up to at::get_num_threads() - 1 workers. Runs inline when the range
// fits one chunk, inside another region, or while another thread's region holds the pool. The
// first exception a chunk throws is rethrown here, after every claimed chunk has ended.
// Team::torch runs it as at::parallel_for instead (one chunk per thread, a barrier at the end).
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f, Team team = Team::pool);

// What the pool did since the process started: regions run on several threads, the callers' time
// waiting for chunks a worker still ran (on a busy machine, mostly for a worker off its core), and
// the chunks callers and workers ran, and how often a caller or a worker gave up spinning and slept.
// torch_regions: regions handed to torch's threads (Team::torch), counted whether or not torch ran
// them on several threads. solo_periods: the times the pool found its workers starved of cores and
// ran regions on the caller alone for a while (thread_pool.cpp, kProbeRegions); solo_regions: the
// regions it ran so.
struct PoolStats {
  int64_t parallel_regions = 0, waiting_ns = 0, caller_chunks = 0, worker_chunks = 0;
  int64_t caller_sleeps = 0, worker_sleeps = 0, torch_regions = 0, solo_periods = 0, solo_regions = 0;
};
PoolStats pool_stats();
// Ends a solo period now, so that the next regions run on every thread: for a test or a benchmark
// that measures the parallel path after contention.
void end_solo();

namespace detail {
using ChunkFn = void (*)(const void* ctx, int64_t begin, int64_t end);
void run(int64_t begin, int64_t end, int64_t grain, ChunkFn fn, const void* ctx);
void count_torch_region();
}  // namespace detail

template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f, Team team) {
  if (begin >= end) return;
  if (team == Team::torch) {
    detail::count_torch_region();
    at::parallel_for(begin, end, grain, f);
    return;
  }
  detail::run(begin, end, grain,
              [](const void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); }, &f);
}

}  // namespace kvserve
