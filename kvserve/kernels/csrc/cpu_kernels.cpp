// The CPU kernels' Python module: each op is defined in its own file (paged_attention.cpp,
// kv_encode.cpp, row_ops.cpp, linear_*.cpp, decoder_stack.cpp) and declared in cpu_ops.h.
//
// Every op computes in fp32 and rounds once to the output dtype, so fp32 runs match the
// reference to rounding, and bf16 runs differ from the eager ops only by their intermediate
// roundings. int8 / fp8 codes are attended as code x scale in fp32, where the reference rounds
// that product to the model dtype first.
#include "cpu_ops.h"
#include "thread_pool.h"

#include <torch/extension.h>

#include <map>
#include <string>

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
  m.def("encode_fitted_write", &encode_fitted_write, "encode K or V rows into fitted int8 / fp8 page fields");
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally after adding into a residual");
  m.def("offset_rms_norm", &offset_rms_norm, "Gemma's RMSNorm (times 1 + weight), optionally after a residual add");
  m.def("rope_split", &rope_split, "RoPE in place on the q and k heads of qkv, then q, k, v views");
  m.def("gelu_tanh_mul", &gelu_tanh_mul, "gate_up [T, 2I] -> gelu_tanh(gate) * up (GeGLU)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  // Without the GIL, as torch.argmax (which it replaces) runs.
  m.def("argmax", &argmax, "each row's first largest value's index, as torch.argmax (the greedy pick)", py::arg("x"),
        py::call_guard<py::gil_scoped_release>());
  m.def("widen", &widen, "bf16 / fp16 rows -> fp32, exactly, on the kernels' pool (the stack's logits)", py::arg("x"),
        py::call_guard<py::gil_scoped_release>());
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
