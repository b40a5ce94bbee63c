// One fp32 vector at the widest width the build targets: 16 lanes with AVX-512, 8 with AVX2 + FMA
// + F16C, and one lane (a plain float) on older x86-64. The kernels' loops are written once
// against these, so every instruction set runs the same algorithm with the same operations per
// lane (the one-lane build's softmax included: polynomial exp, not std::exp). One exception:
// with AVX512_BF16, bf16 keys are scored by pair dot products (pair_scores), in another order.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace simd {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kRegisters = 32;
using vf = __m512;

inline vf zero() { return _mm512_setzero_ps(); }
inline vf set1(float x) { return _mm512_set1_ps(x); }
inline vf load(const float* p) { return _mm512_loadu_ps(p); }
// bf16 and fp16 widen exactly, so rows read in place give the same sums as rows decoded first.
inline vf load(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline vf load(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline vf load(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// fp8 codes widen exactly through fp16: e5m2 is an fp16's top byte; e4m3 (no infinities, and
// its NaN is never stored) placed in an fp16's exponent and mantissa bits reads 2^-8 of its
// value, subnormals included, so one exact multiply by 256 restores it.
inline vf load(const c10::Float8_e5m2* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
}
inline vf load(const c10::Float8_e4m3fn* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i f = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
  return _mm512_mul_ps(_mm512_cvtph_ps(f), _mm512_set1_ps(256.f));
}
inline void store(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
inline vf magnitude(vf a) { return _mm512_abs_ps(a); }
inline vf round_nearest(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// p * 2^n for integral n in [-126, 127].
inline vf scale_pow2(vf p, vf n) { return _mm512_scalef_ps(p, n); }
// Lane-wise a < 0 ? if_negative : otherwise.
inline vf select_negative(vf a, vf if_negative, vf otherwise) {
  return _mm512_mask_mov_ps(otherwise, _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_LT_OQ), if_negative);
}
inline float reduce_add(vf a) { return _mm512_reduce_add_ps(a); }
inline float reduce_max(vf a) { return _mm512_reduce_max_ps(a); }
inline __mmask16 first(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }
// The first n lanes of v (n <= kLanes), the rest `fill`.
inline vf keep_first(vf v, int64_t n, float fill) { return _mm512_mask_mov_ps(_mm512_set1_ps(fill), first(n), v); }
inline vf load_first(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first(n), p); }
inline void store_first(float* p, vf v, int64_t n) { _mm512_mask_storeu_ps(p, first(n), v); }

// Lane i of the result: the sum of v[i]'s lanes. A transposed reduction: 45 shuffles and adds for
// 16 sums, where 16 separate horizontal sums take about three times as many.
inline vf transpose_sums(const vf* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
}

// Integer lanes, for unpacking codes.
using vi = __m512i;
inline vi iset1(int32_t x) { return _mm512_set1_epi32(x); }
inline vi iload(const int32_t* p) { return _mm512_loadu_si512(p); }
inline vi lanes() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
inline vi band(vi a, vi b) { return _mm512_and_si512(a, b); }
inline vi bor(vi a, vi b) { return _mm512_or_si512(a, b); }
inline vi shl(vi a, int n) { return _mm512_slli_epi32(a, static_cast<unsigned>(n)); }
// Lane-wise a >> n; a count past 31 gives 0.
inline vi shrv(vi a, vi n) { return _mm512_srlv_epi32(a, n); }
// Lane-wise a < b ? x : y.
inline vi select_below(vi a, int32_t b, vi x, vi y) { return _mm512_mask_mov_epi32(y, _mm512_cmplt_epi32_mask(a, _mm512_set1_epi32(b)), x); }
inline vf to_float(vi a) { return _mm512_cvtepi32_ps(a); }
inline vi bits_of(vf a) { return _mm512_castps_si512(a); }
inline vf from_bits(vi a) { return _mm512_castsi512_ps(a); }
inline vi iadd(vi a, vi b) { return _mm512_add_epi32(a, b); }
inline vi shr(vi a, int n) { return _mm512_srli_epi32(a, static_cast<unsigned>(n)); }
// The 2 * kLanes 4-bit codes of kLanes bytes (low nibble first), in order, as two vectors.
inline void nibbles(const uint8_t* bytes, vf out[2]) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)), mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
  out[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
  out[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)));
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int kLanes = 8;
constexpr int kRegisters = 16;
using vf = __m256;

inline vf zero() { return _mm256_setzero_ps(); }
inline vf set1(float x) { return _mm256_set1_ps(x); }
inline vf load(const float* p) { return _mm256_loadu_ps(p); }
inline vf load(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline vf load(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vf load(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vf load(const c10::Float8_e5m2* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_slli_epi16(b, 8));
}
inline vf load(const c10::Float8_e4m3fn* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i f = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                 _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
  return _mm256_mul_ps(_mm256_cvtph_ps(f), _mm256_set1_ps(256.f));
}
inline void store(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf max(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf fnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
inline vf magnitude(vf a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), a); }
inline vf round_nearest(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// No scalef: 2^n is built in the exponent bits.
inline vf scale_pow2(vf p, vf n) {
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2n));
}
inline vf select_negative(vf a, vf if_negative, vf otherwise) {
  return _mm256_blendv_ps(otherwise, if_negative, _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_LT_OQ));
}
inline float reduce_add(vf a) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, a);
  float sum = 0.f;
  for (float lane : lanes) sum += lane;
  return sum;
}
inline float reduce_max(vf a) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, a);
  return *std::max_element(lanes, lanes + 8);
}
inline __m256i first(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vf keep_first(vf v, int64_t n, float fill) {
  return _mm256_blendv_ps(_mm256_set1_ps(fill), v, _mm256_castsi256_ps(first(n)));
}
inline vf load_first(const float* p, int64_t n) { return _mm256_maskload_ps(p, first(n)); }
inline void store_first(float* p, vf v, int64_t n) { _mm256_maskstore_ps(p, first(n), v); }

inline vf transpose_sums(const vf* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

using vi = __m256i;
inline vi iset1(int32_t x) { return _mm256_set1_epi32(x); }
inline vi iload(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline vi lanes() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
inline vi band(vi a, vi b) { return _mm256_and_si256(a, b); }
inline vi bor(vi a, vi b) { return _mm256_or_si256(a, b); }
inline vi shl(vi a, int n) { return _mm256_slli_epi32(a, n); }
inline vi shrv(vi a, vi n) { return _mm256_srlv_epi32(a, n); }
inline vi select_below(vi a, int32_t b, vi x, vi y) { return _mm256_blendv_epi8(y, x, _mm256_cmpgt_epi32(_mm256_set1_epi32(b), a)); }
inline vf to_float(vi a) { return _mm256_cvtepi32_ps(a); }
inline vi bits_of(vf a) { return _mm256_castps_si256(a); }
inline vf from_bits(vi a) { return _mm256_castsi256_ps(a); }
inline vi iadd(vi a, vi b) { return _mm256_add_epi32(a, b); }
inline vi shr(vi a, int n) { return _mm256_srli_epi32(a, n); }
inline void nibbles(const uint8_t* bytes, vf out[2]) {
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)), mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
  const __m128i ordered = _mm_unpacklo_epi8(lo, hi);
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(ordered));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(ordered, 8)));
}

#else
// No vector unit the kernels know: one lane, the same loops in scalar code.
constexpr int kLanes = 1;
constexpr int kRegisters = 16;
using vf = float;

inline vf zero() { return 0.f; }
inline vf set1(float x) { return x; }
inline vf load(const float* p) { return *p; }
inline vf load(const c10::BFloat16* p) { return static_cast<float>(*p); }
inline vf load(const c10::Half* p) { return static_cast<float>(*p); }
inline vf load(const int8_t* p) { return static_cast<float>(*p); }
inline vf load(const c10::Float8_e5m2* p) { return static_cast<float>(*p); }
inline vf load(const c10::Float8_e4m3fn* p) { return static_cast<float>(*p); }
inline void store(float* p, vf v) { *p = v; }
inline vf add(vf a, vf b) { return a + b; }
inline vf sub(vf a, vf b) { return a - b; }
inline vf mul(vf a, vf b) { return a * b; }
inline vf div(vf a, vf b) { return a / b; }
inline vf max(vf a, vf b) { return std::max(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return std::fma(a, b, c); }
inline vf fnmadd(vf a, vf b, vf c) { return std::fma(-a, b, c); }
inline vf magnitude(vf a) { return std::fabs(a); }
inline vf round_nearest(vf a) { return std::nearbyint(a); }
inline vf scale_pow2(vf p, vf n) { return std::ldexp(p, static_cast<int>(n)); }
inline vf select_negative(vf a, vf if_negative, vf otherwise) { return a < 0.f ? if_negative : otherwise; }
inline float reduce_add(vf a) { return a; }
inline float reduce_max(vf a) { return a; }
inline vf keep_first(vf v, int64_t n, float fill) { return n > 0 ? v : fill; }
inline vf load_first(const float* p, int64_t n) { return n > 0 ? *p : 0.f; }
inline void store_first(float* p, vf v, int64_t n) { if (n > 0) *p = v; }
inline vf transpose_sums(const vf* v) { return v[0]; }
using vi = int32_t;
inline vi iset1(int32_t x) { return x; }
inline vi iload(const int32_t* p) { return *p; }
inline vi lanes() { return 0; }
inline vi band(vi a, vi b) { return a & b; }
inline vi bor(vi a, vi b) { return a | b; }
inline vi shl(vi a, int n) { return static_cast<vi>(static_cast<uint32_t>(a) << n); }
inline vi shrv(vi a, vi n) { return static_cast<uint32_t>(n) > 31 ? 0 : static_cast<vi>(static_cast<uint32_t>(a) >> n); }
inline vi select_below(vi a, int32_t b, vi x, vi y) { return a < b ? x : y; }
inline vf to_float(vi a) { return static_cast<float>(a); }
inline vi bits_of(vf a) { vi x; std::memcpy(&x, &a, 4); return x; }
inline vf from_bits(vi a) { vf x; std::memcpy(&x, &a, 4); return x; }
inline vi iadd(vi a, vi b) { return static_cast<vi>(static_cast<uint32_t>(a) + static_cast<uint32_t>(b)); }
inline vi shr(vi a, int n) { return static_cast<vi>(static_cast<uint32_t>(a) >> n); }
inline void nibbles(const uint8_t* bytes, vf out[2]) { out[0] = bytes[0] & 15; out[1] = bytes[0] >> 4; }
#endif

// exp(x) for x <= 0 (softmax after subtracting the max): 2^n * p(r) with a degree-6 polynomial on
// r in [-ln2/2, ln2/2]; relative error ~2e-7, below fp32 attention noise.
inline vf exp_neg(vf x) {
  x = max(x, set1(-87.f));
  const vf n = round_nearest(mul(x, set1(1.44269504088896341f)));
  const vf r = fnmadd(n, set1(0.693145751953125f), x);
  const vf rr = fnmadd(n, set1(1.428606765330187045e-06f), r);
  vf p = set1(1.f / 720);
  p = fmadd(p, rr, set1(1.f / 120));
  p = fmadd(p, rr, set1(1.f / 24));
  p = fmadd(p, rr, set1(1.f / 6));
  p = fmadd(p, rr, set1(0.5f));
  p = fmadd(p, rr, set1(1.f));
  p = fmadd(p, rr, set1(1.f));
  return scale_pow2(p, n);
}

#if defined(__AVX512BF16__)
constexpr bool kPairDots = true;  // bf16 keys scored by pair dot products (attention_math.h, pair_scores)
#else
constexpr bool kPairDots = false;
#endif

// v rounded to bf16 (to nearest, ties to even; finite values) and widened back, as the reference
// decodes into the model dtype.
inline vf through_bf16(vf v) {
#if defined(__AVX512BF16__)
  // One conversion instruction, where the integer rounding below takes five.
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
#else
  const vi x = bits_of(v);
  const vi rounded = iadd(x, iadd(iset1(0x7FFF), band(shr(x, 16), iset1(1))));
  return from_bits(band(rounded, iset1(static_cast<int32_t>(0xFFFF0000u))));
#endif
}

// v rounded to fp16 (to nearest, ties to even) and widened back.
inline vf through_half(vf v) {
#if defined(__AVX512F__)
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  return static_cast<float>(static_cast<c10::Half>(v));
#endif
}

// v rounded to T (bf16, fp16 or fp32) and widened back: what storing it as T keeps.
template <typename T>
inline vf through_as(vf v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) return through_bf16(v);
  else if constexpr (std::is_same_v<T, c10::Half>) return through_half(v);
  else return v;
}

// kLanes values stored as T, rounded to nearest even as c10's casts round finite values.
inline void store_as(float* p, vf v) { store(p, v); }
inline void store_as(c10::Half* p, vf v) {
#if defined(__AVX512F__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  *p = static_cast<c10::Half>(v);
#endif
}
inline void store_as(c10::BFloat16* p, vf v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));  // through_bf16's rounding
#elif defined(__AVX512F__)
  const __m512i top = _mm512_srli_epi32(bits_of(through_bf16(v)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(top));
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  const __m256i top = _mm256_srli_epi32(bits_of(through_bf16(v)), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1)));
#else
  *p = static_cast<c10::BFloat16>(v);
#endif
}

}  // namespace simd
