// A prefill's linear (more rows than linear_bf16 takes) on the kernels' pool: the output columns in
// chunks, each chunk one oneDNN matmul on the one thread that claimed it.
//
// oneDNN runs a matmul on torch's OpenMP team, and each call ends at a barrier that waits for
// every thread of it. On a machine shared with other work one of the team is often off its core,
// so each of a prefill's ~120 matmuls waited for it to be scheduled again: a 512-token prefill
// beside two OpenMP neighbours took 1.81x its fair share of the cores (BENCHMARKS.md, issue 38).
// In the pool a thread that is off its core leaves its chunks to the others. The output columns
// are split, not the rows, so the weight is reformatted (oneDNN's on-the-fly reorder) once per
// call in all, as before, and not once per chunk.
#include "cpu_ops.h"
#include "thread_pool.h"

#include <ATen/ThreadLocalState.h>
#include <omp.h>

#include <algorithm>
#include <utility>

namespace {

// Work items are this many output columns (weight rows): each chunk reformats only its own slice
// of the weight, once per call. 16, so chunks split evenly: at 64 a 576-column projection made
// three chunks, and one of two threads ran two of them (1.2-1.4x the time of torch's team).
constexpr int64_t kColumnBlock = 16;

// oneDNN sizes its team from omp_get_max_threads(), an ICV of the calling thread: one thread here,
// restored after, so a chunk never opens an OpenMP team of its own inside the pool's region.
class OneThread {
 public:
  OneThread() : saved_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~OneThread() { omp_set_num_threads(saved_); }
  OneThread(const OneThread&) = delete;
  OneThread& operator=(const OneThread&) = delete;

 private:
  int saved_;
};

}  // namespace

at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                       int64_t row_bucket) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear_rows: x [M, K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "linear_rows: x and w of one dtype");
  TORCH_CHECK(row_bucket > 0, "linear_rows: row_bucket must be positive, got ", row_bucket);
  const int64_t M = x.size(0), N = w.size(0);
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  const int64_t bulk = M / row_bucket * row_bucket;
  // The ops below go through the dispatcher on the pool's threads, which must see the caller's
  // inference mode, grad mode and dispatch keys (as at::parallel_for's threads do).
  const at::ThreadLocalState caller_state;
  kvserve::parallel_for(0, (N + kColumnBlock - 1) / kColumnBlock, 1, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard state(caller_state);
    const OneThread one;
    const int64_t col = begin * kColumnBlock, cols = std::min(end * kColumnBlock, N) - col;
    const at::Tensor wt = w.narrow(0, col, cols).t();
    for (const auto& [row, rows] : {std::pair<int64_t, int64_t>{0, bulk}, {bulk, M - bulk}}) {
      if (rows == 0) continue;
      at::Tensor part = out.narrow(0, row, rows).narrow(1, col, cols);
      if (bias.has_value()) at::addmm_out(part, bias->narrow(0, col, cols), xc.narrow(0, row, rows), wt);
      else at::mm_out(part, xc.narrow(0, row, rows), wt);
    }
  });
  return out;
}
