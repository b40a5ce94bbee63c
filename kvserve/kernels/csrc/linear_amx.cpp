// The small-batch bf16 linear on AMX tile units (Intel Sapphire Rapids on), for 4 to 32 rows.
//
// The VDPBF16PS kernel (linear_bf16.cpp) is bound by memory at one row but by the
// vector units from a few rows on: a step's linears at 32 rows took 47-74 ms on an AMX Xeon,
// where the weight read alone takes ~10. Tiles do the 32 rows in about the read's time, from the
// same row-major weights (no second, prepacked copy): the weight rows are the tiles' A operand
// as they lie, and the few rows of x are rearranged once per call into the B operand's pairs.
// From 4 to 32 rows every output accumulates over K in the same order whatever the row count.
#include "cpu_ops.h"
#include "thread_pool.h"

#include <immintrin.h>

#ifdef __AMX_BF16__
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <vector>

#ifdef __AMX_BF16__
namespace {

// Linux hands a process the AMX tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM).
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr int64_t kRowsPerBlock = 32;  // weight rows (output columns) per work item: two A tiles
constexpr int64_t kPrefetchBlocks = 2;  // the block this many ahead is prefetched into L2
constexpr int64_t kMinRows = 4;        // fewer rows: the vector kernel (see linear_amx)

// c[4][16][16] fp32 = tiles (n 0-15, m 0-15), (n 0-15, m 16-31), (n 16-31, m 0-15), (n 16-31,
// m 16-31) of w[32 rows, K] @ x^T, x given as pairs xv[K / 2][32][2]. MB: m tiles (1: M <= 16).
template <int MB>
void tile_block(const c10::BFloat16* w, const c10::BFloat16* xv, int64_t K, float* c) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t stride = K * static_cast<int64_t>(sizeof(c10::BFloat16));
  for (int64_t k = 0; k < K; k += 32) {
    for (int64_t r = 0; r < kRowsPerBlock; ++r)
      _mm_prefetch(reinterpret_cast<const char*>(w + (kPrefetchBlocks * kRowsPerBlock + r) * K + k), _MM_HINT_T1);
    _tile_loadd(4, w + k, stride);
    _tile_loadd(5, w + 16 * K + k, stride);
    const c10::BFloat16* b = xv + k * 32;  // 16 pairs of k, 32 rows of x, 2 values
    _tile_loadd(6, b, 128);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (MB == 2) {
      _tile_loadd(7, b + 32, 128);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 64);
  _tile_stored(2, c + 2 * 256, 64);
  if constexpr (MB == 2) {
    _tile_stored(1, c + 256, 64);
    _tile_stored(3, c + 3 * 256, 64);
  }
}

}  // namespace
#endif

int64_t linear_amx(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                   at::Tensor& out) {
#ifdef __AMX_BF16__
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const int64_t blocks = N / kRowsPerBlock;
  // Below 4 rows the vector kernel is bound by memory alone, and a one-stream decode step ran
  // ~20% slower through tiles (their per-call set-up, 121 calls a step).
  if (M < kMinRows || M > 32 || blocks == 0 || !amx_permitted()) return 0;
  // x as the B operand: xv[p][m] holds x[m][2p], x[m][2p + 1]; rows past M stay zero.
  std::vector<uint32_t> pairs(K / 2 * 32, 0);
  const auto* x32 = reinterpret_cast<const uint32_t*>(x.data_ptr<c10::BFloat16>());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t p = 0; p < K / 2; ++p) pairs[p * 32 + m] = x32[m * (K / 2) + p];
  const auto* xv = reinterpret_cast<const c10::BFloat16*>(pairs.data());
  const auto* wd = w.data_ptr<c10::BFloat16>();
  const c10::BFloat16* bd = bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr;
  auto* od = out.data_ptr<c10::BFloat16>();
  kvserve::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    TileConfig config;  // every tile 16 rows of 64 bytes; the configuration is per thread
    for (int t = 0; t < 8; ++t) {
      config.rows[t] = 16;
      config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
    alignas(64) float c[4 * 256];
    const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(16));
    for (int64_t nb = begin; nb < end; ++nb) {
      if (M > 16) tile_block<2>(wd + nb * kRowsPerBlock * K, xv, K, c);
      else tile_block<1>(wd + nb * kRowsPerBlock * K, xv, K, c);
      for (int64_t half = 0; half < 2; ++half) {
        const int64_t n0 = nb * kRowsPerBlock + half * 16;
        const __m512 b = bd ? _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bd + n0)))
                            : _mm512_setzero_ps();
        for (int64_t m = 0; m < M; ++m) {
          // Row m of the output: column m % 16 of tile (half, m / 16), 16 values 16 floats apart.
          const float* tile = c + (2 * half + m / 16) * 256 + m % 16;
          const __m512 v = _mm512_add_ps(_mm512_i32gather_ps(column, tile, 4), b);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(od + m * N + n0), (__m256i)_mm512_cvtneps_pbh(v));
        }
      }
    }
    _tile_release();
  });
  return blocks * kRowsPerBlock;
#else
  return 0;
#endif
}
