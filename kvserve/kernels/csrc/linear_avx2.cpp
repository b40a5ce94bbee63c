// The small-batch bf16 linear on CPUs with AVX2 and FMA but no AVX512-BF16 (AMD Zen 2 and 3,
// Intel before Cooper Lake).
//
// Such CPUs have no bf16 arithmetic, and oneDNN's bf16 matmul there is far slower than the
// weights' read (BENCHMARKS.md). Widening bf16 to fp32 is a shift: 16 weights load as eight
// 32-bit lanes whose low halves (the even-indexed weights) shift up and whose high halves (the
// odd-indexed ones) are masked, so x is rearranged once per call into the same even / odd order.
// Every output sums its products in one order whatever the tile shape, so a row's result does not
// depend on how many rows ride with it.
//
// Weights come as [N, K] rows or interleaved, [N / 8, K / 16, 8, 16] (cpu_linear.py stores them
// so): each group of eight rows in blocks of 16 weights, the eight rows' blocks side by side. A
// one-row step reads eight rows at once; in rows of a few KB that is eight short streams, which
// the hardware prefetchers follow poorly (~18 GB/s of the ~30 two cores read), where the
// interleaved group is one stream (~23 GB/s; BENCHMARKS.md).
#include "cpu_ops.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)
namespace {

inline void widen(const c10::BFloat16* p, __m256& even, __m256& odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Where row j's 16 weights from k on sit, from the first row of its group: rows [N, K] (rs = K,
// ks = 16) or interleaved (rs = 16, ks = 128).
struct Layout {
  int64_t rs, ks;
  const c10::BFloat16* at(const c10::BFloat16* w, int64_t j, int64_t k) const { return w + j * rs + k / 16 * ks; }
  bool interleaved() const { return rs == 16; }
};

// Adds to sums the products of weights [k0, k1): MR rows of x (fp32, even / odd order) against NR
// weight rows. Each sum takes its 8 even, then its 8 odd products of every 16 weights, k in
// order: the same order in every tile shape, layout and pass, so a row's result does not depend
// on the rows beside it.
template <int MR, int NR>
inline void accumulate(__m256 (&sums)[MR][NR], const float* xs, const c10::BFloat16* w, Layout L, int64_t k0,
                       int64_t k1, int64_t K) {
  __m256 acc[MR][NR];  // in registers across the loop
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = sums[i][j];
  for (int64_t k = k0; k < k1; k += 16) {
    // The rows 64 ahead into L2, as the AVX512 kernel does: enough misses in flight.
    if ((k & 31) == 0)
      for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(L.at(w + 64 * K, j, k)), _MM_HINT_T1);
    __m256 we[NR], wo[NR];
    for (int j = 0; j < NR; ++j) widen(L.at(w, j, k), we[j], wo[j]);
    for (int i = 0; i < MR; ++i) {
      const __m256 xe = _mm256_loadu_ps(xs + i * K + k), xo = _mm256_loadu_ps(xs + i * K + k + 8);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xo, wo[j], _mm256_fmadd_ps(xe, we[j], acc[i][j]));
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) sums[i][j] = acc[i][j];
}

template <int MR, int NR>
inline void store(const __m256 (&sums)[MR][NR], const c10::BFloat16* bias, c10::BFloat16* out, int64_t N) {
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      const float b = bias ? static_cast<float>(bias[j]) : 0.f;
      out[i * N + j] = static_cast<c10::BFloat16>(hsum(sums[i][j]) + b);
    }
}

template <int MR, int NR>
inline void tile(const float* xs, const c10::BFloat16* w, Layout L, const c10::BFloat16* bias, c10::BFloat16* out,
                 int64_t K, int64_t N) {
  __m256 sums[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) sums[i][j] = _mm256_setzero_ps();
  accumulate<MR, NR>(sums, xs, w, L, 0, K, K);
  store<MR, NR>(sums, bias, out, N);
}

// MR rows against the eight rows from w in MR x 2 tiles. Interleaved, the first rows' tiles
// would each stride through the group in memory 256 bytes at a time, which the prefetchers follow
// poorly (2-8 rows: 20-29% slower than [N, K] rows); so there the four tiles take turns on chunks
// of 2 KB of the group, the next one prefetched into L1. Later rows find the group in the caches.
template <int MR>
inline void tiles_of_eight(const float* xs, const c10::BFloat16* w, Layout L, const c10::BFloat16* b,
                           c10::BFloat16* out, int64_t K, int64_t N, bool first) {
  const int64_t chunk = L.interleaved() && first ? 128 : K;  // weights of a row per turn
  __m256 sums[4][MR][2];
  for (int t = 0; t < 4; ++t)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < 2; ++j) sums[t][i][j] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    if (chunk < K)  // the group's next chunk into L1 while the tiles take this one
      for (int64_t line = 0; line < 8 * chunk * 2 / 64 && k0 + chunk < K; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(L.at(w, 0, k0 + chunk) + line * 32), _MM_HINT_T0);
    for (int t = 0; t < 4; ++t) accumulate<MR, 2>(sums[t], xs, L.at(w, 2 * t, 0), L, k0, std::min(k0 + chunk, K), K);
  }
  for (int t = 0; t < 4; ++t) store<MR, 2>(sums[t], b ? b + 2 * t : b, out + 2 * t, N);
}

// Every row of x against the weight rows [n, n + cols) from w (row n's first weight), cols 8, 4
// or 1; those rows stay in L1 across the row tiles. Tiles of 4 x 2 keep eight sums in flight (the
// FMA units' latency times their width); a last two or three rows take 2 x 2 tiles, and a last
// one row a 1 x cols tile: at one row (a decode step) eight weight rows stream at once.
void columns(const float* xs, const c10::BFloat16* w, Layout L, const c10::BFloat16* b, c10::BFloat16* out,
             int64_t M, int64_t K, int64_t N, int64_t cols) {
  int64_t m = 0;
  if (cols == 1) {
    for (; m < M; ++m) tile<1, 1>(xs + m * K, w, L, b, out + m * N, K, N);
    return;
  }
  if (cols == 8) {
    for (; m + 4 <= M; m += 4) tiles_of_eight<4>(xs + m * K, w, L, b, out + m * N, K, N, m == 0);
    if (M - m >= 2) tiles_of_eight<2>(xs + m * K, w, L, b, out + m * N, K, N, m == 0), m += 2;
    if (m < M) tile<1, 8>(xs + m * K, w, L, b, out + m * N, K, N);
    return;
  }
  for (; m + 4 <= M; m += 4)
    for (int64_t j = 0; j < cols; j += 2) tile<4, 2>(xs + m * K, L.at(w, j, 0), L, b ? b + j : b, out + m * N + j, K, N);
  if (M - m >= 2) {
    for (int64_t j = 0; j < cols; j += 2) tile<2, 2>(xs + m * K, L.at(w, j, 0), L, b ? b + j : b, out + m * N + j, K, N);
    m += 2;
  }
  if (m < M) tile<1, 4>(xs + m * K, w, L, b, out + m * N, K, N);
}

}  // namespace

void linear_avx2(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  const bool interleaved = w.dim() == 4;
  const Layout L = interleaved ? Layout{16, 128} : Layout{K, 16};
  const auto* xd = x.data_ptr<c10::BFloat16>();
  std::vector<float> xs(M * K);
  for (int64_t i = 0; i < M * K; i += 16) {
    __m256 even, odd;
    widen(xd + i, even, odd);
    _mm256_storeu_ps(xs.data() + i, even);
    _mm256_storeu_ps(xs.data() + i + 8, odd);
  }
  const auto* wd = w.data_ptr<c10::BFloat16>();
  const c10::BFloat16* bd = bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr;
  auto* od = out.data_ptr<c10::BFloat16>();
  const int64_t groups = N / 8;
  // Rows in blocks whose fp32 copy stays in L2 while every column group passes over it.
  constexpr int64_t kRowBlock = 64;
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
    const int64_t rows = std::min(kRowBlock, M - m0);
    const float* xb = xs.data() + m0 * K;
    c10::BFloat16* ob = od + m0 * N;
    // A group of eight rows takes 8 * K weights in either layout.
    auto run = [&](int64_t n, int64_t cols) {
      columns(xb, wd + n * K, L, bd ? bd + n : nullptr, ob + n, rows, K, N, cols);
    };
    at::parallel_for(0, groups, 8, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) run(g * 8, 8);
    });
    int64_t n = groups * 8;  // interleaved weights have no rows past the groups
    if (N - n >= 4) run(n, 4), n += 4;
    for (; n < N; ++n) run(n, 1);
  }
}
#endif
