// How paged_attention.cpp cuts a step into work items: a (sequence, KV head, query tile) each, a
// short query's long context in pieces merged after, handed out longest first.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace cpu_kernels {

// The first key the query in slot p sees: p - window + 1 under a sliding window (window > 0), 0
// otherwise.
inline int64_t window_start(int64_t slot, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, slot - window + 1) : 0;
}

// An item reads blocks [bi0, bi1) of sequence b for KV head h and query tokens [q0, q1); part >= 0:
// a piece of a split context, whose rows' running max, sum and weighted values go to part storage
// from that row on, for merging after.
struct Item { int64_t b, h, q0, q1, cost, bi0, bi1, part; };
// A split's pieces: rows each ((q1 - q0) * G), stored one piece after another from row0.
struct Split { int64_t h, q0, q1, row0, parts; };

struct WorkPlan {
  std::vector<Item> items;  // longest first
  std::vector<Split> splits;
  int64_t num_part_rows = 0;
};

// The items of B sequences (query rows [qs[b], qs[b + 1]), ctx[b] keys; first: score_first or
// null, a scored sequence one item per head) for num_kv_heads heads of G query heads each.
inline WorkPlan plan_items(int64_t B, const int64_t* qs, const int64_t* ctx, const int64_t* first,
                           int64_t num_kv_heads, int64_t G, int64_t block_size, int64_t window) {
  // Query tokens per work item: enough rows to reuse each decoded key block, few enough that
  // a prefill splits across threads.
  const int64_t q_tile = std::max<int64_t>(1, 32 / G);
  // A decode token's keys, or a few tokens' (a speculative draft's verification), in pieces of
  // this many blocks (about 512 keys): a long context is several items, so one long sequence
  // keeps every thread busy (one stream: as many items as KV heads). Unsplit, a 5-token
  // verification was 3 items on 2 threads, and its attention took 1.7x a decode token's (issue
  // 44). Where a context is cut depends only on its length and the tokens' count, never on the batch.
  const int64_t split_blocks = std::max<int64_t>(1, 512 / block_size);
  constexpr int64_t kSplitTokens = 8;
  WorkPlan plan;
  for (int64_t b = 0; b < B; ++b) {
    const bool scored = first && first[b] >= 0;
    const int64_t tile = scored ? std::max<int64_t>(1, qs[b + 1] - qs[b]) : q_tile;
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t q0 = qs[b]; q0 < qs[b + 1]; q0 += tile) {
        const int64_t q1 = std::min(q0 + tile, qs[b + 1]);
        const int64_t keys = ctx[b] - (qs[b + 1] - q1);  // what the item's last row sees
        const int64_t nblocks = (keys - 1) / block_size + 1;
        const int64_t lo = window_start(ctx[b] - (qs[b + 1] - q0), window) / block_size;
        if (q1 - q0 <= kSplitTokens && !scored && nblocks - lo > split_blocks) {
          const int64_t parts = (nblocks - lo + split_blocks - 1) / split_blocks, rows = (q1 - q0) * G;
          plan.splits.push_back({h, q0, q1, plan.num_part_rows, parts});
          for (int64_t i = 0; i < parts; ++i) {
            const int64_t bi0 = lo + i * split_blocks, bi1 = std::min(nblocks, bi0 + split_blocks);
            plan.items.push_back(
                {b, h, q0, q1, (q1 - q0) * (bi1 - bi0) * block_size, bi0, bi1, plan.num_part_rows + i * rows});
          }
          plan.num_part_rows += parts * rows;
          continue;
        }
        // Rows times the keys it reads: a 2,000-token context costs 100 times a 20.
        plan.items.push_back({b, h, q0, q1, (q1 - q0) * (keys - lo * block_size), lo, nblocks, -1});
      }
  }
  // Items are handed out one at a time, longest first: split statically, the thread that drew
  // the long contexts ran alone while the other spun at the barrier (14% of a mixed step).
  std::sort(plan.items.begin(), plan.items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  return plan;
}

}  // namespace cpu_kernels
