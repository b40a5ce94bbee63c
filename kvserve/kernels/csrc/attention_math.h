// The attention loop's arithmetic on one block: scores of a query row against keys (fp32 dot
// products, or bf16 pair dot products where the CPU has them), the online softmax's exponentials,
// and the weighted values' accumulation into a row's sums (paged_attention.cpp).
#pragma once

#include "simd.h"
#include "value_types.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

namespace cpu_kernels {

// s[t] = exp(s[t] - mx) for t < n; returns their sum.
inline float exp_sub_sum(float* s, int64_t n, float mx) {
  using namespace simd;
  vf acc = zero();
  const vf m = set1(mx);
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) {
    const vf e = exp_neg(sub(load(s + t), m));
    store(s + t, e);
    acc = add(acc, e);
  }
  if (t < n) {  // masked loads and stores only for the tail: they cost more on AMD cores
    const vf e = exp_neg(sub(load_first(s + t, n - t), m));
    store_first(s + t, e, n - t);
    acc = add(acc, keep_first(e, n - t, 0.f));
  }
  return reduce_add(acc);
}

// s[t] = q . k[t] for t < n (n >= 1); returns their max. With D a multiple of the vector width,
// that many keys at a time; past the last key a tile re-reads that key (never past the rows
// given) and drops the sums.
template <typename R>
inline float dots(const float* q, Rows<R> k, int64_t n, int64_t D, float* s) {
  using namespace simd;
  if (kLanes > 1 && D % kLanes == 0) {
    vf mx = set1(-std::numeric_limits<float>::infinity());
    for (int64_t t0 = 0; t0 < n; t0 += kLanes) {
      const int64_t left = std::min<int64_t>(kLanes, n - t0);
      const R* row[kLanes];
      for (int t = 0; t < kLanes; ++t) row[t] = k.base + (t0 + std::min<int64_t>(t, left - 1)) * k.stride;
      vf acc[kLanes];
      for (int t = 0; t < kLanes; ++t) acc[t] = zero();
      for (int64_t d = 0; d < D; d += kLanes) {
        const vf qv = load(q + d);
        for (int t = 0; t < kLanes; ++t) acc[t] = fmadd(qv, load(row[t] + d), acc[t]);
      }
      const vf st = transpose_sums(acc);
      if (left == kLanes) {
        store(s + t0, st);
        mx = max(mx, st);
      } else {
        store_first(s + t0, st, left);
        mx = max(mx, keep_first(st, left, -std::numeric_limits<float>::infinity()));
      }
    }
    return reduce_max(mx);
  }
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) {
    float acc = 0.f;
    for (int64_t d = 0; d < D; ++d) acc += q[d] * to_f(k.base[t * k.stride + d]);
    mx = std::max(mx, s[t] = acc);
  }
  return mx;
}

#if defined(__AVX512BF16__)
// bf16 keys are scored against a bf16 query by pair dot products (vdpbf16ps: two exact products
// of a channel pair added to an fp32 sum, no widening) with the keys' channel pairs transposed, 16
// keys a tile: one instruction adds a pair to 16 keys' sums. Every key's sum then runs through
// the pairs in the same order whichever item and row asks, so a decode and a prompt's rows get
// the same scores, bit for bit (whole outputs too, unless one of them is a split item: a decode
// over more than split_blocks blocks merges its pieces' sums in another order); and no row sums
// across lanes (`dots` transposes 16 sums for every row, and a prompt item's 30-odd rows each did
// that for every key). vdpbf16ps reads subnormals as zero; queries and keys are never that small.

// out[j] = lane j of every r[i] (a 16 x 16 transpose of 32-bit lanes).
inline void transpose16(const __m512i* r, __m512i* out) {
  __m512i t[16], u[16], v[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm512_shuffle_i32x4(u[i], u[4 + i], 0x88);
    v[4 + i] = _mm512_shuffle_i32x4(u[i], u[4 + i], 0xdd);
    v[8 + i] = _mm512_shuffle_i32x4(u[8 + i], u[12 + i], 0x88);
    v[12 + i] = _mm512_shuffle_i32x4(u[8 + i], u[12 + i], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    out[i] = _mm512_shuffle_i32x4(v[i], v[8 + i], 0x88);
    out[8 + i] = _mm512_shuffle_i32x4(v[i], v[8 + i], 0xdd);
  }
}

// kT[(tile * D / 2 + p) * 16 + lane] = channel pair p of key 16 * tile + lane, for n keys (D a
// multiple of 32); lanes past the last key repeat it.
inline void transpose_pairs(Rows<c10::BFloat16> k, int64_t n, int64_t D, uint32_t* kT) {
  for (int64_t t0 = 0, tile = 0; t0 < n; t0 += 16, ++tile) {
    const int64_t left = std::min<int64_t>(16, n - t0);
    for (int64_t p0 = 0; p0 < D / 2; p0 += 16) {
      __m512i r[16], out[16];
      for (int i = 0; i < 16; ++i)
        r[i] = _mm512_loadu_si512(k.base + (t0 + std::min<int64_t>(i, left - 1)) * k.stride + 2 * p0);
      transpose16(r, out);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(kT + (tile * D / 2 + p0 + j) * 16, out[j]);
    }
  }
}

// Row i of R query rows (q + i * D) scored against keys [t0, t1[i]) of transpose_pairs' kT (t0 a
// multiple of 16): s[i * s_stride + t - t0] = scale * (q_i . k[t]), tops[i] their max. Four sums
// per key, pairs taken round-robin, so that four pair dot products are in flight rather than one
// chain; each row's sums take the same operations whatever R is (the same bits), while the rows
// share each load of the keys and their chains overlap.
template <int R>
inline void pair_scores(const c10::BFloat16* q, const uint32_t* kT, int64_t t0, const int64_t* t1, int64_t D,
                        float scale, float* s, int64_t s_stride, float* tops) {
  const __m512 sc = _mm512_set1_ps(scale);
  __m512 mx[R];
  int64_t end = t0;
  for (int i = 0; i < R; ++i) {
    mx[i] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    end = std::max(end, t1[i]);
  }
  for (int64_t a = t0; a < end; a += 16) {
    const uint32_t* tile = kT + a / 16 * (D / 2) * 16;
    __m512 acc[R][4];
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < D / 2; p += 4)
      for (int j = 0; j < 4; ++j) {
        const __m512bh k = (__m512bh)_mm512_loadu_si512(tile + (p + j) * 16);
        for (int i = 0; i < R; ++i) {
          uint32_t pair;
          std::memcpy(&pair, q + i * D + 2 * (p + j), sizeof pair);
          acc[i][j] = _mm512_dpbf16_ps(acc[i][j], k, (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pair)));
        }
      }
    for (int i = 0; i < R; ++i) {
      const __m512 st = _mm512_mul_ps(
          _mm512_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]), _mm512_add_ps(acc[i][2], acc[i][3])), sc);
      const int64_t left = std::clamp<int64_t>(t1[i] - a, 0, 16);
      const __mmask16 keep = static_cast<__mmask16>((1u << left) - 1);
      _mm512_mask_storeu_ps(s + i * s_stride + (a - t0), keep, st);
      mx[i] = _mm512_mask_max_ps(mx[i], keep, mx[i], st);
    }
  }
  for (int i = 0; i < R; ++i) tops[i] = _mm512_reduce_max_ps(mx[i]);
}

// bf16 values are summed by pair dot products too, with the weights rounded to bf16 first (the
// unnormalised exp(s - running max), where HF's eager attention rounds its normalised
// probabilities to the model dtype: the same size of error, not its bits):
// vP[(i * D / 16 + c) * 16 + lane] = channel 16c + lane of keys 2i and 2i + 1, for a block's n keys
// (an odd last key is paired with itself; its partner takes weight 0). Half the instructions of
// fp32 products, and the values are never widened.
inline void pair_values(Rows<c10::BFloat16> v, int64_t n, int64_t D, uint32_t* vP) {
  // lane 2j of the result: channel j of the first key, lane 2j + 1: channel j of the second.
  alignas(64) int16_t order[32];
  for (int j = 0; j < 16; ++j) order[2 * j] = static_cast<int16_t>(j), order[2 * j + 1] = static_cast<int16_t>(32 + j);
  const __m512i idx = _mm512_load_si512(order);
  for (int64_t t = 0; t < n; t += 2) {
    const c10::BFloat16* a = v.base + t * v.stride;
    const c10::BFloat16* b = t + 1 < n ? a + v.stride : a;
    uint32_t* out = vP + t / 2 * D;
    for (int64_t c = 0; c < D; c += 16) {
      const __m512i x = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + c)));
      const __m512i y = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + c)));
      _mm512_storeu_si512(out + c, _mm512_permutex2var_epi16(x, idx, y));
    }
  }
}

// Weight t = p[t - skip] rounded to bf16 for t in [skip, skip + n), 0 for the rest of [0, len) (len
// a multiple of 16), in pairs (w[i] holds weights 2i and 2i + 1): one row's weights over a block's
// keys, the keys it does not see at 0.
inline void weights_to_pairs(const float* p, int64_t skip, int64_t n, int64_t len, uint32_t* w) {
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int64_t lo = std::clamp<int64_t>(skip - t0, 0, 16), hi = std::clamp<int64_t>(skip + n - t0, 0, 16);
    const __mmask16 keep = static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1));
    const __m512 x = _mm512_maskz_loadu_ps(keep, p + (t0 - skip));  // masked lanes are never read
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + t0 / 2), (__m256i)_mm512_cvtneps_pbh(x));
  }
}

// Rows r < NR (sums a + r * D, weights w + r * w_stride from weights_to_pairs): a = a * c[r] + the
// pair dot products of the weights' pairs [i0, i1) with pair_values' vP, CH vectors of channels
// from d0. Each row takes the same operations in the same order whatever NR is; a pair whose
// weights are both 0 adds exact zeros for finite values (0 x inf is NaN, as in the eager ops'
// product of probabilities and values), so a row summed over more pairs than it sees gets the
// same bits. The rows share each load of the values.
template <int NR, int CH>
inline void pair_accumulate_pass(float* a, const float* c, const uint32_t* w, int64_t w_stride, const uint32_t* vP,
                                 int64_t i0, int64_t i1, int64_t D, int64_t d0) {
  __m512 acc[NR][CH];
  for (int r = 0; r < NR; ++r) {
    const __m512 cv = _mm512_set1_ps(c[r]);
    for (int j = 0; j < CH; ++j) acc[r][j] = _mm512_mul_ps(_mm512_loadu_ps(a + r * D + d0 + 16 * j), cv);
  }
  for (int64_t i = i0; i < i1; ++i) {
    __m512bh wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(w[r * w_stride + i]));
    const uint32_t* x = vP + i * D + d0;
    for (int j = 0; j < CH; ++j) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + 16 * j);
      for (int r = 0; r < NR; ++r) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[r]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < CH; ++j) _mm512_storeu_ps(a + r * D + d0 + 16 * j, acc[r][j]);
}

// pair_accumulate_pass over all D channels (a multiple of 32), four vectors a pass.
template <int NR>
inline void pair_accumulate(float* a, const float* c, const uint32_t* w, int64_t w_stride, const uint32_t* vP,
                            int64_t i0, int64_t i1, int64_t D) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) pair_accumulate_pass<NR, 4>(a, c, w, w_stride, vP, i0, i1, D, d0);
  if (d0 < D) pair_accumulate_pass<NR, 2>(a, c, w, w_stride, vP, i0, i1, D, d0);
}
#endif

// a[0, C * kLanes) = a * c + sum_t p[t] * v[t]. The accumulator row stays in registers only when
// C is a compile-time constant: with a runtime count the compiler keeps it on the stack, and
// every FMA then waits on a store.
template <int C, typename R>
inline void scale_accumulate_tile(float* a, float c, const float* p, Rows<R> v, int64_t n) {
  using namespace simd;
  vf acc[C];
  const vf cv = set1(c);
  for (int j = 0; j < C; ++j) acc[j] = mul(load(a + kLanes * j), cv);
  for (int64_t t = 0; t < n; ++t) {
    const vf pt = set1(p[t]);
    for (int j = 0; j < C; ++j) acc[j] = fmadd(pt, load(v.base + t * v.stride + kLanes * j), acc[j]);
  }
  for (int j = 0; j < C; ++j) store(a + kLanes * j, acc[j]);
}

// Vectors of channels per pass of scale_accumulate_group.
constexpr int kGroupVectors = 4;

// scale_accumulate for NR query rows (a, c, p: row r at a + r * D, c[r], p + r * p_stride) that
// see the same n rows of v, as one query token's GQA group does: each value is loaded (and a
// bf16 or int8 one widened) once for all of them, where one row at a time widened it once per
// row (two of every three uops of the accumulation on AVX2). Each row's lanes take the operations
// of scale_accumulate's register tiles in their order, so where it has one the results are the
// same bits. Four vectors per pass: NR x 4 sums, NR broadcasts and the value fill 16 registers
// at NR = 3.
template <int NR, typename R>
inline void scale_accumulate_group(float* a, const float* c, const float* p, int64_t p_stride,
                                   Rows<R> v, int64_t n, int64_t D) {
  using namespace simd;
  constexpr int64_t width = kGroupVectors * kLanes;
  for (int64_t d0 = 0; d0 < D; d0 += width) {
    vf acc[NR][kGroupVectors];
    for (int r = 0; r < NR; ++r) {
      const vf cv = set1(c[r]);
      for (int j = 0; j < kGroupVectors; ++j) acc[r][j] = mul(load(a + r * D + d0 + kLanes * j), cv);
    }
    for (int64_t t = 0; t < n; ++t) {
      vf pt[NR];
      for (int r = 0; r < NR; ++r) pt[r] = set1(p[r * p_stride + t]);
      const R* row = v.base + t * v.stride + d0;
      for (int j = 0; j < kGroupVectors; ++j) {
        const vf x = load(row + kLanes * j);
        for (int r = 0; r < NR; ++r) acc[r][j] = fmadd(pt[r], x, acc[r][j]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < kGroupVectors; ++j) store(a + r * D + d0 + kLanes * j, acc[r][j]);
  }
}

// Whether scale_accumulate_group takes rows of head dim D.
constexpr bool groups_accumulate(int64_t D) { return simd::kLanes > 1 && D % (kGroupVectors * simd::kLanes) == 0; }

// a = a * c + sum_t p[t] * v[t]  over n rows of v.
template <typename R>
inline void scale_accumulate(float* a, float c, const float* p, Rows<R> v, int64_t n, int64_t D) {
  using simd::kLanes;
  // A tile's sums, its broadcast weight and the value it loads must fit in the registers.
  constexpr bool fits128 = 128 / kLanes + 2 <= simd::kRegisters;
  if (kLanes > 1) {
    switch (D) {
      case 32: return scale_accumulate_tile<32 / kLanes>(a, c, p, v, n);
      case 64: return scale_accumulate_tile<64 / kLanes>(a, c, p, v, n);
      case 96: return scale_accumulate_tile<96 / kLanes>(a, c, p, v, n);
      case 128:
        if constexpr (fits128) return scale_accumulate_tile<128 / kLanes>(a, c, p, v, n);
        break;
      default: break;
    }
  }
  for (int64_t d = 0; d < D; ++d) a[d] *= c;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t d = 0; d < D; ++d) a[d] += p[t] * to_f(v.base[t * v.stride + d]);
}

}  // namespace cpu_kernels
