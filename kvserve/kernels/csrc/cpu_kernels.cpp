// CPU kernels for kvserve: paged attention that reads KV pages in place (dense or compressed,
// decoded block by block inside the kernel), and the small per-layer ops fused into one pass
// each (RMSNorm with the residual add, RoPE on q and k, SiLU-and-multiply, the KV write).
//
// Every op computes in fp32 and rounds once to the output dtype, so fp32 runs match the
// reference to rounding, and bf16 runs differ from the eager ops only by their intermediate
// roundings. int8 / fp8 codes are attended as code x scale in fp32, where the reference rounds
// that product to the model dtype first.
#include "cpu_ops.h"
#include "simd.h"
#include "thread_pool.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <atomic>
#include <type_traits>
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

namespace {

// Page layouts, matching kvserve.cache.kv_format: dense [blocks, bs, H, D] in the model dtype;
// absmax codes [blocks, bs, H, D] (int8 / fp8) with an fp16 scale [blocks, bs, H]; group-wise
// 2- or 4-bit codes [blocks, bs, H, D * bits / 8] (first code in the low bits) with fp16 scale
// and zero [blocks, bs, H, D / group] (symmetric: scale alone, code - 2^(bits-1) + 1/2 steps);
// KIVI keys: 2- or 4-bit codes [blocks, bs, H, D * bits / 8] with fp16 scale and zero per block,
// head and channel [blocks, H, D], optionally each block's first key in fp16 (sink [blocks, H, D])
// and a bit plane [blocks, bs, H, W / 8] giving W wide channels one bit more (wide_slot [H, D]:
// a channel's bit in it, -1 if none); head-scaled fp8 codes [blocks, bs, H, D] with one fp32
// scale [H].
enum Kind : int64_t { kDense = 0, kAbsMax = 1, kGroup = 2, kChannel = 3, kHeadAbsMax = 4 };

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

// Rounds through the model dtype, as the reference decodes pages into it before attention
// (dense pages of another float type, group-wise and KIVI codes; not absmax codes).
template <typename T>
inline float through(float x) { return static_cast<float>(static_cast<T>(x)); }

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

// Rows of K or V as the attention loop reads them: `base` plus `stride` elements per token.
// fp32 rows are blocks decoded into a buffer; bf16 rows are dense pages read in place, int8 rows
// absmax codes read in place (their scales applied per token by the attention loop).
template <typename R>
struct Rows { const R* base; int64_t stride; };

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

// s[t] = scale * (q . k[t]) for keys [t0, t1) of transpose_pairs' kT (t0 a multiple of 16), into
// s[0, t1 - t0); returns their max. Four sums per key, pairs taken round-robin, so that four
// pair dot products are in flight rather than one chain.
inline float pair_scores(const c10::BFloat16* q, const uint32_t* kT, int64_t t0, int64_t t1, int64_t D, float scale,
                         float* s) {
  const __m512 sc = _mm512_set1_ps(scale);
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t a = t0; a < t1; a += 16) {
    const uint32_t* tile = kT + a / 16 * (D / 2) * 16;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t p = 0; p < D / 2; p += 4)
      for (int j = 0; j < 4; ++j) {
        uint32_t pair;
        std::memcpy(&pair, q + 2 * (p + j), sizeof pair);
        acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_loadu_si512(tile + (p + j) * 16),
                                  (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pair)));
      }
    const __m512 st = _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])), sc);
    const int64_t left = std::min<int64_t>(16, t1 - a);
    const __mmask16 keep = static_cast<__mmask16>((1u << left) - 1);
    _mm512_mask_storeu_ps(s + (a - t0), keep, st);
    mx = _mm512_mask_max_ps(mx, keep, mx, st);
  }
  return _mm512_reduce_max_ps(mx);
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

// bf16 / fp16 / fp32 row -> fp32, exactly (every such value is an fp32 value); other types by cast.
template <typename S>
inline void to_float_row(const S* src, float* dst, int64_t D) {
  int64_t d = 0;
  if constexpr (std::is_same_v<S, c10::BFloat16> || std::is_same_v<S, c10::Half> || std::is_same_v<S, float>)
    for (; d + simd::kLanes <= D; d += simd::kLanes) simd::store(dst + d, simd::load(src + d));
  for (; d < D; ++d) dst[d] = static_cast<float>(src[d]);
}

struct Pages {
  int64_t kind;
  const at::Tensor* data;   // dense data or codes
  const at::Tensor* scale;
  const at::Tensor* zero;
  const at::Tensor* host;   // dense only: offloaded blocks (ids >= num device blocks), may be undefined
  int64_t group;
  int64_t bits = 4;         // kGroup and kChannel codes
  bool symmetric = false;   // kGroup: no zero-point
  const at::Tensor* sink = nullptr;       // kChannel: empty, or each block's first key
  const at::Tensor* wide = nullptr;       // kChannel: empty, or the wide channels' bit plane
  const at::Tensor* wide_slot = nullptr;  // kChannel with `wide`: [H, D] int32
};

// The rows of head h of a dense bf16 block, read in place; base is null when the pages hold
// another type (those are decoded into fp32 first).
inline Rows<c10::BFloat16> bf16_rows(const Pages& p, int64_t block, int64_t h) {
  if (p.kind != kDense) return {nullptr, 0};
  const at::Tensor* src = p.data;
  if (block >= src->size(0)) { block -= src->size(0); src = p.host; }
  if (src->scalar_type() != at::kBFloat16) return {nullptr, 0};
  return {src->data_ptr<c10::BFloat16>() + block * src->stride(0) + h * src->stride(2), src->stride(1)};
}

// The rows of head h of an absmax block of R codes (int8 or fp8), read in place; base is null
// for other pages.
template <typename R>
inline Rows<R> code_rows(const Pages& p, int64_t block, int64_t h) {
  if ((p.kind != kAbsMax && p.kind != kHeadAbsMax) || p.data->scalar_type() != c10::CppTypeToScalarType<R>::value)
    return {nullptr, 0};
  const at::Tensor& d = *p.data;
  return {d.data_ptr<R>() + block * d.stride(0) + h * d.stride(2), d.stride(1)};
}

// Tokens [0, n) of an absmax block's scales for head h into out, which it returns; null for
// other pages, whose decoded values carry their scales. A token's score and weight take its
// scale once, where scaling each code took it D times.
inline const float* absmax_scales(const Pages& p, int64_t block, int64_t n, int64_t h, float* out) {
  if (p.kind == kHeadAbsMax) {
    std::fill(out, out + n, p.scale->data_ptr<float>()[h]);
    return out;
  }
  if (p.kind != kAbsMax) return nullptr;
  const int64_t H = p.data->size(2);
  const c10::Half* s = p.scale->data_ptr<c10::Half>() + block * p.data->size(1) * H + h;
  for (int64_t t = 0; t < n; ++t) out[t] = to_f(s[t * H]);
  return out;
}

// Asks for the rows of head h of a dense or absmax block (one an item reads kAhead blocks on) to
// be brought into L2: a block table scatters blocks, so each block is a new stream the hardware
// prefetcher would find only after its first misses. Not L1: a block's keys and values are 64
// lines (16 tokens of 64 bf16 channels), which filled the core's few L1 miss buffers, and the
// loop stalled behind its own prefetches (8 x 1,100-token decodes over 30 layers' pages: 710 us
// a layer into L1 one block ahead, 470 into L2 two ahead; four ahead, no better).
constexpr int64_t kAhead = 2;
inline void prefetch_block(const Pages& p, int64_t block, int64_t h, int64_t n) {
  if (p.kind != kDense && p.kind != kAbsMax && p.kind != kHeadAbsMax) return;
  const at::Tensor* src = p.data;
  if (block >= src->size(0)) { block -= src->size(0); src = p.host; }
  if (src == nullptr || !src->defined() || src->dim() != 4) return;  // no host copy of these pages
  const char* base = static_cast<const char*>(src->data_ptr()) +
                     (block * src->stride(0) + h * src->stride(2)) * src->element_size();
  const int64_t stride = src->stride(1) * src->element_size(), bytes = src->size(3) * src->element_size();
  for (int64_t t = 0; t < n; ++t)
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(base + t * stride + b, _MM_HINT_T1);
}

// A block's keys or values as the attention loop reads them: fp32 rows decoded into a buffer,
// or bf16 / int8 / fp8 rows read in place; `scale` (null: none) is each token's absmax scale.
struct BlockRows {
  Rows<float> f32;
  Rows<c10::BFloat16> bf16{nullptr, 0};
  Rows<int8_t> i8{nullptr, 0};
  Rows<c10::Float8_e4m3fn> e4m3{nullptr, 0};
  Rows<c10::Float8_e5m2> e5m2{nullptr, 0};
  const float* scale = nullptr;
  bool in_place() const { return bf16.base || i8.base || e4m3.base || e5m2.base; }
  // The rows from token t on (a sliding window's first visible key in the block).
  BlockRows from(int64_t t) const {
    BlockRows r = *this;
    auto shift = [t](auto& rows) { if (rows.base) rows.base += t * rows.stride; };
    shift(r.f32), shift(r.bf16), shift(r.i8), shift(r.e4m3), shift(r.e5m2);
    if (r.scale) r.scale += t;
    return r;
  }
  // f(rows) on the rows that hold the block.
  template <typename F>
  decltype(auto) visit(F&& f) const {
    if (bf16.base) return f(bf16);
    if (i8.base) return f(i8);
    if (e4m3.base) return f(e4m3);
    if (e5m2.base) return f(e5m2);
    return f(f32);
  }
};

// Code d of a row of packed `bits`-bit codes (first code in the low bits).
inline int packed_code(const uint8_t* row, int64_t d, int64_t bits) {
  const int64_t per = 8 / bits;
  return (row[d / per] >> ((d % per) * bits)) & ((1 << bits) - 1);
}

// Codes d .. d + kLanes - 1 of a packed row of 2- or 4-bit codes, one per lane: 8 to 64 bits,
// one or two 32-bit words (vectors of 4 lanes or more: decodes_in_vectors).
inline simd::vi unpack_codes(const uint8_t* row, int64_t d, int64_t bits) {
  using namespace simd;
  uint32_t w[2] = {0, 0};
  std::memcpy(w, row + d * bits / 8, kLanes * bits / 8);
  const vi offset = shl(lanes(), bits == 2 ? 1 : 2);  // each code's first bit
  const vi words = select_below(offset, 32, iset1(static_cast<int32_t>(w[0])), iset1(static_cast<int32_t>(w[1])));
  return band(shrv(words, band(offset, iset1(31))), iset1((1 << bits) - 1));
}

// Whether the vector decoders below take rows of D channels of `bits`-bit codes into the model
// dtype T (other dtypes round through themselves, which only the scalar loops do).
template <typename T>
constexpr bool decodes_in_vectors(int64_t D, int64_t bits) {
  return simd::kLanes >= 4 && D % simd::kLanes == 0 && (bits == 2 || bits == 4) &&
         (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>);
}

// Group-wise codes of any width, with or without zero-points: tokens [0, n) of `block`, head h.
template <typename T>
void decode_group_block(const Pages& p, int64_t block, int64_t n, int64_t h, int64_t D, float* out) {
  const at::Tensor& data = *p.data;
  const int64_t H = data.size(2), bs = data.size(1), G = D / p.group, row_bytes = D * p.bits / 8;
  const float mid = static_cast<float>(1 << (p.bits - 1)) - 0.5f;
  const c10::Half* scale = p.scale->data_ptr<c10::Half>();
  const c10::Half* zero = p.symmetric ? nullptr : p.zero->data_ptr<c10::Half>();
  for (int64_t t = 0; t < n; ++t) {
    const int64_t tok = (block * bs + t) * H + h;
    const uint8_t* row = data.data_ptr<uint8_t>() + tok * row_bytes;
    float* o = out + t * D;
    // A vector of codes at a time, the same multiply (and add) and rounding as the loop below.
    if (decodes_in_vectors<T>(D, p.bits) && p.group % simd::kLanes == 0) {
      using namespace simd;
      for (int64_t d = 0; d < D; d += kLanes) {
        const int64_t g = tok * G + d / p.group;
        const vf code = to_float(unpack_codes(row, d, p.bits)), s = set1(to_f(scale[g]));
        vf v = p.symmetric ? mul(sub(code, set1(mid)), s) : add(mul(code, s), set1(to_f(zero[g])));
        if constexpr (std::is_same_v<T, c10::BFloat16>) v = through_bf16(v);
        store(o + d, v);
      }
      continue;
    }
    for (int64_t d = 0; d < D; ++d) {
      const float code = static_cast<float>(packed_code(row, d, p.bits));
      const float s = to_f(scale[tok * G + d / p.group]);
      o[d] = through<T>(p.symmetric ? (code - mid) * s : code * s + to_f(zero[tok * G + d / p.group]));
    }
  }
}

// KIVI keys: tokens [0, n) of `block`, head h, with the block's per-channel scale and zero, the
// wide channels' extra bit and the exact sink.
template <typename T>
void decode_channel_block(const Pages& p, int64_t block, int64_t n, int64_t h, int64_t D, float* out) {
  const at::Tensor& data = *p.data;
  const int64_t H = data.size(2), bs = data.size(1), row_bytes = D * p.bits / 8;
  const c10::Half* scale = p.scale->data_ptr<c10::Half>() + (block * H + h) * D;
  const c10::Half* zero = p.zero->data_ptr<c10::Half>() + (block * H + h) * D;
  const bool wide = p.wide->numel() > 0;
  const int64_t wide_bytes = wide ? p.wide->size(3) : 0;
  const int32_t* slot = wide ? p.wide_slot->data_ptr<int32_t>() + h * D : nullptr;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t tok = (block * bs + t) * H + h;
    const uint8_t* row = data.data_ptr<uint8_t>() + tok * row_bytes;
    const uint8_t* plane = wide ? p.wide->data_ptr<uint8_t>() + tok * wide_bytes : nullptr;
    float* o = out + t * D;
    // A vector of channels at a time; a wide channel's bit is picked from the plane (up to 32
    // wide channels: one word) by its slot, and a slot of -1 shifts past the word, giving 0.
    if (decodes_in_vectors<T>(D, p.bits) && wide_bytes <= 4) {
      using namespace simd;
      uint32_t word = 0;
      if (wide) std::memcpy(&word, plane, wide_bytes);
      const vi words = iset1(static_cast<int32_t>(word));
      for (int64_t d = 0; d < D; d += kLanes) {
        vi code = unpack_codes(row, d, p.bits);
        if (wide) code = bor(code, shl(band(shrv(words, iload(slot + d)), iset1(1)), static_cast<int>(p.bits)));
        vf v = add(mul(to_float(code), load(scale + d)), load(zero + d));
        if constexpr (std::is_same_v<T, c10::BFloat16>) v = through_bf16(v);
        store(o + d, v);
      }
      continue;
    }
    for (int64_t d = 0; d < D; ++d) {
      int code = packed_code(row, d, p.bits);
      if (wide && slot[d] >= 0) code |= ((plane[slot[d] / 8] >> (slot[d] % 8)) & 1) << p.bits;
      o[d] = through<T>(static_cast<float>(code) * to_f(scale[d]) + to_f(zero[d]));
    }
  }
  if (n > 0 && p.sink->numel() > 0) {
    const c10::Half* sink = p.sink->data_ptr<c10::Half>() + (block * H + h) * D;
    for (int64_t d = 0; d < D; ++d) out[d] = through<T>(to_f(sink[d]));
  }
}

// Decodes tokens [0, n) of `block`, head `h`, into out[n][D] (fp32).
template <typename T>
void decode_block(const Pages& p, int64_t block, int64_t n, int64_t h, int64_t D, float* out) {
  const at::Tensor& data = *p.data;
  if (p.kind == kDense) {
    const at::Tensor* src = &data;
    int64_t b = block;
    if (b >= data.size(0)) { src = p.host; b -= data.size(0); }
    const int64_t bs_stride = src->stride(0), tok_stride = src->stride(1), h_stride = src->stride(2);
    // Pages may be stored in another float type than the model's (kv_cache_dtype fp16 under bf16).
    auto run = [&](const auto* base) {
      using page_t = std::remove_cv_t<std::remove_pointer_t<decltype(base)>>;
      for (int64_t t = 0; t < n; ++t) {
        const auto* row = base + b * bs_stride + t * tok_stride + h * h_stride;
        float* o = out + t * D;
        to_float_row(row, o, D);
        if constexpr (!std::is_same_v<page_t, T>)
          for (int64_t d = 0; d < D; ++d) o[d] = through<T>(o[d]);
      }
    };
    switch (src->scalar_type()) {
      case at::kFloat: run(src->data_ptr<float>()); break;
      case at::kBFloat16: run(src->data_ptr<c10::BFloat16>()); break;
      case at::kHalf: run(src->data_ptr<c10::Half>()); break;
      default: TORCH_CHECK(false, "paged_attention: unsupported page dtype ", src->scalar_type());
    }
    return;
  }
  if (p.kind == kAbsMax || p.kind == kHeadAbsMax) {
    // The codes' values, unscaled: the attention loop multiplies each token's score and weight by
    // its scale (absmax_scales) instead of each channel by it.
    const int64_t H = data.size(2);
    auto run = [&](auto* codes) {
      using code_t = std::remove_cv_t<std::remove_pointer_t<decltype(codes)>>;
      for (int64_t t = 0; t < n; ++t) {
        const code_t* row = codes + ((block * data.size(1) + t) * H + h) * D;
        float* o = out + t * D;
        int64_t d = 0;
        for (; d + simd::kLanes <= D; d += simd::kLanes) simd::store(o + d, simd::load(row + d));
        for (; d < D; ++d) o[d] = to_f(row[d]);
      }
    };
    switch (data.scalar_type()) {
      case at::kChar: run(data.data_ptr<int8_t>()); break;
      case at::kFloat8_e4m3fn: run(data.data_ptr<c10::Float8_e4m3fn>()); break;
      case at::kFloat8_e5m2: run(data.data_ptr<c10::Float8_e5m2>()); break;
      default: TORCH_CHECK(false, "paged_attention: unsupported absmax code dtype ", data.scalar_type());
    }
    return;
  }
  if (p.kind == kChannel) {
    decode_channel_block<T>(p, block, n, h, D, out);
    return;
  }
  TORCH_CHECK(p.kind == kGroup, "paged_attention: unknown page kind ", p.kind);
  if (p.bits != 4 || p.symmetric) {
    decode_group_block<T>(p, block, n, h, D, out);
    return;
  }
  const c10::Half* scale = p.scale->data_ptr<c10::Half>();
  const uint8_t* codes = data.data_ptr<uint8_t>();
  const c10::Half* zero = p.zero->data_ptr<c10::Half>();
  const int64_t H = data.size(2), bs = data.size(1), G = D / p.group;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t tok = (block * bs + t) * H + h;
    const uint8_t* row = codes + tok * (D / 2);
    const c10::Half* sc = scale + tok * G;
    const c10::Half* ze = zero + tok * G;
    float* o = out + t * D;
    // Two vectors of codes (a vector's width in bytes) at a time: low nibbles are even channels,
    // high nibbles odd ones; the same one FMA and rounding as the loop below.
    if (decodes_in_vectors<T>(D, 4) && D % (2 * simd::kLanes) == 0 && p.group % simd::kLanes == 0) {
      using namespace simd;
      for (int64_t d = 0; d < D; d += 2 * kLanes) {
        vf halves[2];
        nibbles(row + d / 2, halves);
        for (int half = 0; half < 2; ++half) {
          const int64_t dd = d + kLanes * half, g = dd / p.group;
          vf v = fmadd(halves[half], set1(to_f(sc[g])), set1(to_f(ze[g])));
          if constexpr (std::is_same_v<T, c10::BFloat16>) v = through_bf16(v);
          store(o + dd, v);
        }
      }
      continue;
    }
    for (int64_t d = 0; d < D; ++d) {
      const int code = (row[d >> 1] >> ((d & 1) * 4)) & 0xF;
      const int64_t g = d / p.group;
      o[d] = through<T>(static_cast<float>(code) * to_f(sc[g]) + to_f(ze[g]));
    }
  }
}

Pages make_pages(int64_t kind, const at::Tensor& data, const at::Tensor& scale, const at::Tensor& zero,
                 const at::Tensor& host, int64_t group, int64_t bits, bool symmetric, const at::Tensor& sink,
                 const at::Tensor& wide, const at::Tensor& wide_slot) {
  // Absmax codes and scales are indexed as contiguous [blocks, bs, H, D] and [blocks, bs, H].
  if (kind == kAbsMax)
    TORCH_CHECK(data.is_contiguous() && scale.is_contiguous(), "paged_attention: absmax codes and scales must be contiguous");
  if (kind == kChannel && wide.numel())
    TORCH_CHECK(wide_slot.scalar_type() == at::kInt && wide_slot.is_contiguous(),
                "paged_attention: wide_slot must be [H, D] int32");
  return Pages{kind, &data, &scale, &zero, &host, group, bits, symmetric, &sink, &wide, &wide_slot};
}

template <typename T>
void attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& query_start,
                    const at::Tensor& context_lens, const at::Tensor& block_tables,
                    const Pages& kp, const Pages& vp, const at::Tensor& stage_of,
                    const at::Tensor& k_staging, const at::Tensor& v_staging, double scale,
                    int64_t block_size, int64_t num_kv_heads, int64_t window, const at::Tensor& score_first,
                    at::Tensor& scores) {
  const int64_t B = context_lens.size(0);
  const int64_t H = q.size(1), D = q.size(2), G = H / num_kv_heads;
  const int64_t* qs = query_start.data_ptr<int64_t>();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t table_stride = block_tables.stride(0);
  const int64_t* stage = stage_of.defined() && stage_of.numel() ? stage_of.data_ptr<int64_t>() : nullptr;
  // Query tokens per work item: enough rows to reuse each decoded key block, few enough that
  // a prefill splits across threads.
  const int64_t q_tile = std::max<int64_t>(1, 32 / G);
  // A sliding window (window > 0): the query in slot p sees keys p - window + 1 .. p. An item
  // starts at the block holding its first row's first key: the blocks before it are never read
  // (a hybrid KV cache points their table entries at a null block).
  auto first_key = [window](int64_t slot) { return window > 0 ? std::max<int64_t>(0, slot - window + 1) : 0; };
  // Scores: the softmax weights of a sequence's query rows from score_first[b] on (-1: none),
  // summed over those rows and averaged over the group's query heads, into scores[b, h, slot].
  // A scored sequence is one item per head, so no two threads add into the same row.
  const int64_t* first = score_first.numel() ? score_first.data_ptr<int64_t>() : nullptr;
  float* sc = first ? scores.data_ptr<float>() : nullptr;
  const int64_t sc_b = first ? scores.stride(0) : 0, sc_h = first ? scores.stride(1) : 0;

  // An item reads blocks [bi0, bi1) of its sequence; part >= 0: a piece of a split context, whose
  // rows' running max, sum and weighted values go to part storage from that row on, for merging
  // after.
  struct Item { int64_t b, h, q0, q1, cost, bi0, bi1, part; };
  // A decode token's keys, or a few tokens' (a speculative draft's verification), in pieces of
  // this many blocks (about 512 keys): a long context is several items, so one long sequence
  // keeps every thread busy (one stream: as many items as KV heads). Unsplit, a 5-token
  // verification was 3 items on 2 threads, and its attention took 1.7x a decode token's (issue
  // 44). Where a context is cut depends only on its length and the tokens' count, never on the batch.
  const int64_t split_blocks = std::max<int64_t>(1, 512 / block_size);
  constexpr int64_t kSplitTokens = 8;
  // A split's pieces: rows each ((q1 - q0) * G), stored one piece after another from row0.
  struct Split { int64_t h, q0, q1, row0, parts; };
  std::vector<Item> items;
  std::vector<Split> splits;
  int64_t num_part_rows = 0;
  for (int64_t b = 0; b < B; ++b) {
    const bool scored = first && first[b] >= 0;
    const int64_t tile = scored ? std::max<int64_t>(1, qs[b + 1] - qs[b]) : q_tile;
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t q0 = qs[b]; q0 < qs[b + 1]; q0 += tile) {
        const int64_t q1 = std::min(q0 + tile, qs[b + 1]);
        const int64_t keys = ctx[b] - (qs[b + 1] - q1);  // what the item's last row sees
        const int64_t nblocks = (keys - 1) / block_size + 1;
        const int64_t lo = first_key(ctx[b] - (qs[b + 1] - q0)) / block_size;
        if (q1 - q0 <= kSplitTokens && !scored && nblocks - lo > split_blocks) {
          const int64_t parts = (nblocks - lo + split_blocks - 1) / split_blocks, rows = (q1 - q0) * G;
          splits.push_back({h, q0, q1, num_part_rows, parts});
          for (int64_t i = 0; i < parts; ++i) {
            const int64_t bi0 = lo + i * split_blocks, bi1 = std::min(nblocks, bi0 + split_blocks);
            items.push_back({b, h, q0, q1, (q1 - q0) * (bi1 - bi0) * block_size, bi0, bi1, num_part_rows + i * rows});
          }
          num_part_rows += parts * rows;
          continue;
        }
        // Rows times the keys it reads: a 2,000-token context costs 100 times a 20.
        items.push_back({b, h, q0, q1, (q1 - q0) * (keys - lo * block_size), lo, nblocks, -1});
      }
  }
  // The pieces' running max and sum per row and weighted values per row [.., D].
  std::vector<float> part_m(num_part_rows), part_l(num_part_rows), part_acc(num_part_rows * D);
  // Items are handed out one at a time, longest first: split statically, the thread that drew
  // the long contexts ran alone while the other spun at the barrier (14% of a mixed step).
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next_item{0};
  const int64_t num_items = static_cast<int64_t>(items.size());

  const T* qd = q.data_ptr<T>();
  const int64_t q_tok = q.stride(0), q_head = q.stride(1);
  T* od = out.data_ptr<T>();
  const int64_t o_tok = out.stride(0), o_head = out.stride(1);
  const float fscale = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // bf16 keys read in place against a bf16 query take pair_scores (where the CPU has them).
  constexpr bool bf16_pairs = simd::kPairDots && std::is_same_v<T, c10::BFloat16>;
  const bool pairs = bf16_pairs && D % (2 * simd::kLanes) == 0;

  const kvserve::Team team = kvserve::team_for(q.size(0), q.scalar_type());
  kvserve::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1, [&](int64_t, int64_t) {
    std::vector<c10::BFloat16> qpairs;  // bf16 query rows, unscaled, for pair_scores
    std::vector<uint32_t> kT(pairs ? (block_size + 15) / 16 * 16 * D / 2 : 0);  // a block's keys, transposed
    std::vector<float> qbuf, acc, kbuf(block_size * D), vbuf(block_size * D), kscale(block_size),
        vscale(block_size), sbuf, m, l, corrections;
    std::vector<int64_t> pos;
    for (int64_t it; (it = next_item.fetch_add(1)) < num_items;) {
      const Item w = items[it];
      const int64_t q_len = qs[w.b + 1] - qs[w.b];
      const int64_t rows = (w.q1 - w.q0) * G;
      qbuf.assign(rows * D, 0.f);
      if (pairs) qpairs.resize(rows * D);
      acc.assign(rows * D, 0.f);
      sbuf.assign(rows * block_size, 0.f);
      m.assign(rows, neg_inf);
      l.assign(rows, 0.f);
      corrections.assign(rows, 1.f);
      pos.assign(rows, 0);
      for (int64_t i = 0; i < w.q1 - w.q0; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = i * G + g;
          const T* src = qd + (w.q0 + i) * q_tok + (w.h * G + g) * q_head;
          for (int64_t d = 0; d < D; ++d) qbuf[r * D + d] = to_f(src[d]) * fscale;
          if constexpr (bf16_pairs)
            if (pairs) std::copy(src, src + D, qpairs.begin() + r * D);
          // Token j of a sequence's new tokens sits at position ctx - q_len + j.
          pos[r] = ctx[w.b] - q_len + (w.q0 + i - qs[w.b]);
        }
      const int64_t last = pos[rows - 1];  // the furthest key any row of this item sees
      const int64_t nblocks = w.bi1;  // the scoring pass (never a split item, never windowed) reads them all
      // bf16 pages and int8 / fp8 codes are read in place by a decode item, whose few rows would
      // not repay decoding a block into fp32 first; a prefill item's 30-odd rows would each widen
      // the same keys again. Either way gives the same values (both widen exactly). bf16 pages
      // whose keys pair_scores scores are read in place by every item: it does not widen the keys,
      // a decode and a prompt's rows (a chunk, a verified draft) then get the same scores, bit
      // for bit, and the values of a block all of a prompt item's rows see whole are accumulated
      // rows 3 at a time, widened once for the three.
      const bool direct = rows <= 8;
      // Block bi of the item's table: its keys (and with `values` its values) read in place or
      // decoded into kbuf / vbuf, with absmax scales into kscale / vscale; returns its tokens and
      // rows. A block inside the full-precision window is read from its staging slot instead.
      struct Loaded { int64_t n; BlockRows k, v; };
      auto load_block = [&](int64_t bi, bool values) {
        const int64_t block = tables[w.b * table_stride + bi];
        const int64_t slot = stage ? stage[block] : -1;
        const Pages sk{kDense, &k_staging, nullptr, nullptr, nullptr, 0};
        const Pages sv{kDense, &v_staging, nullptr, nullptr, nullptr, 0};
        const int64_t at = slot >= 0 ? slot : block;
        Loaded got{std::min(block_size, last + 1 - bi * block_size), {{kbuf.data(), D}}, {{vbuf.data(), D}}};
        auto read = [&](const Pages& page, BlockRows& rows, float* buf, float* scales) {
          // bf16 pages of another model dtype are rounded to it as they are decoded.
          if constexpr (std::is_same_v<T, c10::BFloat16>)
            if (direct || pairs) rows.bf16 = bf16_rows(page, at, w.h);
          if (direct) {
            rows.i8 = code_rows<int8_t>(page, at, w.h);
            rows.e4m3 = code_rows<c10::Float8_e4m3fn>(page, at, w.h);
            rows.e5m2 = code_rows<c10::Float8_e5m2>(page, at, w.h);
          }
          if (!rows.in_place()) decode_block<T>(page, at, got.n, w.h, D, buf);
          rows.scale = absmax_scales(page, at, got.n, w.h, scales);
        };
        read(slot >= 0 ? sk : kp, got.k, kbuf.data(), kscale.data());
#if defined(__AVX512BF16__)
        if (pairs && got.k.bf16.base) transpose_pairs(got.k.bf16, got.n, D, kT.data());
#endif
        if (values) read(slot >= 0 ? sv : vp, got.v, vbuf.data(), vscale.data());
        return got;
      };
      // s[t] = q . k[skip + t] * scale[skip + t] for the block's keys from skip on, n of them;
      // returns their max.
      auto score_block = [&](int64_t r, const BlockRows& block, int64_t skip, int64_t n, float* s) {
#if defined(__AVX512BF16__)
        if (pairs && block.bf16.base) {
          const int64_t a = skip / 16 * 16;  // pair_scores starts at a tile
          const float top = pair_scores(qpairs.data() + r * D, kT.data(), a, skip + n, D, fscale, s);
          if (a == skip) return top;
          std::memmove(s, s + (skip - a), n * sizeof(float));
          return *std::max_element(s, s + n);
        }
#endif
        const BlockRows k = block.from(skip);
        const float top = k.visit([&](auto kr) { return dots(qbuf.data() + r * D, kr, n, D, s); });
        if (k.scale == nullptr) return top;
        float mx = neg_inf;
        for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t] *= k.scale[t]);
        return mx;
      };
      // A block's values into every row's sums, rows three at a time (rows that see the same keys).
      auto accumulate_group = [&](int64_t bi, const Loaded& blk) {
        const int64_t k0 = bi * block_size, skip = std::max<int64_t>(0, first_key(pos[0]) - k0);
        const int64_t visible = std::min(blk.n, pos[0] + 1 - k0) - skip;
        if (visible <= 0) return;  // the rows skipped the block too, leaving `corrections` stale
        const BlockRows v = blk.v.from(skip);
        auto run = [&](auto tile, int64_t r) {
          v.visit([&](auto vr) {
            scale_accumulate_group<decltype(tile)::value>(acc.data() + r * D, corrections.data() + r,
                                                          sbuf.data() + r * block_size, block_size, vr, visible, D);
          });
        };
        int64_t r = 0;
        for (; r + 3 <= rows; r += 3) run(std::integral_constant<int, 3>{}, r);
        if (rows - r == 2) run(std::integral_constant<int, 2>{}, r);
        if (rows - r == 1) run(std::integral_constant<int, 1>{}, r);
      };
      // One query token's rows (a decode item, or a prompt's one-token chunk) see the same keys:
      // their values are accumulated together (scale_accumulate_group).
      const bool grouped = w.q1 - w.q0 == 1 && groups_accumulate(D);
      for (int64_t bi = w.bi0; bi < w.bi1; ++bi) {
        // kAhead blocks ahead (the first block's loop asks for all of them).
        for (int64_t ahead = bi == w.bi0 ? 1 : kAhead; !stage && ahead <= kAhead && bi + ahead < w.bi1; ++ahead) {
          const int64_t next = tables[w.b * table_stride + bi + ahead];
          prefetch_block(kp, next, w.h, block_size);
          prefetch_block(vp, next, w.h, block_size);
        }
        const Loaded blk = load_block(bi, true);
        const int64_t k0 = bi * block_size;
        // A prompt item's rows that all see the whole block take its values together too (the
        // same bits as one row at a time where scale_accumulate has a register tile for D).
        const bool together = grouped || (groups_accumulate(D) && k0 + blk.n - 1 <= pos[0] &&
                                          first_key(pos[rows - 1]) <= k0);
        for (int64_t r = 0; r < rows; ++r) {
          float* s = sbuf.data() + r * block_size;
          // Causal: keys at or before pos; windowed, from its first key on. s[t] is key k0 + skip + t.
          const int64_t skip = std::max<int64_t>(0, first_key(pos[r]) - k0);
          const int64_t visible = std::min(blk.n, pos[r] + 1 - k0) - skip;
          if (visible <= 0) continue;
          const BlockRows v = blk.v.from(skip);
          const float mx = std::max(m[r], score_block(r, blk.k, skip, visible, s));
          const float correction = std::exp(m[r] - mx);  // exp(-inf) = 0 on the first block
          const float sum = exp_sub_sum(s, visible, mx);
          if (v.scale)  // the weights onto unscaled values
            for (int64_t t = 0; t < visible; ++t) s[t] *= v.scale[t];
          if (together) corrections[r] = correction;
          else v.visit([&](auto vr) { scale_accumulate(acc.data() + r * D, correction, s, vr, visible, D); });
          l[r] = l[r] * correction + sum;
          m[r] = mx;
        }
        if (together) accumulate_group(bi, blk);
      }
      if (first && first[w.b] >= 0) {
        // A second pass over the keys now that each row's max and sum are final.
        float* row_scores = sc + w.b * sc_b + w.h * sc_h;
        const int64_t r0 = (first[w.b] - (w.q0 - qs[w.b])) * G;  // the first counted row
        for (int64_t bi = 0; bi < nblocks; ++bi) {
          const Loaded blk = load_block(bi, false);
          const int64_t k0 = bi * block_size;
          for (int64_t r = std::max<int64_t>(r0, 0); r < rows; ++r) {
            const int64_t visible = std::min(blk.n, pos[r] + 1 - k0);
            if (visible <= 0) continue;
            float* s = sbuf.data() + r * block_size;
            score_block(r, blk.k, 0, visible, s);  // the first pass's scores, recomputed
            const float inv = 1.f / (l[r] * G);
            for (int64_t t = 0; t < visible; ++t) row_scores[k0 + t] += std::exp(s[t] - m[r]) * inv;
          }
        }
      }
      if (w.part >= 0) {  // a piece: its rows are merged below
        std::copy(m.begin(), m.end(), part_m.begin() + w.part);
        std::copy(l.begin(), l.end(), part_l.begin() + w.part);
        std::copy(acc.begin(), acc.end(), part_acc.begin() + w.part * D);
        continue;
      }
      for (int64_t i = 0; i < w.q1 - w.q0; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = i * G + g;
          T* dst = od + (w.q0 + i) * o_tok + (w.h * G + g) * o_head;
          const float inv = 1.f / l[r];
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[r * D + d] * inv);
        }
    }
  }, team);
  // A split context's pieces, in order: each rescaled to the overall max, as the online softmax
  // rescales a block.
  kvserve::parallel_for(0, static_cast<int64_t>(splits.size()), 4, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(D);
    for (int64_t i = begin; i < end; ++i) {
      const Split& sp = splits[i];
      const int64_t rows = (sp.q1 - sp.q0) * G;
      for (int64_t r = 0; r < rows; ++r) {
        // A row that sees none of a piece's keys (a later piece, past its position) left it at
        // max -inf and sum 0: weight exp(-inf) = 0.
        float mx = neg_inf;
        for (int64_t p = 0; p < sp.parts; ++p) mx = std::max(mx, part_m[sp.row0 + p * rows + r]);
        float total = 0.f;
        std::fill(sum.begin(), sum.end(), 0.f);
        for (int64_t p = 0; p < sp.parts; ++p) {
          const int64_t at = sp.row0 + p * rows + r;
          const float c = std::exp(part_m[at] - mx);
          total += part_l[at] * c;
          const float* a = part_acc.data() + at * D;
          for (int64_t d = 0; d < D; ++d) sum[d] += a[d] * c;
        }
        T* dst = od + (sp.q0 + r / G) * o_tok + (sp.h * G + r % G) * o_head;
        const float inv = 1.f / total;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(sum[d] * inv);
      }
    }
  }, team);
}

}  // namespace

// Dense pages: k, v [T, Hkv, D] (rows may be strided) into slot_mapping's flat slots.
void write_kv(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "write_kv: contiguous head_dim expected");
  const int64_t T = k.size(0), H = k.size(1), D = k.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "write_kv", [&] {
    using cache_t = scalar_t;
    auto write = [&](const at::Tensor& cache, const at::Tensor& x) {
      TORCH_CHECK(x.scalar_type() == cache.scalar_type(), "write_kv: K/V dtype must match the cache");
      cache_t* base = cache.data_ptr<cache_t>();
      const cache_t* src = x.data_ptr<cache_t>();
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h) {
          cache_t* dst = base + (slots[t] * H + h) * D;
          const cache_t* s = src + t * x.stride(0) + h * x.stride(1);
          std::copy(s, s + D, dst);
        }
    };
    write(k_cache, k);
    write(v_cache, v);
  });
}

// q [T, H, D] (rows may be strided, the last dim contiguous); query_start [B + 1], context_lens
// [B], block_tables [B, max_blocks] int64 on the CPU. K/V pages: see `Kind`. stage_of [num_blocks]
// (or empty) maps a block to its full-precision staging slot, -1 if none. With dense pages, the
// step's new k/v [T, Hkv, D] are first written to `slot_mapping` (one call instead of two;
// compressed pages are encoded by the pool beforehand: pass empty tensors). Returns [T, H, D].
// score_first [B] int64 (or empty): from which of its query rows sequence b's attention weights
// are added into scores [B, Hkv, >= its context] fp32 (zeros in; -1: not scored). window > 0: each
// query sees its last `window` slots only, and blocks wholly before its item's window are not read
// (0 or -1: no window).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                           const at::Tensor& slot_mapping, const at::Tensor& query_start,
                           const at::Tensor& context_lens, const at::Tensor& block_tables, int64_t k_kind, const at::Tensor& k_data,
                           const at::Tensor& k_scale, const at::Tensor& k_zero, const at::Tensor& k_host,
                           int64_t v_kind, const at::Tensor& v_data, const at::Tensor& v_scale,
                           const at::Tensor& v_zero, const at::Tensor& v_host, int64_t k_group, int64_t v_group,
                           int64_t k_bits, int64_t v_bits, bool k_symmetric, bool v_symmetric,
                           const at::Tensor& k_sink, const at::Tensor& k_wide, const at::Tensor& k_wide_slot,
                           const at::Tensor& v_sink, const at::Tensor& v_wide, const at::Tensor& v_wide_slot,
                           const at::Tensor& stage_of, const at::Tensor& k_staging,
                           const at::Tensor& v_staging, double scale, int64_t block_size,
                           int64_t num_kv_heads, int64_t window, const at::Tensor& score_first, at::Tensor scores) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged_attention: q must be [T, H, D] with contiguous D");
  TORCH_CHECK(q.size(1) % num_kv_heads == 0, "paged_attention: heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.is_contiguous() && query_start.is_contiguous() && context_lens.is_contiguous(),
              "paged_attention: metadata must be contiguous");
  if (score_first.numel()) {
    // Scores are read from every key of a sequence, a window's hidden ones too.
    TORCH_CHECK(window <= 0, "paged_attention: attention scores are not built for a sliding window");
    TORCH_CHECK(score_first.scalar_type() == at::kLong && score_first.is_contiguous() &&
                score_first.size(0) == context_lens.size(0), "paged_attention: score_first must be [B] int64");
    TORCH_CHECK(scores.scalar_type() == at::kFloat && scores.dim() == 3 && scores.size(0) == context_lens.size(0) &&
                scores.size(1) == num_kv_heads && scores.stride(2) == 1, "paged_attention: scores must be [B, Hkv, S] fp32");
  }
  if (k_new.numel()) {
    TORCH_CHECK(k_kind == kDense && v_kind == kDense, "paged_attention: only dense pages are written here");
    write_kv(k_data, v_data, k_new, v_new, slot_mapping);
  }
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (q.size(0) == 0) return out;
  const Pages kp = make_pages(k_kind, k_data, k_scale, k_zero, k_host, k_group, k_bits, k_symmetric, k_sink, k_wide,
                              k_wide_slot);
  const Pages vp = make_pages(v_kind, v_data, v_scale, v_zero, v_host, v_group, v_bits, v_symmetric, v_sink, v_wide,
                              v_wide_slot);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    attention_impl<scalar_t>(out, q, query_start, context_lens, block_tables, kp, vp, stage_of, k_staging,
                             v_staging, scale, block_size, num_kv_heads, window, score_first, scores);
  });
  return out;
}


namespace {

// x rounded to fp16, then moved one fp16 step up (or down) if rounding went the wrong way: the
// stored scale must still cover the range (kv_format._fp16_rounded). Finite inputs only.
inline c10::Half fp16_rounded(float x, bool up) {
  c10::Half h(x);
  const float back = static_cast<float>(h);
  if (up ? back >= x : back <= x) return h;
  uint16_t bits = h.x;
  const bool zero = (bits & 0x7FFF) == 0;
  const bool positive = !(bits & 0x8000);
  if (zero) bits = up ? 0x0001 : 0x8001;
  else if (positive == up) bits += 1;
  else bits -= 1;
  return c10::Half(bits, c10::Half::from_bits());
}

constexpr float kMinScale = 1.0f / 16384;  // kv_format.MIN_SCALE, fp16's smallest normal

template <typename T, typename Code>
void encode_absmax(const T* x, Code* codes, c10::Half* scale, int64_t D, float qmax, bool is_float) {
  // int8 codes (integer codes: is_float is false) from bf16 / fp32 rows 8 at a time (a prefill
  // step encodes every token's K and V): the same max, division, clamp and rounding to nearest
  // even as the scalar loops.
#if defined(__AVX2__) && defined(__FMA__)
  constexpr bool vector = std::is_same_v<Code, int8_t> && (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>);
  auto load = [](const T* p) {
    if constexpr (std::is_same_v<T, float>) return _mm256_loadu_ps(p);
    else return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  };
#else
  constexpr bool vector = false;
#endif
  const int64_t vd = vector ? D - D % 8 : 0;  // channels the vector loops take
  float amax = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (vector) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 mx = _mm256_setzero_ps();
    // max(new, mx) keeps mx where new is NaN, as std::max(amax, v) does.
    for (int64_t d = 0; d < vd; d += 8) mx = _mm256_max_ps(_mm256_and_ps(load(x + d), magnitude), mx);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mx);
    for (float v : lanes) amax = std::max(amax, v);
  }
#endif
  for (int64_t d = vd; d < D; ++d) amax = std::max(amax, std::abs(static_cast<float>(x[d])));
  const c10::Half sc = fp16_rounded(std::max(amax / qmax, kMinScale), true);
  *scale = sc;
  const float sf = static_cast<float>(sc);
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (vector) {
    const __m256 sv = _mm256_set1_ps(sf), hi = _mm256_set1_ps(qmax), lo = _mm256_set1_ps(-qmax);
    for (int64_t d = 0; d < vd; d += 8) {
      const __m256 y = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(load(x + d), sv), lo), hi);
      const __m256i q = _mm256_cvtps_epi32(_mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + d), _mm_packs_epi16(words, words));
    }
  }
#endif
  for (int64_t d = vd; d < D; ++d) {
    float y = std::min(std::max(static_cast<float>(x[d]) / sf, -qmax), qmax);
    if (!is_float) y = std::nearbyint(y);
    codes[d] = static_cast<Code>(y);
  }
}

template <typename T>
void encode_group4(const T* x, uint8_t* codes, c10::Half* scale, c10::Half* zero, int64_t D, int64_t group) {
  for (int64_t g0 = 0, gi = 0; g0 < D; g0 += group, ++gi) {
    float lo = std::numeric_limits<float>::infinity(), hi = -lo;
    for (int64_t d = g0; d < g0 + group; ++d) {
      lo = std::min(lo, static_cast<float>(x[d]));
      hi = std::max(hi, static_cast<float>(x[d]));
    }
    const c10::Half z = fp16_rounded(lo, false);
    const float zf = static_cast<float>(z);
    const c10::Half sc = fp16_rounded(std::max((hi - zf) / 15.f, kMinScale), true);
    const float sf = static_cast<float>(sc);
    zero[gi] = z;
    scale[gi] = sc;
    for (int64_t d = g0; d < g0 + group; d += 2) {
      auto code = [&](int64_t i) {
        return static_cast<uint8_t>(std::min(std::max(std::nearbyint((static_cast<float>(x[i]) - zf) / sf), 0.f), 15.f));
      };
      codes[d / 2] = static_cast<uint8_t>(code(d) | (code(d + 1) << 4));
    }
  }
}

}  // namespace

// Encodes x [T, H, D] (rows may be strided) token by token into the page fields at slot_mapping,
// exactly as kvserve.cache.kv_format's int8 / fp8 (absmax) and int4 (group) formats do.
void encode_write(const at::Tensor& x, const at::Tensor& slot_mapping, int64_t kind, const at::Tensor& codes,
                  const at::Tensor& scale, const at::Tensor& zero, int64_t group) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "encode_write: x must be [T, H, D] with contiguous D");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  auto* sc = scale.data_ptr<c10::Half>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "encode_write", [&] {
    const scalar_t* xd = x.data_ptr<scalar_t>();
    kvserve::parallel_for(0, T * H, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t t = i / H, h = i % H, slot = slots[t] * H + h;
        const scalar_t* row = xd + t * x.stride(0) + h * x.stride(1);
        if (kind == kGroup) {
          const int64_t G = D / group;
          encode_group4(row, codes.data_ptr<uint8_t>() + slot * (D / 2), sc + slot * G,
                        zero.data_ptr<c10::Half>() + slot * G, D, group);
          continue;
        }
        TORCH_CHECK(kind == kAbsMax, "encode_write: unknown kind ", kind);
        switch (codes.scalar_type()) {
          case at::kChar: encode_absmax(row, codes.data_ptr<int8_t>() + slot * D, sc + slot, D, 127.f, false); break;
          case at::kFloat8_e4m3fn:
            encode_absmax(row, codes.data_ptr<c10::Float8_e4m3fn>() + slot * D, sc + slot, D, 448.f, true); break;
          case at::kFloat8_e5m2:
            encode_absmax(row, codes.data_ptr<c10::Float8_e5m2>() + slot * D, sc + slot, D, 57344.f, true); break;
          default: TORCH_CHECK(false, "encode_write: unsupported code dtype ", codes.scalar_type());
        }
      }
    }, kvserve::team_for(T, x.scalar_type()));
  });
}

// Whether simd's loads and stores take T (bf16, fp16, fp32; double runs the scalar loops).
template <typename T>
constexpr bool kVectorType = !std::is_same_v<T, double>;

// One row of norm_rows, t = the row's offset: residual (optional) += x, then the normalised row.
template <typename T>
void norm_row(const T* x, T* residual, const T* w, T* out, float* row, int64_t C, float eps, bool offset) {
  using namespace simd;
  int64_t c = 0;
  vf squares = zero();
  if constexpr (kVectorType<T>) {
    for (; c + kLanes <= C; c += kLanes) {
      vf v = load(x + c);
      if (residual) {
        v = through_as<T>(add(load(residual + c), v));
        store_as(residual + c, v);
      }
      store(row + c, v);
      squares = fmadd(v, v, squares);
    }
  }
  float ss = reduce_add(squares);
  for (; c < C; ++c) {
    float v = to_f(x[c]);
    if (residual) {
      residual[c] = static_cast<T>(to_f(residual[c]) + v);
      v = to_f(residual[c]);
    }
    row[c] = v;
    ss += v * v;
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(C) + eps);
  c = 0;
  if constexpr (kVectorType<T>) {
    const vf scale = set1(inv), one = set1(1.f);
    for (; c + kLanes <= C; c += kLanes) {
      const vf normed = mul(load(row + c), scale);
      store_as(out + c, offset ? mul(normed, add(one, load(w + c))) : mul(load(w + c), through_as<T>(normed)));
    }
  }
  for (; c < C; ++c)
    out[c] = static_cast<T>(offset ? row[c] * inv * (1.f + to_f(w[c])) : to_f(w[c]) * through<T>(row[c] * inv));
}

// RMSNorm of x [T, C] (fp32 statistics), times weight; with `residual`, first residual += x (in
// place, rounded to the dtype) and normalises the sum. Returns the normalised rows. `offset`:
// Gemma's norm, scaled by 1 + weight in fp32 and rounded once (Gemma3RMSNorm); else Llama's, the
// normalised row rounded to the dtype before the weight's product (LlamaRMSNorm). The sum of
// squares runs in kLanes partial sums.
at::Tensor norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps, c10::optional<at::Tensor> residual,
                     bool offset) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "rms_norm: x must be contiguous [T, C]");
  const int64_t T = x.size(0), C = x.size(1);
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xd = x.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* rd = residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr;
    scalar_t* od = out.data_ptr<scalar_t>();
    kvserve::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> row(C);
      for (int64_t t = begin; t < end; ++t)
        norm_row(xd + t * C, rd ? rd + t * C : nullptr, w, od + t * C, row.data(), C, static_cast<float>(eps), offset);
    }, kvserve::team_for(T, x.scalar_type()));
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, c10::optional<at::Tensor> residual) {
  return norm_rows(x, weight, eps, residual, false);
}

at::Tensor offset_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                           c10::optional<at::Tensor> residual) {
  return norm_rows(x, weight, eps, residual, true);
}

// x[:half], x[half:] of one head rotated by the position's cos / sin, in fp32, rounded once.
template <typename T>
void rotate_half(T* x, const float* c, const float* s, int64_t half) {
  int64_t i = 0;
  if constexpr (kVectorType<T>) {
    using namespace simd;
    for (; i + kLanes <= half; i += kLanes) {
      const vf x1 = load(x + i), x2 = load(x + i + half), ci = load(c + i), si = load(s + i);
      store_as(x + i, fnmadd(x2, si, mul(x1, ci)));
      store_as(x + i + half, fmadd(x1, si, mul(x2, ci)));
    }
  }
  for (; i < half; ++i) {
    const float x1 = to_f(x[i]), x2 = to_f(x[i + half]);
    x[i] = static_cast<T>(std::fma(-x2, s[i], x1 * c[i]));
    x[i + half] = static_cast<T>(std::fma(x1, s[i], x2 * c[i]));
  }
}

// dst[:n] = src[:n] rounded to T.
template <typename T>
void store_row(T* dst, const float* src, int64_t n) {
  int64_t i = 0;
  if constexpr (kVectorType<T>)
    for (; i + simd::kLanes <= n; i += simd::kLanes) simd::store_as(dst + i, simd::load(src + i));
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// qkv [T, (heads + 2 * kv_heads) * head_dim], the fused projection: rotate-half RoPE in place on
// the q and k heads (cos/sin [max_pos, head_dim / 2] fp32), then q, k, v as [T, heads, D] views.
std::vector<at::Tensor> rope_split(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                                   const at::Tensor& sin, int64_t heads, int64_t kv_heads, int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "rope_split: qkv must be [T, width] with contiguous rows");
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * head_dim, "rope_split: qkv width");
  TORCH_CHECK(positions.scalar_type() == at::kLong && cos.scalar_type() == at::kFloat, "rope_split: dtypes");
  const int64_t rot_heads = heads + kv_heads;
  const int64_t T = qkv.size(0), half = head_dim / 2, row_stride = qkv.stride(0);
  const int64_t* p = positions.data_ptr<int64_t>();
  const float* cd = cos.data_ptr<float>();
  const float* sd = sin.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_", [&] {
    scalar_t* base = qkv.data_ptr<scalar_t>();
    kvserve::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* c = cd + p[t] * half;
        const float* s = sd + p[t] * half;
        for (int64_t h = 0; h < rot_heads; ++h) rotate_half(base + t * row_stride + h * head_dim, c, s, half);
      }
    }, kvserve::team_for(T, qkv.scalar_type()));
  });
  const int64_t T2 = qkv.size(0), rs = qkv.stride(0);
  auto view = [&](int64_t first_head, int64_t n) {
    return qkv.as_strided({T2, n, head_dim}, {rs, head_dim, 1}, qkv.storage_offset() + first_head * head_dim);
  };
  return {view(0, heads), view(heads, kv_heads), view(heads + kv_heads, kv_heads)};
}

// One row of `gated`: out[:I] = act(gate[:I]) * up[:I], in fp32, rounded once.
template <typename T>
void gated_row(const T* gate, const T* up, T* out, int64_t I, bool gelu) {
  constexpr float kC = 0.7978845608028654f, kA = 0.044715f;  // sqrt(2 / pi), GELU's cubic term
  int64_t i = 0;
  if constexpr (kVectorType<T>) {
    // Both from exp of a non-positive argument (the range exp_neg covers), and one division:
    // silu(a) = a / (1 + e) for a >= 0, a e / (1 + e) below, e = exp(-|a|); std::exp per element
    // took 2.65 ms over 512 rows of 1,536 on AVX2, this 0.82. gelu(a) = a (1 + tanh(z)) / 2, the
    // same form with e = exp(-2|z|): no 1 + tanh cancelling for negative z.
    using namespace simd;
    for (; kLanes > 1 && i + kLanes <= I; i += kLanes) {
      const vf a = load(gate + i);
      const vf z = gelu ? mul(set1(kC), add(a, mul(set1(kA), mul(a, mul(a, a))))) : a;
      const vf e = exp_neg(gelu ? mul(set1(-2.f), magnitude(z)) : sub(zero(), magnitude(a)));
      const vf act = div(mul(a, select_negative(z, e, set1(1.f))), add(set1(1.f), e));
      store_as(out + i, mul(act, load(up + i)));
    }
  }
  for (; i < I; ++i) {
    const float a = to_f(gate[i]);
    const float act = gelu ? 0.5f * a * (1.f + std::tanh(kC * (a + kA * a * a * a))) : a / (1.f + std::exp(-a));
    out[i] = static_cast<T>(act * to_f(up[i]));
  }
}

// gate_up [T, 2I] -> act(gate) * up [T, I], in fp32, rounded once: act is silu (Llama's SwiGLU)
// or, with `gelu`, the tanh GELU (Gemma's GeGLU, gelu_pytorch_tanh).
at::Tensor gated(const at::Tensor& gate_up, bool gelu) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous(), "silu_mul: contiguous [T, 2I] expected");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  at::Tensor out = at::empty({T, I}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* g = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    kvserve::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) gated_row(g + t * 2 * I, g + t * 2 * I + I, o + t * I, I, gelu);
    }, kvserve::team_for(T, gate_up.scalar_type()));
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) { return gated(gate_up, false); }

at::Tensor gelu_tanh_mul(const at::Tensor& gate_up) { return gated(gate_up, true); }


#ifdef __AVX512BF16__
namespace {

// One MR x NR tile of out = x @ w^T: the NR weight rows are read from memory once per K step and
// reused for every row of x, with MR * NR fp32 accumulators in registers (VDPBF16PS).
template <int MR, int NR>
inline void gemm_tile(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias,
                      c10::BFloat16* out, int64_t K, int64_t N) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh wv[NR];
    // Rows 16 tiles ahead into L2 (16 rows when streaming one at a time, 64 in 4 x 4 tiles, 74 KB
    // at K = 576): enough misses in flight to keep memory busy. One 4-row tile ahead into L1 kept
    // too few, and a decode step's linears streamed at ~21 GB/s of the machine's ~32 (AMD Zen4:
    // one-stream step 16.6-18.0 -> 12.1-13.9 ms).
    for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (16 * NR + j) * K + k), _MM_HINT_T1);
    for (int j = 0; j < NR; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  if constexpr (MR == 4 && NR == 4) {
    // All 16 sums in one transposed reduction: lane 4i + j is out[i][j]. Summed one by one, the
    // reductions cost a third of the tile at K = 576.
    __m512 sums = simd::transpose_sums(&acc[0][0]);
    if (bias) {
      float b[4];
      for (int j = 0; j < 4; ++j) b[j] = static_cast<float>(bias[j]);
      sums = _mm512_add_ps(sums, _mm512_broadcast_f32x4(_mm_loadu_ps(b)));
    }
    alignas(32) c10::BFloat16 rounded[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(rounded), (__m256i)_mm512_cvtneps_pbh(sums));
    for (int i = 0; i < 4; ++i) std::copy(rounded + 4 * i, rounded + 4 * i + 4, out + i * N);
  } else {
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) {
        const float b = bias ? static_cast<float>(bias[j]) : 0.f;
        out[i * N + j] = static_cast<c10::BFloat16>(_mm512_reduce_add_ps(acc[i][j]) + b);
      }
  }
}

// Up to 8 rows of x against one weight row at a time: the weights stream as one sequential run
// per thread. Four rows at a time (gemm_rows<4>) read four interleaved runs, and a decode step's
// linears streamed at 35 GB/s where one run reached 40-42 (AMD Zen 5, 2 threads, 1 to 8 rows;
// at 16 rows and more the 4 x 4 tiles' shared reductions win; BENCHMARKS.md).
constexpr int64_t kStreamRows = 8;

template <int MR>
void stream_rows(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* out,
                 int64_t begin, int64_t end, int64_t K, int64_t N) {
  for (int64_t n = begin; n < end; ++n) gemm_tile<MR, 1>(x, w + n * K, bias ? bias + n : nullptr, out + n, K, N);
}

template <int NR>
void gemm_rows(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* out,
               int64_t M, int64_t K, int64_t N) {
  // One or two rows left over ride in a last tile of 5 or 6: a tile of 1 loads 5 vectors for
  // every 4 FMAs and cost 2.5 times as much per row.
  const int64_t rem = M % 4;
  const int64_t bulk = M >= 4 && (rem == 1 || rem == 2) ? M - 4 - rem : M - rem;
  int64_t m = 0;
  for (; m + 4 <= bulk; m += 4) gemm_tile<4, NR>(x + m * K, w, bias, out + m * N, K, N);
  switch (M - m) {
    case 6: gemm_tile<6, NR>(x + m * K, w, bias, out + m * N, K, N); break;
    case 5: gemm_tile<5, NR>(x + m * K, w, bias, out + m * N, K, N); break;
    case 3: gemm_tile<3, NR>(x + m * K, w, bias, out + m * N, K, N); break;
    case 2: gemm_tile<2, NR>(x + m * K, w, bias, out + m * N, K, N); break;
    case 1: gemm_tile<1, NR>(x + m * K, w, bias, out + m * N, K, N); break;
    default: break;
  }
}

}  // namespace
#endif

bool has_bf16_gemm() {
#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
  return true;
#else
  return false;
#endif
}

bool interleaves_bf16_weights() {
#if !defined(__AVX512BF16__) && defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

// out [M, N] = x [M, K] @ w[N, K]^T (+ bias), bf16 in and out, fp32 accumulation (on the AVX2
// kernel N is padded to a multiple of 16 with zero columns, as its weight is). For the small
// M of decode steps, where a GEMM library's packing and blocking cost more than the weights'
// read from memory, which is all a decode step's matmul should cost; on the AVX2 kernel for
// every M (where no library has a bf16 matmul faster than it, BENCHMARKS.md).
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(has_bf16_gemm(), "linear_bf16: built without AVX512-BF16 or AVX2");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "linear_bf16: bf16 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.is_contiguous(), "linear_bf16: contiguous x [M, K] and w (cpu_linear.kernel_layout)");
  const bool interleaved = w.dim() == 4;
  TORCH_CHECK(interleaved == interleaves_bf16_weights() && (!interleaved || (w.size(2) == 16 && w.size(3) == 2)),
              "linear_bf16: the AVX2 kernel reads weights as [N / 16, K / 2, 16, 2] (cpu_linear.kernel_layout), the others as [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = interleaved ? w.size(0) * 16 : w.size(0);
  TORCH_CHECK((interleaved ? w.size(1) * 2 : w.size(1)) == K && K % 32 == 0,
              "linear_bf16: K must match and be a multiple of 32");
  TORCH_CHECK(!bias.has_value() || (bias->numel() <= N && bias->numel() > N - (interleaved ? 16 : 1)),
              "linear_bf16: bias needs an entry per output (zero rows padding interleaved weights need none)");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous()),
              "linear_bf16: the bias must be a contiguous bf16 vector");
  at::Tensor out = at::empty({M, N}, x.options());
#ifdef __AVX512BF16__
  const auto* xd = x.data_ptr<c10::BFloat16>();
  const auto* wd = w.data_ptr<c10::BFloat16>();
  const c10::BFloat16* bd = bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr;
  auto* od = out.data_ptr<c10::BFloat16>();
  constexpr int64_t NR = 4;
  const int64_t tiles = N / NR;
  // AMX tiles first where the CPU has them (linear_amx.cpp); their columns are a multiple of NR.
  const int64_t amx_columns = linear_amx(x, w, bias, out);
  if (M > 0 && M <= kStreamRows) {
    kvserve::parallel_for(amx_columns, N, 64, [&](int64_t begin, int64_t end) {
      switch (M) {
        case 1: stream_rows<1>(xd, wd, bd, od, begin, end, K, N); break;
        case 2: stream_rows<2>(xd, wd, bd, od, begin, end, K, N); break;
        case 3: stream_rows<3>(xd, wd, bd, od, begin, end, K, N); break;
        case 4: stream_rows<4>(xd, wd, bd, od, begin, end, K, N); break;
        case 5: stream_rows<5>(xd, wd, bd, od, begin, end, K, N); break;
        case 6: stream_rows<6>(xd, wd, bd, od, begin, end, K, N); break;
        case 7: stream_rows<7>(xd, wd, bd, od, begin, end, K, N); break;
        default: stream_rows<8>(xd, wd, bd, od, begin, end, K, N); break;
      }
    });
    return out;
  }
  kvserve::parallel_for(amx_columns / NR, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      gemm_rows<NR>(xd, wd + t * NR * K, bd ? bd + t * NR : nullptr, od + t * NR, M, K, N);
  });
  for (int64_t n = tiles * NR; n < N; ++n)
    gemm_rows<1>(xd, wd + n * K, bd ? bd + n : nullptr, od + n, M, K, N);
#elif defined(__AVX2__) && defined(__FMA__)
  linear_avx2(x, w, bias, out);
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_bf16", &linear_bf16, "bf16 x @ w^T for small M (decode)", py::arg("x"), py::arg("w"),
        py::arg("bias") = py::none());
  m.def("linear_f32", &linear_f32, "fp32 x @ w^T, each row's sums independent of the batch", py::arg("x"),
        py::arg("w"), py::arg("bias") = py::none());
  // Without the GIL, as F.linear (which it replaces) runs: a prefill's matmul takes long enough that
  // holding it stalls the server's other Python threads (the event loop) for the whole call.
  m.def("linear_rows", &linear_rows, "x @ w^T for a prefill's rows: column chunks over the pool, oneDNN on one thread each",
        py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("row_bucket"), py::call_guard<py::gil_scoped_release>());
  m.def("has_bf16_gemm", &has_bf16_gemm, "whether linear_bf16 was built (AVX512-BF16 or AVX2)");
  m.def("interleaves_bf16_weights", &interleaves_bf16_weights,
        "whether linear_bf16 reads weights interleaved in groups of 16 rows (the AVX2 kernel)");
  m.def("paged_attention", &paged_attention, "attention over paged KV, pages read in place");
  m.def("encode_write", &encode_write, "encode K or V rows into int8 / fp8 / int4 page fields");
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally after adding into a residual");
  m.def("offset_rms_norm", &offset_rms_norm, "Gemma's RMSNorm (times 1 + weight), optionally after a residual add");
  m.def("rope_split", &rope_split, "RoPE in place on the q and k heads of qkv, then q, k, v views");
  m.def("gelu_tanh_mul", &gelu_tanh_mul, "gate_up [T, 2I] -> gelu_tanh(gate) * up (GeGLU)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("thread_pool_stats", [] {
    const kvserve::PoolStats s = kvserve::pool_stats();
    return std::map<std::string, int64_t>{{"parallel_regions", s.parallel_regions},
                                          {"waiting_ns", s.waiting_ns},
                                          {"caller_chunks", s.caller_chunks},
                                          {"worker_chunks", s.worker_chunks},
                                          {"caller_sleeps", s.caller_sleeps},
                                          {"worker_sleeps", s.worker_sleeps},
                                          {"torch_regions", s.torch_regions},
                                          {"solo_periods", s.solo_periods},
                                          {"solo_regions", s.solo_regions}};
  }, "what the kernels' thread pool did since the process started (thread_pool.h, PoolStats)");
  m.def("thread_pool_end_solo", &kvserve::end_solo,
        "end the pool's solo period now: the next regions run on every thread (thread_pool.h, end_solo)");
  bind_decoder_stack(m);
}
