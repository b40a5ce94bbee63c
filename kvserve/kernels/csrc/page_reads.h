// Reading a block of pages for the attention kernel: the pages' tensors (Pages), a dense or
// absmax block's rows in place, their scales, prefetching a block, and decoding group-wise and
// KIVI codes into fp32 rows (paged_attention.cpp).
#pragma once

#include "simd.h"
#include "value_types.h"

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace cpu_kernels {

// A [blocks, bs, H, D] page tensor's address and strides (in elements), read from its at::Tensor
// once per call: asked per block (data_ptr's checks, sizes, strides), they were ~4% of a decode
// step's attention.
struct PageRows {
  const char* base = nullptr;  // null: no such tensor (no host copy), or not [blocks, bs, H, D]
  at::ScalarType dtype = at::kFloat;
  int64_t blocks = 0, block_stride = 0, token_stride = 0, head_stride = 0, width = 0, element = 0;

  static PageRows of(const at::Tensor* t) {
    if (t == nullptr || !t->defined() || t->dim() != 4) return {};
    return {static_cast<const char*>(t->data_ptr()), t->scalar_type(), t->size(0), t->stride(0), t->stride(1),
            t->stride(2), t->size(3), static_cast<int64_t>(t->element_size())};
  }
  // Head h of `block`'s first token.
  template <typename R>
  const R* at(int64_t block, int64_t h) const {
    return reinterpret_cast<const R*>(base) + block * block_stride + h * head_stride;
  }
};

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
  const at::Tensor* wide = nullptr;       // kChannel with `wide`: [H, D] int32
  const at::Tensor* wide_slot = nullptr;  // kChannel with `wide`: [H, D] int32
  PageRows rows = PageRows::of(data), host_rows = PageRows::of(host);

  // The device or host rows that hold `block`, which becomes the index within them.
  const PageRows& holding(int64_t& block) const {
    if (block < rows.blocks) return rows;
    block -= rows.blocks;
    return host_rows;
  }
};

// The rows of head h of a dense bf16 block, read in place; base is null when the pages hold
// another type (those are decoded into fp32 first).
inline Rows<c10::BFloat16> bf16_rows(const Pages& p, int64_t block, int64_t h) {
  if (p.kind != kDense) return {nullptr, 0};
  const PageRows& src = p.holding(block);
  if (src.base == nullptr || src.dtype != at::kBFloat16) return {nullptr, 0};
  return {src.at<c10::BFloat16>(block, h), src.token_stride};
}

// Whether every block of these pages (device and host) is dense bf16, which bf16_rows reads in place.
inline bool bf16_pages(const Pages& p) {
  return p.kind == kDense && p.rows.base != nullptr && p.rows.dtype == at::kBFloat16 &&
         (p.host_rows.base == nullptr || p.host_rows.dtype == at::kBFloat16);
}

// The rows of head h of an absmax block of R codes (int8 or fp8), read in place; base is null
// for other pages.
template <typename R>
inline Rows<R> code_rows(const Pages& p, int64_t block, int64_t h) {
  if ((p.kind != kAbsMax && p.kind != kHeadAbsMax) || p.rows.dtype != c10::CppTypeToScalarType<R>::value)
    return {nullptr, 0};
  return {p.rows.at<R>(block, h), p.rows.token_stride};
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
// a layer into L1 one block ahead, 470 into L2 two ahead; four ahead, no better). It still asks
// the at::Tensor per block, where bf16_rows and code_rows read PageRows: written over PageRows
// (Pages::holding) and inlined, the same prefetches left decode attention 2.2x slower (8 x
// 500-token decodes, 30 layers: 10.5 ms against 4.5), not understood (BENCHMARKS.md).
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

inline Pages make_pages(int64_t kind, const at::Tensor& data, const at::Tensor& scale, const at::Tensor& zero,
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

}  // namespace cpu_kernels
