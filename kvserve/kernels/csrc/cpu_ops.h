// The kernels' ops, each documented where it is defined: paged_attention.cpp, kv_encode.cpp,
// row_ops.cpp, linear_bf16.cpp and the files named below. cpu_kernels.cpp binds them for Python;
// decoder_stack.cpp composes them.
#pragma once

#include <torch/extension.h>

#include <vector>

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
bool has_bf16_gemm();
bool interleaves_bf16_weights();
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, c10::optional<at::Tensor> residual);
at::Tensor offset_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                           c10::optional<at::Tensor> residual);
std::vector<at::Tensor> rope_split(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                                   const at::Tensor& sin, int64_t heads, int64_t kv_heads, int64_t head_dim);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor gelu_tanh_mul(const at::Tensor& gate_up);
at::Tensor argmax(const at::Tensor& x);
at::Tensor widen(const at::Tensor& x);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                           const at::Tensor& slot_mapping, const at::Tensor& query_start,
                           const at::Tensor& context_lens, const at::Tensor& block_tables, int64_t k_kind,
                           const at::Tensor& k_data, const at::Tensor& k_scale, const at::Tensor& k_zero,
                           const at::Tensor& k_host, int64_t v_kind, const at::Tensor& v_data,
                           const at::Tensor& v_scale, const at::Tensor& v_zero, const at::Tensor& v_host,
                           int64_t k_group, int64_t v_group, int64_t k_bits, int64_t v_bits, bool k_symmetric,
                           bool v_symmetric, const at::Tensor& k_sink, const at::Tensor& k_wide,
                           const at::Tensor& k_wide_slot, const at::Tensor& v_sink, const at::Tensor& v_wide,
                           const at::Tensor& v_wide_slot, const at::Tensor& stage_of, const at::Tensor& k_staging,
                           const at::Tensor& v_staging, double scale, int64_t block_size, int64_t num_kv_heads,
                           int64_t window, const at::Tensor& score_first, at::Tensor scores);
void encode_write(const at::Tensor& x, const at::Tensor& slot_mapping, int64_t kind, const at::Tensor& codes,
                  const at::Tensor& scale, const at::Tensor& zero, int64_t group);
void encode_fitted_write(const at::Tensor& x, const at::Tensor& slot_mapping, const at::Tensor& codes,
                         const at::Tensor& scale, const at::Tensor& offset, const at::Tensor& spread,
                         const at::Tensor& weight, const at::Tensor& targets);
// Dense pages: k, v [T, Hkv, D] (rows may be strided) into slot_mapping's flat slots (kv_encode.cpp).
void write_kv(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping);

// linear_amx.cpp: out[:, :n] of linear_bf16 on AMX tiles, n a multiple of 32 (0: not done here,
// without AMX, or outside 4-32 rows); returns n.
int64_t linear_amx(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                   at::Tensor& out);

// linear_avx2.cpp: linear_bf16 on CPUs with AVX2 and FMA but no AVX512-BF16, into out [M, N];
// w is interleaved, [ceil(N / 16), K / 2, 16, 2], and out [M, 16 * w.size(0)].
void linear_avx2(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, at::Tensor& out);

// linear_f32.cpp: fp32 x @ w^T whose rows never depend on their batch; w [ceil(N / 16), K, 16],
// out [M, 16 * w.size(0)].
at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);

// linear_onednn.cpp: x @ w^T (+ bias) for a prefill's rows, w [N, K] as nn.Linear holds it: the
// output columns split in chunks over the kernels' pool, each one oneDNN matmul on one thread. The
// rows run as a multiple of `row_bucket` plus the remainder (two calls): oneDNN builds and caches a
// primitive per shape it sees, and bounded row counts bound that cache (model/cpu_linear.py's
// ROW_BUCKET, which the caller passes).
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                       int64_t row_bucket);

// Registers DecoderStack (decoder_stack.cpp) on the extension module.
void bind_decoder_stack(pybind11::module& m);
