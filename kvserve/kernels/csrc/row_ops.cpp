// The per-row ops between a layer's linears, each one pass in fp32 rounded once to the dtype:
// RMSNorm with the residual add, RoPE on q and k, and the gated MLP's activation; and two on the
// logits after the last: the greedy pick (argmax) and their widening to fp32 (widen).
#include "cpu_ops.h"
#include "simd.h"
#include "thread_pool.h"
#include "value_types.h"

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

using namespace cpu_kernels;

// Whether simd's loads and stores take T (bf16, fp16, fp32; double runs the scalar loops).
template <typename T>
constexpr bool kVectorType = !std::is_same_v<T, double>;

// One row of norm_rows: residual (optional) += x, rounded to T as stored, then the normalised row.
template <typename T>
void norm_row(const T* x, T* residual, const T* w, T* out, float* row, int64_t C, float eps, bool offset) {
  using namespace simd;
  int64_t c = 0;
  vf squares = zero();
  if constexpr (kVectorType<T>) {
    for (; c + kLanes <= C; c += kLanes) {
      vf v = load(x + c);
      if (residual) {
        store_as(residual + c, add(load(residual + c), v));
        v = load(residual + c);
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

// Index of the first largest value of x[:n], as torch.argmax picks it (a NaN is the largest: the
// first NaN's index). Each 256-value run's max in vectors, then the first run that holds the
// row's max is searched: torch's argmax took 330-410 us of a 16-ms decode step over SmolLM2's
// 8 x 49,152 logits. A NaN sum (a NaN, or an inf beside a -inf) sends the row to the exact scalar
// loop.
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  constexpr int64_t kRun = 256;
  if constexpr (kVectorType<T>) {
    using namespace simd;
    const int64_t runs = n / kRun;
    std::vector<float> run_max(runs + 1, -std::numeric_limits<float>::infinity());
    vf sums = zero();
    for (int64_t r = 0; r < runs; ++r) {
      vf mx = load(x + r * kRun);
      sums = add(sums, mx);
      for (int64_t c = kLanes; c < kRun; c += kLanes) {
        const vf v = load(x + r * kRun + c);
        mx = max(mx, v);
        sums = add(sums, v);
      }
      run_max[r] = reduce_max(mx);
    }
    float sum = reduce_add(sums);
    for (int64_t c = runs * kRun; c < n; ++c) {  // the last, short run
      run_max[runs] = std::max(run_max[runs], to_f(x[c]));
      sum += to_f(x[c]);
    }
    if (!std::isnan(sum)) {
      const auto best = std::max_element(run_max.begin(), run_max.end());  // the first run holding it
      for (int64_t c = (best - run_max.begin()) * kRun; c < n; ++c)
        if (to_f(x[c]) == *best) return c;
    }
  }
  // Compared in fp32, or in fp64 for fp64 rows: rounded to fp32, two fp64 values could tie.
  using Compare = std::conditional_t<std::is_same_v<T, double>, double, float>;
  int64_t at = 0;
  Compare best = static_cast<Compare>(x[0]);
  for (int64_t i = 0; i < n; ++i) {
    const Compare v = static_cast<Compare>(x[i]);
    if (std::isnan(v)) return i;
    if (v > best) best = v, at = i;
  }
  return at;
}

// x [B, V] (rows contiguous) -> int64 [B]: each row's argmax (argmax_row), rows over the pool.
at::Tensor argmax(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "argmax: x must be on the CPU, got ", x.device());
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.stride(1) == 1, "argmax: x must be [B, V] with contiguous rows");
  const int64_t B = x.size(0), V = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({B}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "argmax", [&] {
    const scalar_t* xd = x.data_ptr<scalar_t>();
    kvserve::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) o[b] = argmax_row(xd + b * stride, V);
    });
  });
  return out;
}

// x [R, C] bf16 or fp16 (rows contiguous) -> fp32 [R, C], exactly: the decoder stack's logits as
// the sampler takes them, rows over the pool; fp32 x is returned as it is, as `.float()` does.
// torch's `.float()` ran on its OpenMP team, whose second thread waited for the core the pool's
// spinning worker held: ~0.2 ms of a 16-ms decode step for 8 x 49,152 logits.
at::Tensor widen(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "widen: x must be on the CPU, got ", x.device());
  if (x.scalar_type() == at::kFloat) return x;
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf),
              "widen: x must be bf16, fp16 or fp32 [R, C] with contiguous rows");
  const int64_t R = x.size(0), C = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({R, C}, x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "widen", [&] {
    const scalar_t* xd = x.data_ptr<scalar_t>();
    kvserve::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) to_float_row(xd + r * stride, o + r * C, C);
    });
  });
  return out;
}
