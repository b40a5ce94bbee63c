// How the kernels read values: the page kinds, a value in fp32 and rounded through the model
// dtype, rows of K or V in place, and a row widened to fp32. Shared by the attention kernel
// (paged_attention.cpp), the KV encoders and the per-row ops.
#pragma once

#include "simd.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

namespace cpu_kernels {

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

// Rows of K or V as the attention loop reads them: `base` plus `stride` elements per token.
// fp32 rows are blocks decoded into a buffer; bf16 rows are dense pages read in place, int8 rows
// absmax codes read in place (their scales applied per token by the attention loop).
template <typename R>
struct Rows { const R* base; int64_t stride; };

// bf16 / fp16 / fp32 row -> fp32, exactly (every such value is an fp32 value); other types by cast.
template <typename S>
inline void to_float_row(const S* src, float* dst, int64_t D) {
  int64_t d = 0;
  if constexpr (std::is_same_v<S, c10::BFloat16> || std::is_same_v<S, c10::Half> || std::is_same_v<S, float>)
    for (; d + simd::kLanes <= D; d += simd::kLanes) simd::store(dst + d, simd::load(src + d));
  for (; d < D; ++d) dst[d] = static_cast<float>(src[d]);
}

}  // namespace cpu_kernels
