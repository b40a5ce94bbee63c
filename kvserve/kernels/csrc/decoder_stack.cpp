// The whole decoder stack of a small step (bf16, dense pages) in one call from Python.
//
// The layered model calls about nine ops per layer from Python; on a one-stream CPU decode step
// their dispatch (module calls, argument parsing, allocations) cost ~20% of the step beside the
// weights' read (BENCHMARKS.md). Here the same ops run in the same order on the same inputs, so
// a step gives the layered model's outputs bit for bit; Python sees one call per step.
#include "cpu_ops.h"

#include <ATen/record_function.h>

#include <utility>

namespace {

constexpr int64_t kDensePages = 0;  // cpu_kernels.cpp's kDense

// Per layer: input norm, qkv weight, qkv bias (empty: none), o weight, post-attention norm,
// gate_up weight, down weight.
constexpr int64_t kPerLayer = 7;

class DecoderStack {
 public:
  DecoderStack(std::vector<at::Tensor> layers, at::Tensor final_norm, at::Tensor cos, at::Tensor sin,
               std::vector<at::Tensor> k_pages, std::vector<at::Tensor> v_pages, std::vector<at::Tensor> k_host,
               std::vector<at::Tensor> v_host, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
               double scale, int64_t block_size)
      : layers_(std::move(layers)), final_norm_(std::move(final_norm)), cos_(std::move(cos)),
        sin_(std::move(sin)), k_pages_(std::move(k_pages)), v_pages_(std::move(v_pages)),
        k_host_(std::move(k_host)), v_host_(std::move(v_host)), heads_(heads), kv_heads_(kv_heads),
        head_dim_(head_dim), eps_(eps), scale_(scale), block_size_(block_size) {
    const size_t n = k_pages_.size();
    TORCH_CHECK(n > 0 && layers_.size() == kPerLayer * n && v_pages_.size() == n && k_host_.size() == n &&
                v_host_.size() == n, "DecoderStack: 7 tensors and K/V pages (device and host) per layer");
  }

  // hidden [T, C]: the step's embedded tokens, used as the residual stream (updated in place);
  // the metadata as StepMetadata holds it. Returns the final norm's output [T, C].
  at::Tensor forward(at::Tensor hidden, const at::Tensor& positions, const at::Tensor& slot_mapping,
                     const at::Tensor& query_start, const at::Tensor& context_lens,
                     const at::Tensor& block_tables) const {
    const at::Tensor e = at::empty({0});
    const int64_t num_layers = static_cast<int64_t>(k_pages_.size());
    at::Tensor normed = rms_norm(hidden, layers_[0], eps_, c10::nullopt);
    for (int64_t i = 0; i < num_layers; ++i) {
      const at::Tensor* w = layers_.data() + kPerLayer * i;
      const c10::optional<at::Tensor> qkv_bias = w[2].numel() ? c10::optional<at::Tensor>(w[2]) : c10::nullopt;
      const std::vector<at::Tensor> qkv = rope_split(linear_bf16(normed, w[1], qkv_bias), positions, cos_, sin_,
                                                     heads_, kv_heads_, head_dim_);
      at::Tensor attn;
      {
        // The doctor splits a profiled step by this label, as the layered model's.
        RECORD_FUNCTION("kvserve.attention", std::vector<c10::IValue>());
        attn = paged_attention(qkv[0], qkv[1], qkv[2], slot_mapping, query_start, context_lens, block_tables,
                               kDensePages, k_pages_[i], e, e, k_host_[i], kDensePages, v_pages_[i], e, e,
                               v_host_[i], 0, 0, 0, 0, false, false, e, e, e, e, e, e, e, e, e, scale_,
                               block_size_, kv_heads_, e, e);
      }
      normed = rms_norm(linear_bf16(attn.view({attn.size(0), -1}), w[3], c10::nullopt), w[4], eps_, hidden);
      const at::Tensor mlp = linear_bf16(silu_mul(linear_bf16(normed, w[5], c10::nullopt)), w[6], c10::nullopt);
      normed = rms_norm(mlp, i + 1 < num_layers ? w[kPerLayer] : final_norm_, eps_, hidden);
    }
    return normed;
  }

 private:
  std::vector<at::Tensor> layers_;
  at::Tensor final_norm_, cos_, sin_;
  std::vector<at::Tensor> k_pages_, v_pages_, k_host_, v_host_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  int64_t block_size_;
};

}  // namespace

void bind_decoder_stack(pybind11::module& m) {
  pybind11::class_<DecoderStack>(m, "DecoderStack")
      .def(pybind11::init<std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor, std::vector<at::Tensor>,
                          std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t,
                          int64_t, int64_t, double, double, int64_t>(),
           "per layer (input norm, qkv weight, qkv bias or empty, o weight, post-attention norm, gate_up, "
           "down), final norm, RoPE cos and sin, K/V pages and host pages per layer, heads, kv heads, "
           "head dim, eps, attention scale, block size")
      .def("forward", &DecoderStack::forward, "the stack over a step's embedded tokens (updated in place)",
           pybind11::arg("hidden"), pybind11::arg("positions"), pybind11::arg("slot_mapping"),
           pybind11::arg("query_start"), pybind11::arg("context_lens"), pybind11::arg("block_tables"));
}
