// The small-batch bf16 linear on CPUs with AVX2 and FMA but no AVX512-BF16 (AMD Zen 2 and 3,
// Intel before Cooper Lake).
//
// Such CPUs have no bf16 arithmetic, and oneDNN's bf16 matmul there is far slower than the
// weights' read (BENCHMARKS.md). Widening bf16 to fp32 is a shift or a mask: weights are stored
// interleaved, [ceil(N / 16), K / 2, 16, 2] (cpu_linear.py stores them so, zero rows padding N):
// each group of 16 rows in pairs of k, so the 64 bytes at one pair are one cache line holding
// the 16 rows' weights at k and k + 1; per half of the group, a shift gives the eight at k as
// fp32, a mask the eight at k + 1. Each is multiplied by x[m, k] broadcast, as a GEMM
// micro-kernel does: every output lane sums its products in k order, with no horizontal sums, so
// a row's result does not depend on the rows or threads beside it.
//
// Why this shape (BENCHMARKS.md): dot products along k with 8-lane partial sums reached ~38
// GFLOP/s of a core's ~96 at 8-32 rows (two dependent FMAs per sum and a horizontal sum per
// output); 4-row tiles of broadcasts against a group reach ~78. A group is one contiguous
// stream, which the prefetchers follow (separate weight rows of 1-3 KB they did not); a one-row
// step reads two groups at a time.
#include "cpu_ops.h"
#include "thread_pool.h"

#include <immintrin.h>

#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)
namespace {

// The sums of up to 4 rows against a group's two halves (or of one row against two groups),
// named: GCC kept an array of them in memory and stored every sum on every k (a third of the
// speed). With the two weights, x and the mask they fill 12 of the 16 registers; 4 rows x 24
// outputs spilled.
struct Sums {
  __m256 s00, s01, s10, s11, s20, s21, s30, s31;
};

// The eight weights at k (half 0) or k + 1 (half 1) of eight rows, from their 32 bytes at a pair.
template <int kHalf>
__attribute__((always_inline)) inline __m256 widen(const c10::BFloat16* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_castsi256_ps(kHalf == 0 ? _mm256_slli_epi32(v, 16)
                                        : _mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// (a0, a1) += x * (w0, w1), x broadcast.
__attribute__((always_inline)) inline void fma2(__m256& a0, __m256& a1, const float* x, __m256 w0, __m256 w1) {
  const __m256 b = _mm256_broadcast_ss(x);
  a0 = _mm256_fmadd_ps(b, w0, a0);
  a1 = _mm256_fmadd_ps(b, w1, a1);
}

// Row i's sums += x[i, k + kHalf] * the group's weights there; with NG = 2 (one row), also the
// next group's into s10, s11: a one-row tile keeps four sums in flight, not two.
template <int MR, int NG, int kHalf>
__attribute__((always_inline)) inline void madd(Sums& s, const float* x, int64_t K, const c10::BFloat16* p,
                                                int64_t group) {
  const __m256 w0 = widen<kHalf>(p), w1 = widen<kHalf>(p + 16);
  fma2(s.s00, s.s01, x, w0, w1);
  if constexpr (MR > 1) fma2(s.s10, s.s11, x + K, w0, w1);
  if constexpr (MR > 2) fma2(s.s20, s.s21, x + 2 * K, w0, w1);
  if constexpr (MR > 3) fma2(s.s30, s.s31, x + 3 * K, w0, w1);
  if constexpr (NG > 1) fma2(s.s10, s.s11, x, widen<kHalf>(p + group), widen<kHalf>(p + group + 16));
}

// MR rows of x (fp32 [., K]) against NG groups of 16 weight rows from w (NG = 2 for one row
// only); the results, plus the first nb entries of bias (padding rows have none), into out as
// bf16. Each output sums its products in k order in every tile shape. The first row tile reads
// the groups from memory and prefetches them; later ones find them in the caches, where the
// prefetches cost a third of the tile's speed (BENCHMARKS.md).
template <int MR, int NG, bool kFirst>
void tile(const float* x, const c10::BFloat16* w, const c10::BFloat16* bias, int64_t nb, c10::BFloat16* out,
          int64_t K, int64_t N) {
  static_assert(NG == 1 || MR == 1, "two groups share the sums of rows 0 and 1");
  const int64_t group = 16 * K;  // weights in a group
  const __m256 zero = _mm256_setzero_ps();
  Sums s{zero, zero, zero, zero, zero, zero, zero, zero};
  for (int64_t k = 0; k < K; k += 2) {
    const c10::BFloat16* p = w + k * 16;
    if (kFirst) {  // 1 KB ahead
      _mm_prefetch(reinterpret_cast<const char*>(p + 512), _MM_HINT_T0);
      if constexpr (NG > 1) _mm_prefetch(reinterpret_cast<const char*>(p + group + 512), _MM_HINT_T0);
    }
    madd<MR, NG, 0>(s, x + k, K, p, group);
    madd<MR, NG, 1>(s, x + k + 1, K, p, group);
  }
  alignas(32) float sums[4][16];
  const __m256 all[4][2] = {{s.s00, s.s01}, {s.s10, s.s11}, {s.s20, s.s21}, {s.s30, s.s31}};
  for (int i = 0; i < MR * NG; ++i) {
    _mm256_store_ps(sums[i], all[i][0]);
    _mm256_store_ps(sums[i] + 8, all[i][1]);
  }
  for (int i = 0; i < MR; ++i)
    for (int64_t n = 0; n < 16 * NG; ++n)
      out[i * N + n] = static_cast<c10::BFloat16>(sums[i + n / 16][n % 16] + (n < nb ? static_cast<float>(bias[n]) : 0.f));
}

// Every row of x against the group at w: tiles of four rows, then the last one to three.
void rows(const float* x, const c10::BFloat16* w, const c10::BFloat16* bias, int64_t nb, c10::BFloat16* out,
          int64_t M, int64_t K, int64_t N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) (m == 0 ? tile<4, 1, true> : tile<4, 1, false>)(x + m * K, w, bias, nb, out + m * N, K, N);
  const int64_t left = M - m;
  const bool first = m == 0;
  if (left == 3) (first ? tile<3, 1, true> : tile<3, 1, false>)(x + m * K, w, bias, nb, out + m * N, K, N);
  if (left == 2) (first ? tile<2, 1, true> : tile<2, 1, false>)(x + m * K, w, bias, nb, out + m * N, K, N);
  if (left == 1) (first ? tile<1, 1, true> : tile<1, 1, false>)(x + m * K, w, bias, nb, out + m * N, K, N);
}

}  // namespace

void linear_avx2(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), G = w.size(0);
  const auto* xd = x.data_ptr<c10::BFloat16>();
  std::vector<float> xs(M * K);
  kvserve::parallel_for(0, M * K, 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) xs[i] = static_cast<float>(xd[i]);
  });
  const auto* wd = w.data_ptr<c10::BFloat16>();
  const c10::BFloat16* bd = bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr;
  const int64_t nb = bias.has_value() ? bias->numel() : 0;
  auto* od = out.data_ptr<c10::BFloat16>();
  if (M == 1) {  // a decode step of one stream: groups two at a time
    kvserve::parallel_for(0, (G + 1) / 2, 2, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t g = 2 * t, n = g * 16;
        (g + 1 < G ? tile<1, 2, true> : tile<1, 1, true>)(xs.data(), wd + n * K, bd ? bd + n : nullptr, nb - n,
                                                          od + n, K, N);
      }
    });
    return;
  }
  kvserve::parallel_for(0, G, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n = g * 16;
      rows(xs.data(), wd + n * K, bd ? bd + n : nullptr, nb - n, od + n, M, K, N);
    }
  });
}
#endif
