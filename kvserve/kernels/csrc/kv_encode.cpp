// Encoding K or V rows into int8 / fp8 / int4 page fields, one token at a time (encode_write): the
// cpu backend's writes and the decoder stack's, for pages the attention kernel reads; fitted int8 /
// fp8 codes (encode_fitted_write); and dense pages' plain copy (write_kv).
#include "cpu_ops.h"
#include "simd.h"
#include "thread_pool.h"
#include "value_types.h"

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

using namespace cpu_kernels;

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

// The e4m3 value nearest v (ties to even) for |v| <= 448, as float: what c10's Float8_e4m3fn cast
// and back gives, without its per-value conversion (a fitted search rounds 64 candidates a value).
// Normals keep 3 of float's 23 mantissa bits; below 2^-6, e4m3's subnormals are steps of 2^-9.
inline float e4m3_value(float v) {
  if (std::abs(v) < 0x1p-6f) return std::nearbyint(v * 512.f) / 512.f;
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  b = (b + 0x7FFFFu + ((b >> 20) & 1u)) & 0xFFF00000u;
  std::memcpy(&v, &b, sizeof v);
  return v;
}

// One token and head of fitted codes (cache/formats/fitted.py, FittedFormat.encode): the row less
// `off`, divided by `spr` (each null: none), then of the candidate scales amax / targets[j] (fp16,
// rounded up) the one whose error e gives the least e^T W e (|e|^2 with W null), the first such.
// The same operations per value as the format's; a cost is summed in another order than torch's
// einsum, so a near-tie between two candidates may go the other way. buf: 5 * D floats.
template <typename T, typename Code>
void encode_fitted(const T* x, const float* off, const float* spr, const float* W, const float* targets, int64_t S,
                   Code* codes, c10::Half* scale, int64_t D, float qmax, bool is_float, float* buf) {
  float* xr = buf;
  float* c = buf + D;
  float* best = buf + 2 * D;
  float* e = buf + 3 * D;
  float* wt = buf + 4 * D;
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) {
    float v = static_cast<float>(x[d]);
    if (off) v -= off[d];
    if (spr) v /= spr[d];
    xr[d] = v;
    amax = std::max(amax, std::abs(v));
  }
  float best_cost = std::numeric_limits<float>::infinity();
  c10::Half best_scale(kMinScale);
  for (int64_t j = 0; j < S; ++j) {
    const c10::Half sh = fp16_rounded(std::max(amax / targets[j], kMinScale), true);
    const float sf = static_cast<float>(sh);
    for (int64_t d = 0; d < D; ++d) {
      const float v = std::min(std::max(xr[d] / sf, -qmax), qmax);
      c[d] = is_float ? e4m3_value(v) : std::nearbyint(v);
    }
    for (int64_t d = 0; d < D; ++d) e[d] = c[d] * sf - xr[d];
    // e^T W e as e . (W^T e), W^T e summed row by row of W: the inner loop runs along a row, in
    // vectors (a dot product per row would be one dependent chain the compiler may not reorder).
    const float* y = e;  // W^T e, or e without a weight
    if (W) {
      std::fill(wt, wt + D, 0.f);
      for (int64_t k = 0; k < D; ++k) {
        const float ek = e[k];
        const float* w = W + k * D;
        for (int64_t d = 0; d < D; ++d) wt[d] += w[d] * ek;
      }
      y = wt;
    }
    float cost = 0.f;
    for (int64_t d = 0; d < D; ++d) cost += e[d] * y[d];
    if (j == 0 || cost < best_cost) {
      best_cost = cost, best_scale = sh;
      std::copy(c, c + D, best);
    }
  }
  for (int64_t d = 0; d < D; ++d) codes[d] = static_cast<Code>(best[d]);
  *scale = best_scale;
}

}  // namespace

// Fitted int8 / fp8 codes (encode_fitted) of x [T, H, D] into the page fields at slot_mapping: the
// cpu backend's writes of int8_fit and fp8_e4m3_fit pages, whose torch encode ran ~20 torch calls
// a layer on 64 copies of the step's rows. offset, spread [H, D] and weight [H, D, D] fp32, each
// empty where the format has none; targets [S] fp32, the candidates (FittedFormat.targets).
void encode_fitted_write(const at::Tensor& x, const at::Tensor& slot_mapping, const at::Tensor& codes,
                         const at::Tensor& scale, const at::Tensor& offset, const at::Tensor& spread,
                         const at::Tensor& weight, const at::Tensor& targets) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1,
              "encode_fitted_write: x must be [T, H, D] on the CPU with contiguous D");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), S = targets.numel();
  auto table = [&](const at::Tensor& t, std::vector<int64_t> shape, const char* name) -> const float* {
    if (t.numel() == 0) return nullptr;
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.sizes() == at::IntArrayRef(shape),
                "encode_fitted_write: ", name, " must be contiguous fp32 of the heads' shape");
    return t.data_ptr<float>();
  };
  const float* off = table(offset, {H, D}, "offset");
  const float* spr = table(spread, {H, D}, "spread");
  const float* W = table(weight, {H, D, D}, "weight");
  TORCH_CHECK(S > 0 && targets.scalar_type() == at::kFloat && targets.is_contiguous(),
              "encode_fitted_write: targets must be contiguous fp32");
  TORCH_CHECK(scale.scalar_type() == at::kHalf, "encode_fitted_write: scales are fp16");
  TORCH_CHECK(codes.is_contiguous() && scale.is_contiguous() && codes.dim() >= 2 && codes.size(-1) == D &&
                  codes.size(-2) == H && scale.numel() * D == codes.numel(),
              "encode_fitted_write: codes [..., H, D] and scales [..., H], contiguous, of x's heads and dim");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == T,
              "encode_fitted_write: one int64 slot per token of x");
  const int64_t num_slots = scale.numel() / std::max<int64_t>(H, 1);
  const float* tg = targets.data_ptr<float>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "encode_fitted_write: slot ", slots[t], " outside the ",
                num_slots, " slots of the pages");
  auto* sc = scale.data_ptr<c10::Half>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "encode_fitted_write", [&] {
    const scalar_t* xd = x.data_ptr<scalar_t>();
    kvserve::parallel_for(0, T * H, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(5 * D);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t t = i / H, h = i % H, slot = slots[t] * H + h;
        const scalar_t* row = xd + t * x.stride(0) + h * x.stride(1);
        const float* o = off ? off + h * D : nullptr;
        const float* sp = spr ? spr + h * D : nullptr;
        const float* w = W ? W + h * D * D : nullptr;
        switch (codes.scalar_type()) {
          case at::kChar:
            encode_fitted(row, o, sp, w, tg, S, codes.data_ptr<int8_t>() + slot * D, sc + slot, D, 127.f, false,
                          buf.data());
            break;
          case at::kFloat8_e4m3fn:
            encode_fitted(row, o, sp, w, tg, S, codes.data_ptr<c10::Float8_e4m3fn>() + slot * D, sc + slot, D, 448.f,
                          true, buf.data());
            break;
          default: TORCH_CHECK(false, "encode_fitted_write: unsupported code dtype ", codes.scalar_type());
        }
      }
    }, kvserve::team_for(T, x.scalar_type()));
  });
}

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
