// The whole decoder stack of a small step (bf16 weights; dense pages, or pages whose codes the
// kernels encode token by token) in one call from Python.
//
// The layered model calls about nine ops per layer from Python; on a one-stream CPU decode step
// their dispatch (module calls, argument parsing, allocations) cost ~20% of the step beside the
// weights' read (BENCHMARKS.md). Here the same ops run in the same order on the same inputs, so
// a step gives the layered model's outputs bit for bit; Python sees one call per step.
#include "cpu_ops.h"

#include <ATen/record_function.h>

#include <utility>

namespace {

constexpr int64_t kDensePages = 0;  // value_types.h's kDense

// Per layer: input norm, qkv weight, qkv bias (empty: none), o weight, post-attention norm,
// gate_up weight, down weight.
constexpr int64_t kPerLayer = 7;

// One layer's pages as paged_attention reads them: the tuple the cpu backend passes it
// (attention/cpu_paged.py, CPUPagedBackend.layer_args), so both callers read the same pages.
struct LayerPages {
  int64_t k_kind, v_kind;
  at::Tensor k_data, k_scale, k_zero, k_host, v_data, v_scale, v_zero, v_host;
  int64_t k_group, v_group, k_bits, v_bits;
  bool k_symmetric, v_symmetric;
  at::Tensor k_sink, k_wide, k_wide_slot, v_sink, v_wide, v_wide_slot;

  explicit LayerPages(const pybind11::tuple& a) {
    TORCH_CHECK(a.size() == 22, "DecoderStack: a layer's pages are the 22 arguments of paged_attention");
    auto t = [&](size_t i) { return a[i].cast<at::Tensor>(); };
    auto n = [&](size_t i) { return a[i].cast<int64_t>(); };
    k_kind = n(0), k_data = t(1), k_scale = t(2), k_zero = t(3), k_host = t(4);
    v_kind = n(5), v_data = t(6), v_scale = t(7), v_zero = t(8), v_host = t(9);
    k_group = n(10), v_group = n(11), k_bits = n(12), v_bits = n(13);
    k_symmetric = a[14].cast<bool>(), v_symmetric = a[15].cast<bool>();
    k_sink = t(16), k_wide = t(17), k_wide_slot = t(18), v_sink = t(19), v_wide = t(20), v_wide_slot = t(21);
    TORCH_CHECK((k_kind == kDensePages) == (v_kind == kDensePages),
                "DecoderStack: keys and values are both dense or both encoded");
  }

  bool dense() const { return k_kind == kDensePages; }
};

class DecoderStack {
 public:
  DecoderStack(std::vector<at::Tensor> layers, at::Tensor final_norm, at::Tensor cos, at::Tensor sin,
               const std::vector<pybind11::tuple>& pages, int64_t heads, int64_t kv_heads, int64_t head_dim,
               double eps, double scale, int64_t block_size)
      : layers_(std::move(layers)), final_norm_(std::move(final_norm)), cos_(std::move(cos)),
        sin_(std::move(sin)), pages_(pages.begin(), pages.end()), heads_(heads), kv_heads_(kv_heads),
        head_dim_(head_dim), eps_(eps), scale_(scale), block_size_(block_size) {
    TORCH_CHECK(!pages_.empty() && layers_.size() == kPerLayer * pages_.size(),
                "DecoderStack: 7 tensors and one pages tuple per layer");
    const int64_t hidden = final_norm_.numel(), qkv = (heads + 2 * kv_heads) * head_dim;
    const int64_t inter = layers_[6].dim() == 4 ? layers_[6].size(1) * 2 : layers_[6].size(1);
    for (size_t i = 0; i < pages_.size(); ++i) {
      const at::Tensor* w = layers_.data() + kPerLayer * i;
      check_weight(w[1], qkv, hidden, "qkv");
      check_weight(w[3], hidden, heads * head_dim, "o");
      check_weight(w[5], 2 * inter, hidden, "gate_up");
      check_weight(w[6], hidden, inter, "down");
    }
  }

  // hidden [T, C]: the step's embedded tokens, used as the residual stream (updated in place);
  // the metadata as StepMetadata holds it. Returns the final norm's output [T, C].
  at::Tensor forward(at::Tensor hidden, const at::Tensor& positions, const at::Tensor& slot_mapping,
                     const at::Tensor& query_start, const at::Tensor& context_lens,
                     const at::Tensor& block_tables) const {
    const at::Tensor e = at::empty({0});
    const int64_t num_layers = static_cast<int64_t>(pages_.size());
    at::Tensor normed = rms_norm(hidden, layers_[0], eps_, c10::nullopt);
    for (int64_t i = 0; i < num_layers; ++i) {
      const at::Tensor* w = layers_.data() + kPerLayer * i;
      const c10::optional<at::Tensor> qkv_bias = w[2].numel() ? c10::optional<at::Tensor>(w[2]) : c10::nullopt;
      const std::vector<at::Tensor> qkv = rope_split(linear_bf16(normed, w[1], qkv_bias), positions, cos_, sin_,
                                                     heads_, kv_heads_, head_dim_);
      const LayerPages& p = pages_[i];
      at::Tensor attn;
      {
        // The doctor splits a profiled step by this label, as the layered model's.
        RECORD_FUNCTION("kvserve.attention", std::vector<c10::IValue>());
        // Dense pages are written by paged_attention itself; codes are encoded into their slots
        // first, as the cpu backend does when no token is staged.
        if (!p.dense()) {
          encode_write(qkv[1], slot_mapping, p.k_kind, p.k_data, p.k_scale, p.k_zero, p.k_group);
          encode_write(qkv[2], slot_mapping, p.v_kind, p.v_data, p.v_scale, p.v_zero, p.v_group);
        }
        const bool write = p.dense();
        attn = paged_attention(qkv[0], write ? qkv[1] : e, write ? qkv[2] : e, write ? slot_mapping : e,
                               query_start, context_lens, block_tables, p.k_kind, p.k_data, p.k_scale,
                               p.k_zero, p.k_host, p.v_kind, p.v_data, p.v_scale, p.v_zero, p.v_host, p.k_group,
                               p.v_group, p.k_bits, p.v_bits, p.k_symmetric, p.v_symmetric, p.k_sink, p.k_wide,
                               p.k_wide_slot, p.v_sink, p.v_wide, p.v_wide_slot, e, e, e, scale_, block_size_,
                               kv_heads_, 0, e, e);  // no window: cpu_stack declines windowed models
      }
      normed = rms_norm(linear_bf16(attn.view({attn.size(0), -1}), w[3], c10::nullopt), w[4], eps_, hidden);
      const at::Tensor mlp = linear_bf16(silu_mul(linear_bf16(normed, w[5], c10::nullopt)), w[6], c10::nullopt);
      normed = rms_norm(mlp, i + 1 < num_layers ? w[kPerLayer] : final_norm_, eps_, hidden);
    }
    return normed;
  }

 private:
  // A weight as linear_bf16 reads it gives exactly `outputs` columns: the rows of a weight
  // interleaved by 16 are padded, and the padding would flow into the next op's rows.
  static void check_weight(const at::Tensor& w, int64_t outputs, int64_t inputs, const char* name) {
    const bool interleaved = w.dim() == 4;
    const int64_t n = interleaved ? w.size(0) * 16 : w.size(0), k = interleaved ? w.size(1) * 2 : w.size(1);
    TORCH_CHECK(n == outputs && k == inputs, "DecoderStack: the ", name, " weight reads ", k, " inputs into ", n,
                " outputs, the layer needs ", inputs, " into ", outputs);
  }

  std::vector<at::Tensor> layers_;
  at::Tensor final_norm_, cos_, sin_;
  std::vector<LayerPages> pages_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  int64_t block_size_;
};

}  // namespace

void bind_decoder_stack(pybind11::module& m) {
  pybind11::class_<DecoderStack>(m, "DecoderStack")
      .def(pybind11::init<std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor,
                          const std::vector<pybind11::tuple>&, int64_t, int64_t, int64_t, double, double, int64_t>(),
           "per layer (input norm, qkv weight, qkv bias or empty, o weight, post-attention norm, gate_up, "
           "down), final norm, RoPE cos and sin, per layer the pages as paged_attention reads them, heads, "
           "kv heads, head dim, eps, attention scale, block size")
      .def("forward", &DecoderStack::forward, "the stack over a step's embedded tokens (updated in place)",
           pybind11::arg("hidden"), pybind11::arg("positions"), pybind11::arg("slot_mapping"),
           pybind11::arg("query_start"), pybind11::arg("context_lens"), pybind11::arg("block_tables"));
}
