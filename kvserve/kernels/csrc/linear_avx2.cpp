// The small-batch bf16 linear on CPUs with AVX2 and FMA but no AVX512-BF16 (AMD Zen 2 and 3,
// Intel before Cooper Lake).
//
// Such CPUs have no bf16 arithmetic, and oneDNN's bf16 matmul there is far slower than the
// weights' read (BENCHMARKS.md). Widening bf16 to fp32 is a shift or a mask: weights are stored
// interleaved, [ceil(N / 8), K / 2, 8, 2] (cpu_linear.py stores them so, zero rows padding N), each group of eight rows in
// pairs of k, so one 32-byte load holds eight rows' weights at k and k + 1; a shift gives the
// eight at k as fp32, a mask the eight at k + 1. Each is multiplied by x[m, k] broadcast, as a
// GEMM micro-kernel does: every output lane sums its products in k order, with no horizontal
// sums, and a row's result does not depend on the rows or threads beside it.
//
// Why this shape (BENCHMARKS.md): dot products along k with 8-lane partial sums reached ~38
// GFLOP/s of a core's ~96 at 8-32 rows (two dependent FMAs per sum and a horizontal sum per
// output); 4 x 2 tiles of broadcasts reach ~60. At one row, a group of eight rows is one
// contiguous stream, which the prefetchers follow (eight separate rows of 1-3 KB they did not).
#include "cpu_ops.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)
namespace {

// Groups of eight weight rows per tile: 4 x 2 sums, 2 weights, x and the mask fit the 16
// registers; 4 x 3 spilled sums to the stack (~45 GFLOP/s a core against ~63).
constexpr int64_t kGroups = 2;

// MR rows of x (fp32 [., K]) against NG groups of eight weight rows from w (the first group's
// first pair); the results, plus the first nb entries of bias (padding rows have none), into out
// as bf16. The first row tile reads the groups from memory and prefetches them; later ones find
// them in the caches, where the prefetches cost a third of the tile's speed (BENCHMARKS.md).
// Inlined: as a function of its own, GCC kept the sums in memory and stored them on every k.
template <int MR, int NG, bool kFirst>
__attribute__((always_inline)) inline void tile(const float* x, const c10::BFloat16* w, const c10::BFloat16* bias, int64_t nb, c10::BFloat16* out,
          int64_t K, int64_t N) {
  const int64_t group = 8 * K;  // weights in a group
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[MR][NG];
  for (int i = 0; i < MR; ++i)
    for (int g = 0; g < NG; ++g) acc[i][g] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    const c10::BFloat16* p = w + k * 8;
    // 1 KB ahead in each group's stream: at one row the groups are read once, from memory.
    if (kFirst && (k & 3) == 0)
      for (int g = 0; g < NG; ++g) _mm_prefetch(reinterpret_cast<const char*>(p + g * group + 512), _MM_HINT_T0);
    __m256 wk[NG];
    for (int g = 0; g < NG; ++g)
      wk[g] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + g * group)), 16));
    for (int i = 0; i < MR; ++i) {
      const __m256 b = _mm256_broadcast_ss(x + i * K + k);
      for (int g = 0; g < NG; ++g) acc[i][g] = _mm256_fmadd_ps(b, wk[g], acc[i][g]);
    }
    for (int g = 0; g < NG; ++g)
      wk[g] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + g * group)), high));
    for (int i = 0; i < MR; ++i) {
      const __m256 b = _mm256_broadcast_ss(x + i * K + k + 1);
      for (int g = 0; g < NG; ++g) acc[i][g] = _mm256_fmadd_ps(b, wk[g], acc[i][g]);
    }
  }
  alignas(32) float sums[MR][NG][8];
  for (int i = 0; i < MR; ++i)
    for (int g = 0; g < NG; ++g) _mm256_store_ps(sums[i][g], acc[i][g]);
  for (int i = 0; i < MR; ++i)
    for (int64_t n = 0; n < NG * 8; ++n)
      out[i * N + n] = static_cast<c10::BFloat16>(sums[i][n / 8][n % 8] + (n < nb ? static_cast<float>(bias[n]) : 0.f));
}

template <int MR, bool kFirst>
void tile_groups(int64_t groups, const float* x, const c10::BFloat16* w, const c10::BFloat16* bias, int64_t nb,
                 c10::BFloat16* out, int64_t K, int64_t N) {
  if (groups == 2) return tile<MR, 2, kFirst>(x, w, bias, nb, out, K, N);
  tile<MR, 1, kFirst>(x, w, bias, nb, out, K, N);
}

// Every row of x against `groups` groups from w: tiles of four rows, then the last one to three.
void rows(const float* x, const c10::BFloat16* w, const c10::BFloat16* bias, int64_t nb, c10::BFloat16* out,
          int64_t M, int64_t K, int64_t N, int64_t groups) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4)
    (m == 0 ? tile_groups<4, true> : tile_groups<4, false>)(groups, x + m * K, w, bias, nb, out + m * N, K, N);
  const int64_t left = M - m;
  const bool first = m == 0;
  if (left == 3) (first ? tile_groups<3, true> : tile_groups<3, false>)(groups, x + m * K, w, bias, nb, out + m * N, K, N);
  if (left == 2) (first ? tile_groups<2, true> : tile_groups<2, false>)(groups, x + m * K, w, bias, nb, out + m * N, K, N);
  if (left == 1) (first ? tile_groups<1, true> : tile_groups<1, false>)(groups, x + m * K, w, bias, nb, out + m * N, K, N);
}

}  // namespace

void linear_avx2(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), G = w.size(0);
  const auto* xd = x.data_ptr<c10::BFloat16>();
  std::vector<float> xs(M * K);
  for (int64_t i = 0; i < M * K; ++i) xs[i] = static_cast<float>(xd[i]);
  const auto* wd = w.data_ptr<c10::BFloat16>();
  const c10::BFloat16* bd = bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr;
  const int64_t nb = bias.has_value() ? bias->numel() : 0;
  auto* od = out.data_ptr<c10::BFloat16>();
  const int64_t tiles = (G + kGroups - 1) / kGroups;
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t g = t * kGroups, n = g * 8;
      rows(xs.data(), wd + n * K, bd ? bd + n : nullptr, nb - n, od + n, M, K, N, std::min(kGroups, G - g));
    }
  });
}
#endif
