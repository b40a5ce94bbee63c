// The small-batch bf16 linear (decode steps): VDPBF16PS tiles that read each weight once per
// call, AMX tiles first where the CPU has them (linear_amx.cpp), the AVX2 kernel otherwise
// (linear_avx2.cpp).
#include "cpu_ops.h"
#include "simd.h"
#include "thread_pool.h"

#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

#ifdef __AVX512BF16__
namespace {

// One MR x NR tile of out = x @ w^T: the NR weight rows are read from memory once per K step and
// reused for every row of x, with MR * NR fp32 accumulators in registers (VDPBF16PS). AHEAD: how
// many weight rows ahead the tile asks for into L2.
template <int MR, int NR, int AHEAD = 16 * NR>
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
    for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (AHEAD + j) * K + k), _MM_HINT_T1);
    for (int j = 0; j < NR; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  if constexpr (MR * NR == 16) {
    // All 16 sums in one transposed reduction: lane NR * i + j is out[i][j]. Summed one by one,
    // the reductions cost a third of the tile at K = 576.
    __m512 sums = simd::transpose_sums(&acc[0][0]);
    if (bias) {
      alignas(64) float b[16];
      for (int l = 0; l < 16; ++l) b[l] = static_cast<float>(bias[l % NR]);
      sums = _mm512_add_ps(sums, _mm512_load_ps(b));
    }
    alignas(32) c10::BFloat16 rounded[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(rounded), (__m256i)_mm512_cvtneps_pbh(sums));
    for (int i = 0; i < MR; ++i) std::copy(rounded + NR * i, rounded + NR * i + NR, out + i * N);
  } else {
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) {
        const float b = bias ? static_cast<float>(bias[j]) : 0.f;
        out[i * N + j] = static_cast<c10::BFloat16>(_mm512_reduce_add_ps(acc[i][j]) + b);
      }
  }
}

// Up to 8 rows of x against one weight row at a time (two at 8 rows, stream_rows): the weights
// stream as one sequential run per thread. Four rows at a time (gemm_rows<4>) read four
// interleaved runs, and a decode step's linears streamed at 35 GB/s where one run reached 40-42
// (AMD Zen 5, 2 threads, 1 to 8 rows; at 16 rows and more the 4 x 4 tiles' shared reductions
// win; BENCHMARKS.md).
constexpr int64_t kStreamRows = 8;

// Eight rows take two weight rows at a time: one row's tile loads 9 vectors for 8 VDPBF16PS, and
// on a CPU that loads one 512-bit vector a cycle (AMD Zen 4) the loads, not memory, set its pace.
// 8 rows x SmolLM2's 30 layers of linears (212 MB), alternated three times: 8.2-8.5 -> 7.1-7.7 ms
// in 4 KiB pages, 6.8-7.5 -> 6.5-7.1 in huge pages, 7.1-7.2 -> 5.6-6.1 with the weights in cache
// (BENCHMARKS.md). Two interleaved runs, not the four that lost on Zen 5 (not measured there).
// A lone column (an odd chunk's last) goes through the pair tile beside a copy of itself, so that
// it gets the bits it gets in a pair: the reduction differs from one row's, and which columns pair
// up depends on where a thread's chunk starts.
template <int MR>
void stream_rows(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* out,
                 int64_t begin, int64_t end, int64_t K, int64_t N) {
  if constexpr (MR == 8) {
    int64_t n = begin;
    for (; n + 2 <= end; n += 2) gemm_tile<8, 2, 16>(x, w + n * K, bias ? bias + n : nullptr, out + n, K, N);
    if (n < end) {
      std::vector<c10::BFloat16> twice(2 * K);
      std::copy(w + n * K, w + (n + 1) * K, twice.begin());
      std::copy(w + n * K, w + (n + 1) * K, twice.begin() + K);
      const c10::BFloat16 b[2] = {bias ? bias[n] : c10::BFloat16(0.f), bias ? bias[n] : c10::BFloat16(0.f)};
      c10::BFloat16 pair[16];
      gemm_tile<8, 2, 0>(x, twice.data(), bias ? b : nullptr, pair, K, 2);
      for (int i = 0; i < 8; ++i) out[i * N + n] = pair[2 * i];
    }
  } else {
    for (int64_t n = begin; n < end; ++n) gemm_tile<MR, 1>(x, w + n * K, bias ? bias + n : nullptr, out + n, K, N);
  }
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
