// CPU kernels for kvserve: paged attention that reads KV pages in place (dense or compressed,
// decoded block by block inside the kernel); dense pages' new keys and values are written first
// (write_kv, kv_encode.cpp).
//
// Every op computes in fp32 and rounds once to the output dtype, so fp32 runs match the
// reference to rounding, and bf16 runs differ from the eager ops only by their intermediate
// roundings; on AVX512-BF16, bf16 value pages (or staging slots) against a bf16 query with a head
// dim that is a multiple of 32 are summed by pair dot products with the softmax weights rounded to
// bf16 first, an error of the size the eager ops' rounded probabilities make. int8 / fp8 codes are
// attended as code x scale in fp32, where the reference rounds that product to the model dtype
// first.
#include "attention_math.h"
#include "cpu_ops.h"
#include "page_reads.h"
#include "simd.h"
#include "thread_pool.h"
#include "value_types.h"
#include "work_items.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

using namespace cpu_kernels;

namespace {

// Dense bf16 keys and values, read by pair dot products, are attended this many blocks at a time
// (64 keys at block 16): a row's softmax update, its pass over the sums and the calls that set
// them up come once a span, where block by block they and the keys' transposes were most of a
// decode row's time (a GQA group's 3 rows against 16 keys). Spans start at multiples of it in
// the block table, so a decode and a prompt's rows see each key in the same span: the same bits.
constexpr int64_t kSpanBlocks = 4;

template <typename T>
void attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& query_start,
                    const at::Tensor& context_lens, const at::Tensor& block_tables,
                    const Pages& kp, const Pages& vp, const at::Tensor& stage_of,
                    const at::Tensor& k_staging, const at::Tensor& v_staging, double scale,
                    int64_t block_size, int64_t num_kv_heads, int64_t window, const at::Tensor& score_first,
                    at::Tensor& scores) {
  const int64_t B = context_lens.size(0);
  const int64_t H = q.size(1), D = q.size(2), G = H / num_kv_heads;
  const int64_t* qs = query_start.data_ptr<int64_t>();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t table_stride = block_tables.stride(0);
  const int64_t* stage = stage_of.defined() && stage_of.numel() ? stage_of.data_ptr<int64_t>() : nullptr;
  // A sliding window (window > 0): an item starts at the block holding its first row's first key
  // (work_items.h); the blocks before it are never read (a hybrid KV cache points their table
  // entries at a null block).
  auto first_key = [window](int64_t slot) { return window_start(slot, window); };
  // Scores: the softmax weights of a sequence's query rows from score_first[b] on (-1: none),
  // summed over those rows and averaged over the group's query heads, into scores[b, h, slot].
  // A scored sequence is one item per head, so no two threads add into the same row.
  const int64_t* first = score_first.numel() ? score_first.data_ptr<int64_t>() : nullptr;
  float* sc = first ? scores.data_ptr<float>() : nullptr;
  const int64_t sc_b = first ? scores.stride(0) : 0, sc_h = first ? scores.stride(1) : 0;
  const WorkPlan plan = plan_items(B, qs, ctx, first, num_kv_heads, G, block_size, window);
  const std::vector<Item>& items = plan.items;
  const std::vector<Split>& splits = plan.splits;
  // The pieces' running max and sum per row and weighted values per row [.., D].
  std::vector<float> part_m(plan.num_part_rows), part_l(plan.num_part_rows), part_acc(plan.num_part_rows * D);
  std::atomic<int64_t> next_item{0};
  const int64_t num_items = static_cast<int64_t>(items.size());

  const T* qd = q.data_ptr<T>();
  const int64_t q_tok = q.stride(0), q_head = q.stride(1);
  T* od = out.data_ptr<T>();
  const int64_t o_tok = out.stride(0), o_head = out.stride(1);
  const float fscale = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // bf16 keys read in place against a bf16 query take pair_scores (where the CPU has them).
  constexpr bool bf16_pairs = simd::kPairDots && std::is_same_v<T, c10::BFloat16>;
  const bool pairs = bf16_pairs && D % (2 * simd::kLanes) == 0;
  // Dense bf16 keys and values (both read by pair dot products) are attended a span of blocks at a
  // time (spans), other pages block by block.
  const bool spans = pairs && block_size % 16 == 0 && bf16_pages(kp) && bf16_pages(vp) && stage == nullptr;
  const int64_t span = spans ? kSpanBlocks : 1, span_len = span * block_size;
  // A span in 16-key tiles; in pairs.
  const int64_t w_len = span * ((block_size + 15) / 16 * 16), w_stride = w_len / 2;

  // A staged format's full-precision slots, read as dense pages (stage_of).
  const Pages sk{kDense, &k_staging, nullptr, nullptr, nullptr, 0};
  const Pages sv{kDense, &v_staging, nullptr, nullptr, nullptr, 0};
  const kvserve::Team team = kvserve::team_for(q.size(0), q.scalar_type());
  kvserve::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1, [&](int64_t, int64_t) {
    std::vector<c10::BFloat16> qpairs;  // bf16 query rows, unscaled, for pair_scores
    std::vector<uint32_t> kT(pairs ? w_len * D / 2 : 0);  // a span's keys, transposed
    // A span's values in key pairs (pair_values), and each row's weights in pairs over the span.
    std::vector<uint32_t> vP(pairs ? span * ((block_size + 1) / 2) * D : 0), wpairs;
    std::vector<float> qbuf, acc, kbuf(block_size * D), vbuf(block_size * D), kscale(block_size),
        vscale(block_size), sbuf, m, l, corrections, tops;
    std::vector<int64_t> pos;
    for (int64_t it; (it = next_item.fetch_add(1)) < num_items;) {
      const Item w = items[it];
      const int64_t q_len = qs[w.b + 1] - qs[w.b];
      const int64_t rows = (w.q1 - w.q0) * G;
      qbuf.assign(rows * D, 0.f);
      if (pairs) qpairs.resize(rows * D);
      acc.assign(rows * D, 0.f);
      sbuf.assign(rows * span_len, 0.f);
      m.assign(rows, neg_inf);
      l.assign(rows, 0.f);
      corrections.assign(rows, 1.f);
      tops.assign(rows, neg_inf);
      if (pairs) wpairs.resize(rows * w_stride);
      pos.assign(rows, 0);
      for (int64_t i = 0; i < w.q1 - w.q0; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = i * G + g;
          const T* src = qd + (w.q0 + i) * q_tok + (w.h * G + g) * q_head;
          for (int64_t d = 0; d < D; ++d) qbuf[r * D + d] = to_f(src[d]) * fscale;
          if constexpr (bf16_pairs)
            if (pairs) std::copy(src, src + D, qpairs.begin() + r * D);
          // Token j of a sequence's new tokens sits at position ctx - q_len + j.
          pos[r] = ctx[w.b] - q_len + (w.q0 + i - qs[w.b]);
        }
      const int64_t last = pos[rows - 1];  // the furthest key any row of this item sees
      const int64_t nblocks = w.bi1;  // the scoring pass (never a split item, never windowed) reads them all
      // bf16 pages and int8 / fp8 codes are read in place by a decode item, whose few rows would
      // not repay decoding a block into fp32 first; a prefill item's 30-odd rows would each widen
      // the same keys again. Either way gives the same values (both widen exactly). bf16 pages
      // whose keys pair_scores scores are read in place by every item: it does not widen the keys,
      // a decode and a prompt's rows (a chunk, a verified draft) then get the same scores, bit
      // for bit. bf16 values are summed by pair dot products, rows 4 at a time; other values of a
      // block all of a prompt item's rows see whole are accumulated rows 3 at a time, widened once
      // for the three.
      const bool direct = rows <= 8;
      // Block bi of the item's table: its keys (and with `values` its values) read in place or
      // decoded into kbuf / vbuf, with absmax scales into kscale / vscale, and for pair dot
      // products transposed into kT and paired into vP from key `into` of the span on; returns its
      // tokens and rows. A block inside the full-precision window is read from its staging slot
      // instead.
      struct Loaded { int64_t n; BlockRows k, v; };
      auto load_block = [&](int64_t bi, bool values, [[maybe_unused]] int64_t into) {
        const int64_t block = tables[w.b * table_stride + bi];
        const int64_t slot = stage ? stage[block] : -1;
        const int64_t at = slot >= 0 ? slot : block;
        Loaded got{std::min(block_size, last + 1 - bi * block_size), {{kbuf.data(), D}}, {{vbuf.data(), D}}};
        auto read = [&](const Pages& page, BlockRows& rows, float* buf, float* scales) {
          // bf16 pages of another model dtype are rounded to it as they are decoded.
          if constexpr (std::is_same_v<T, c10::BFloat16>)
            if (direct || pairs) rows.bf16 = bf16_rows(page, at, w.h);
          if (direct) {
            rows.i8 = code_rows<int8_t>(page, at, w.h);
            rows.e4m3 = code_rows<c10::Float8_e4m3fn>(page, at, w.h);
            rows.e5m2 = code_rows<c10::Float8_e5m2>(page, at, w.h);
          }
          if (!rows.in_place()) decode_block<T>(page, at, got.n, w.h, D, buf);
          rows.scale = absmax_scales(page, at, got.n, w.h, scales);
        };
        read(slot >= 0 ? sk : kp, got.k, kbuf.data(), kscale.data());
#if defined(__AVX512BF16__)
        if (pairs && got.k.bf16.base) transpose_pairs(got.k.bf16, got.n, D, kT.data() + into * D / 2);
#endif
        if (values) read(slot >= 0 ? sv : vp, got.v, vbuf.data(), vscale.data());
#if defined(__AVX512BF16__)
        if (pairs && got.v.bf16.base) pair_values(got.v.bf16, got.n, D, vP.data() + into / 2 * D);
#endif
        return got;
      };
      // Blocks [b0, b1) as one span of keys and values (b0 < b1; several only where spans: only the
      // last can be partial, and the span's keys are read from kT and vP alone): returns the span's
      // tokens, and the rows of its last block. Each block asks for the one kAhead on (the item's
      // first, for all up to it). Not a span on, which was slower than no spans at all
      // (8 x 450-token decodes over 30 layers' pages, alternated: a span ahead 4.8-5.0 ms against
      // 4.2-4.9 block by block; two blocks ahead 3.6-3.9 against 4.0-4.1), likely because a span's
      // 256 lines asked for at once fill the miss buffers and the reads wait behind them.
      auto load_span = [&](int64_t b0, int64_t b1) {
        Loaded got{};
        for (int64_t bi = b0; bi < b1; ++bi) {
          for (int64_t a = bi == w.bi0 ? 1 : kAhead; !stage && a <= kAhead && bi + a < w.bi1; ++a) {
            const int64_t next = tables[w.b * table_stride + bi + a];
            prefetch_block(kp, next, w.h, block_size);
            prefetch_block(vp, next, w.h, block_size);
          }
          got = load_block(bi, true, (bi - b0) * block_size);
        }
        got.n += (b1 - 1 - b0) * block_size;
        return got;
      };
      // Rows [r, r + R) scored against the block's keys from skip on, n[i] of them for row r + i:
      // sbuf's row r + i gets q . k[skip + t] * scale[skip + t], tops[r + i] their max.
      auto score_rows = [&](auto count, int64_t r, const BlockRows& block, int64_t skip, const int64_t* n) {
        constexpr int R = decltype(count)::value;
        float* s = sbuf.data() + r * span_len;
#if defined(__AVX512BF16__)
        if (pairs && block.bf16.base) {
          const int64_t a = skip / 16 * 16;  // pair_scores starts at a tile
          int64_t ends[R];
          for (int i = 0; i < R; ++i) ends[i] = skip + n[i];
          pair_scores<R>(qpairs.data() + r * D, kT.data(), a, ends, D, fscale, s, span_len, tops.data() + r);
          if (a != skip)
            for (int i = 0; i < R; ++i) {
              float* si = s + i * span_len;
              std::memmove(si, si + (skip - a), n[i] * sizeof(float));
              tops[r + i] = *std::max_element(si, si + n[i]);
            }
          return;
        }
#endif
        const BlockRows k = block.from(skip);
        for (int i = 0; i < R; ++i) {
          float* si = s + i * span_len;
          tops[r + i] = k.visit([&](auto kr) { return dots(qbuf.data() + (r + i) * D, kr, n[i], D, si); });
          if (k.scale == nullptr) continue;
          float mx = neg_inf;
          for (int64_t t = 0; t < n[i]; ++t) mx = std::max(mx, si[t] *= k.scale[t]);
          tops[r + i] = mx;
        }
      };
      // A block's values into every row's sums, rows three at a time (rows that see the same keys).
      auto accumulate_group = [&](int64_t bi, const Loaded& blk) {
        const int64_t k0 = bi * block_size, skip = std::max<int64_t>(0, first_key(pos[0]) - k0);
        const int64_t visible = std::min(blk.n, pos[0] + 1 - k0) - skip;
        if (visible <= 0) return;  // the rows skipped the block too (their corrections are 1)
        const BlockRows v = blk.v.from(skip);
        auto run = [&](auto tile, int64_t r) {
          v.visit([&](auto vr) {
            scale_accumulate_group<decltype(tile)::value>(acc.data() + r * D, corrections.data() + r,
                                                          sbuf.data() + r * span_len, span_len, vr, visible, D);
          });
        };
        int64_t r = 0;
        for (; r + 3 <= rows; r += 3) run(std::integral_constant<int, 3>{}, r);
        if (rows - r == 2) run(std::integral_constant<int, 2>{}, r);
        if (rows - r == 1) run(std::integral_constant<int, 1>{}, r);
      };
      // One query token's rows (a decode item, or a prompt's one-token chunk) see the same keys:
      // their values are accumulated together (scale_accumulate_group).
      const bool grouped = w.q1 - w.q0 == 1 && groups_accumulate(D);
      for (int64_t bi = w.bi0, end; bi < w.bi1; bi = end) {
        // A span ends at a multiple of `span` blocks: a sequence's spans are the same whichever
        // item reads them, and so are a row's bits.
        end = std::min(w.bi1, (bi / span + 1) * span);
        const Loaded blk = load_span(bi, end);
        const int64_t k0 = bi * block_size;
        // A prompt item's rows that all see the whole block take its values together too (the
        // same bits as one row at a time where scale_accumulate has a register tile for D).
        const bool together = grouped || (groups_accumulate(D) && k0 + blk.n - 1 <= pos[0] &&
                                          first_key(pos[rows - 1]) <= k0);
        // Causal: keys at or before pos; windowed, from its first key on. s[t] is key k0 + skip + t.
        auto skip_of = [&](int64_t r) { return std::max<int64_t>(0, first_key(pos[r]) - k0); };
        auto visible_of = [&](int64_t r, int64_t skip) { return std::min(blk.n, pos[r] + 1 - k0) - skip; };
        // Every row's scores, then every row's softmax, then the values: one row's chain of
        // dependent steps (sums, max, exponentials, sum) is long and its work short, so row after
        // row of the whole chain left the cores waiting; phase by phase the rows' chains overlap.
        for (int64_t r = 0; r < rows;) {  // up to 4 rows of one skip at a time
          const int64_t skip = skip_of(r);
          int64_t n[4];
          int count = 0;
          while (count < 4 && r + count < rows && skip_of(r + count) == skip &&
                 (n[count] = visible_of(r + count, skip)) > 0)
            ++count;
          switch (count) {
            case 4: score_rows(std::integral_constant<int, 4>{}, r, blk.k, skip, n); break;
            case 3: score_rows(std::integral_constant<int, 3>{}, r, blk.k, skip, n); break;
            case 2: score_rows(std::integral_constant<int, 2>{}, r, blk.k, skip, n); break;
            case 1: score_rows(std::integral_constant<int, 1>{}, r, blk.k, skip, n); break;
            default: break;
          }
          r += std::max(count, 1);
        }
        // bf16 values with bf16 pair dot products: every row's weights go to pairs, the keys it
        // does not see at 0, and all rows take the block's values in groups (zero weights add
        // exact zeros, so a row gets the same bits in any group, a decode's or a prompt's).
        [[maybe_unused]] const bool value_pairs = pairs && blk.v.bf16.base;
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t skip = skip_of(r), visible = visible_of(r, skip);
          float* s = sbuf.data() + r * span_len;
          if (visible <= 0) {
            corrections[r] = 1.f;
#if defined(__AVX512BF16__)
            if (value_pairs) weights_to_pairs(s, 0, 0, w_len, wpairs.data() + r * w_stride);
#endif
            continue;
          }
          const float mx = std::max(m[r], tops[r]);
          // exp(-inf) = 0 on the first block; an unchanged max is exp(0) = 1 without the call.
          corrections[r] = mx == m[r] ? 1.f : std::exp(m[r] - mx);
          const float sum = exp_sub_sum(s, visible, mx);
          if (const float* vs = blk.v.scale)  // the weights onto unscaled values
            for (int64_t t = 0; t < visible; ++t) s[t] *= vs[skip + t];
#if defined(__AVX512BF16__)
          if (value_pairs) weights_to_pairs(s, skip, visible, w_len, wpairs.data() + r * w_stride);
#endif
          l[r] = l[r] * corrections[r] + sum;
          m[r] = mx;
        }
#if defined(__AVX512BF16__)
        if (value_pairs) {
          auto run = [&](auto count, int64_t r) {
            constexpr int NR = decltype(count)::value;
            // Only pairs some row of the group sees (a scored item's early rows skip later blocks).
            int64_t i0 = blk.n, i1 = 0;
            for (int i = 0; i < NR; ++i)
              if (const int64_t skip = skip_of(r + i), visible = visible_of(r + i, skip); visible > 0)
                i0 = std::min(i0, skip / 2), i1 = std::max(i1, (skip + visible + 1) / 2);
            pair_accumulate<NR>(acc.data() + r * D, corrections.data() + r, wpairs.data() + r * w_stride, w_stride,
                                vP.data(), i0, std::max(i0, i1), D);
          };
          int64_t r = 0;
          for (; r + 4 <= rows; r += 4) run(std::integral_constant<int, 4>{}, r);
          switch (rows - r) {
            case 3: run(std::integral_constant<int, 3>{}, r); break;
            case 2: run(std::integral_constant<int, 2>{}, r); break;
            case 1: run(std::integral_constant<int, 1>{}, r); break;
            default: break;
          }
          continue;
        }
#endif
        for (int64_t r = 0; !together && r < rows; ++r) {
          const int64_t skip = skip_of(r), visible = visible_of(r, skip);
          if (visible <= 0) continue;
          blk.v.from(skip).visit([&](auto vr) {
            scale_accumulate(acc.data() + r * D, corrections[r], sbuf.data() + r * span_len, vr, visible, D);
          });
        }
        if (together) accumulate_group(bi, blk);
      }
      if (first && first[w.b] >= 0) {
        // A second pass over the keys now that each row's max and sum are final.
        float* row_scores = sc + w.b * sc_b + w.h * sc_h;
        const int64_t r0 = (first[w.b] - (w.q0 - qs[w.b])) * G;  // the first counted row
        for (int64_t bi = 0; bi < nblocks; ++bi) {
          const Loaded blk = load_block(bi, false, 0);
          const int64_t k0 = bi * block_size;
          for (int64_t r = std::max<int64_t>(r0, 0); r < rows; ++r) {
            const int64_t visible = std::min(blk.n, pos[r] + 1 - k0);
            if (visible <= 0) continue;
            float* s = sbuf.data() + r * span_len;
            score_rows(std::integral_constant<int, 1>{}, r, blk.k, 0, &visible);  // the first pass's scores, recomputed
            const float inv = 1.f / (l[r] * G);
            for (int64_t t = 0; t < visible; ++t) row_scores[k0 + t] += std::exp(s[t] - m[r]) * inv;
          }
        }
      }
      if (w.part >= 0) {  // a piece: its rows are merged below
        std::copy(m.begin(), m.end(), part_m.begin() + w.part);
        std::copy(l.begin(), l.end(), part_l.begin() + w.part);
        std::copy(acc.begin(), acc.end(), part_acc.begin() + w.part * D);
        continue;
      }
      for (int64_t i = 0; i < w.q1 - w.q0; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = i * G + g;
          T* dst = od + (w.q0 + i) * o_tok + (w.h * G + g) * o_head;
          const float inv = 1.f / l[r];
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[r * D + d] * inv);
        }
    }
  }, team);
  // A split context's pieces, in order: each rescaled to the overall max, as the online softmax
  // rescales a block.
  kvserve::parallel_for(0, static_cast<int64_t>(splits.size()), 4, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(D);
    for (int64_t i = begin; i < end; ++i) {
      const Split& sp = splits[i];
      const int64_t rows = (sp.q1 - sp.q0) * G;
      for (int64_t r = 0; r < rows; ++r) {
        // A row that sees none of a piece's keys (a later piece, past its position) left it at
        // max -inf and sum 0: weight exp(-inf) = 0.
        float mx = neg_inf;
        for (int64_t p = 0; p < sp.parts; ++p) mx = std::max(mx, part_m[sp.row0 + p * rows + r]);
        float total = 0.f;
        std::fill(sum.begin(), sum.end(), 0.f);
        for (int64_t p = 0; p < sp.parts; ++p) {
          const int64_t at = sp.row0 + p * rows + r;
          const float c = std::exp(part_m[at] - mx);
          total += part_l[at] * c;
          const float* a = part_acc.data() + at * D;
          for (int64_t d = 0; d < D; ++d) sum[d] += a[d] * c;
        }
        T* dst = od + (sp.q0 + r / G) * o_tok + (sp.h * G + r % G) * o_head;
        const float inv = 1.f / total;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(sum[d] * inv);
      }
    }
  }, team);
}

}  // namespace

// q [T, H, D] (rows may be strided, the last dim contiguous); query_start [B + 1], context_lens
// [B], block_tables [B, max_blocks] int64 on the CPU. K/V pages: see `Kind`. stage_of [num_blocks]
// (or empty) maps a block to its full-precision staging slot, -1 if none. With dense pages, the
// step's new k/v [T, Hkv, D] are first written to `slot_mapping` (one call instead of two;
// compressed pages are encoded by the pool beforehand: pass empty tensors). Returns [T, H, D].
// score_first [B] int64 (or empty): from which of its query rows sequence b's attention weights
// are added into scores [B, Hkv, >= its context] fp32 (zeros in; -1: not scored). window > 0: each
// query sees its last `window` slots only, and blocks wholly before its item's window are not read
// (0 or -1: no window).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                           const at::Tensor& slot_mapping, const at::Tensor& query_start,
                           const at::Tensor& context_lens, const at::Tensor& block_tables, int64_t k_kind, const at::Tensor& k_data,
                           const at::Tensor& k_scale, const at::Tensor& k_zero, const at::Tensor& k_host,
                           int64_t v_kind, const at::Tensor& v_data, const at::Tensor& v_scale,
                           const at::Tensor& v_zero, const at::Tensor& v_host, int64_t k_group, int64_t v_group,
                           int64_t k_bits, int64_t v_bits, bool k_symmetric, bool v_symmetric,
                           const at::Tensor& k_sink, const at::Tensor& k_wide, const at::Tensor& k_wide_slot,
                           const at::Tensor& v_sink, const at::Tensor& v_wide, const at::Tensor& v_wide_slot,
                           const at::Tensor& stage_of, const at::Tensor& k_staging,
                           const at::Tensor& v_staging, double scale, int64_t block_size,
                           int64_t num_kv_heads, int64_t window, const at::Tensor& score_first, at::Tensor scores) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged_attention: q must be [T, H, D] with contiguous D");
  TORCH_CHECK(q.size(1) % num_kv_heads == 0, "paged_attention: heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.is_contiguous() && query_start.is_contiguous() && context_lens.is_contiguous(),
              "paged_attention: metadata must be contiguous");
  if (score_first.numel()) {
    // Scores are read from every key of a sequence, a window's hidden ones too.
    TORCH_CHECK(window <= 0, "paged_attention: attention scores are not built for a sliding window");
    TORCH_CHECK(score_first.scalar_type() == at::kLong && score_first.is_contiguous() &&
                score_first.size(0) == context_lens.size(0), "paged_attention: score_first must be [B] int64");
    TORCH_CHECK(scores.scalar_type() == at::kFloat && scores.dim() == 3 && scores.size(0) == context_lens.size(0) &&
                scores.size(1) == num_kv_heads && scores.stride(2) == 1, "paged_attention: scores must be [B, Hkv, S] fp32");
  }
  if (k_new.numel()) {
    TORCH_CHECK(k_kind == kDense && v_kind == kDense, "paged_attention: only dense pages are written here");
    write_kv(k_data, v_data, k_new, v_new, slot_mapping);
  }
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (q.size(0) == 0) return out;
  const Pages kp = make_pages(k_kind, k_data, k_scale, k_zero, k_host, k_group, k_bits, k_symmetric, k_sink, k_wide,
                              k_wide_slot);
  const Pages vp = make_pages(v_kind, v_data, v_scale, v_zero, v_host, v_group, v_bits, v_symmetric, v_sink, v_wide,
                              v_wide_slot);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    attention_impl<scalar_t>(out, q, query_start, context_lens, block_tables, kp, vp, stage_of, k_staging,
                             v_staging, scale, block_size, num_kv_heads, window, score_first, scores);
  });
  return out;
}
