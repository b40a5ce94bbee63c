// The fp32 linear whose rows never depend on their batch (cpu_linear.py, InvariantLinear).
//
// MKL's sgemm sums a row's products in an order that depends on the row count: on an AVX-512
// Xeon, rows of 1-15 rows (decode steps) and of 57-61 differed from the same rows in a larger
// call by up to 6e-5, so a request's fp32 logits moved with its batch, its chunking and a prefix
// hit (BENCHMARKS.md). Here, as in linear_avx2.cpp, the weights are stored in groups of 16 output
// rows with each k's 16 weights side by side, [ceil(N / 16), K, 16] (zero rows pad N), and each
// output lane sums x[m, k] * w[n, k] with one fused multiply-add per k in k order, then adds the
// bias: the same operations for every row count, tile shape, thread and instruction set (the
// one-lane build's fmadd is std::fma).
#include "cpu_ops.h"
#include "simd.h"
#include "thread_pool.h"

#include <algorithm>

namespace {

using simd::vf;
constexpr int kGroup = 16;                          // outputs per weight group
constexpr int kVectors = kGroup / simd::kLanes;     // vectors per group
// A tile's sums stay in registers with its weights and a broadcast: AVX-512, 6 rows x 2 groups =
// 12 sums of 32 registers; AVX2, 4 rows x 1 group of 2 vectors = 8 of 16. Each broadcast of x
// feeds 2 FMAs and each weight vector 4-6: a prefill's tiles are bound by the FMA units, a
// decode step's (one row) by the weights' read.
constexpr int kRows = simd::kLanes == 16 ? 6 : 4;
constexpr int kGroups = simd::kLanes == 16 ? 2 : 1;  // weight groups per tile
// Rows per pass over a chunk's groups: the pass's rows of x (48 x K floats) stay in the cache
// while every group of the chunk reads them.
constexpr int64_t kRowBlock = 48;

// Rows [0, MR) of x against groups [g0, g0 + NG) of w, into out [., N] (+ bias).
template <int MR, int NG>
void tile(const float* x, int64_t K, const float* w, int64_t g0, const float* bias, int64_t nb, float* out,
          int64_t N) {
  vf acc[MR][NG * kVectors];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NG * kVectors; ++v) acc[i][v] = simd::zero();
  for (int64_t k = 0; k < K; ++k) {
    vf wv[NG * kVectors];
    for (int g = 0; g < NG; ++g)
      for (int v = 0; v < kVectors; ++v)
        wv[g * kVectors + v] = simd::load(w + ((g0 + g) * K + k) * kGroup + v * simd::kLanes);
    for (int i = 0; i < MR; ++i) {
      const vf xv = simd::set1(x[i * K + k]);
      for (int v = 0; v < NG * kVectors; ++v) acc[i][v] = simd::fmadd(xv, wv[v], acc[i][v]);
    }
  }
  alignas(64) float sums[kGroup];
  for (int i = 0; i < MR; ++i)
    for (int g = 0; g < NG; ++g) {
      for (int v = 0; v < kVectors; ++v) simd::store(sums + v * simd::kLanes, acc[i][g * kVectors + v]);
      const int64_t n0 = (g0 + g) * kGroup;
      for (int j = 0; j < kGroup; ++j) out[i * N + n0 + j] = sums[j] + (n0 + j < nb ? bias[n0 + j] : 0.f);
    }
}

// Every row of x against groups [g0, g0 + NG): tiles of kRows rows, then the rest one row-count
// template at a time (each row's sums are the same in any of them).
template <int NG>
void rows(const float* x, int64_t M, int64_t K, const float* w, int64_t g0, const float* bias, int64_t nb,
          float* out, int64_t N) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) tile<kRows, NG>(x + m * K, K, w, g0, bias, nb, out + m * N, N);
  switch (M - m) {
    case 5: tile<5, NG>(x + m * K, K, w, g0, bias, nb, out + m * N, N); break;
    case 4: tile<4, NG>(x + m * K, K, w, g0, bias, nb, out + m * N, N); break;
    case 3: tile<3, NG>(x + m * K, K, w, g0, bias, nb, out + m * N, N); break;
    case 2: tile<2, NG>(x + m * K, K, w, g0, bias, nb, out + m * N, N); break;
    case 1: tile<1, NG>(x + m * K, K, w, g0, bias, nb, out + m * N, N); break;
    default: break;
  }
}

}  // namespace

// out [M, 16 * G] = x [M, K] @ w^T (+ bias), w [G, K, 16] fp32 (cpu_linear.interleave_f32).
at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "linear_f32: fp32 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "linear_f32: x must be contiguous [M, K]");
  TORCH_CHECK(w.dim() == 3 && w.size(2) == kGroup && w.is_contiguous() && w.size(1) == x.size(1),
              "linear_f32: w must be contiguous [ceil(N / 16), K, 16] (cpu_linear.interleave_f32)");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->dim() == 1),
              "linear_f32: the bias must be a contiguous fp32 vector");
  const int64_t M = x.size(0), K = x.size(1), G = w.size(0), N = G * kGroup;
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xd = x.data_ptr<float>();
  const float* wd = w.data_ptr<float>();
  const float* bd = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const int64_t nb = bias.has_value() ? bias->numel() : 0;
  float* od = out.data_ptr<float>();
  const int64_t tiles = (G + kGroups - 1) / kGroups;
  kvserve::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = 0; m < M; m += kRowBlock) {
      const int64_t rows_here = std::min(kRowBlock, M - m);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t g0 = t * kGroups;
        if (g0 + kGroups <= G) rows<kGroups>(xd + m * K, rows_here, K, wd, g0, bd, nb, od + m * N, N);
        else rows<1>(xd + m * K, rows_here, K, wd, g0, bd, nb, od + m * N, N);
      }
    }
  });
  return out;
}
