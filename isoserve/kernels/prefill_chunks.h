// The chunks of a prefill attention call (amx_attention.cpp, f32_prefill_attention.cpp),
// checked against q and the pool before either kernel reads anything: memory safety, not
// ownership, which the read guard decides before the step (kv/guard.py).
#pragma once

#include "tensors.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "page_reads.h"

namespace isoserve {

// Rows [first_row, first_row + rows) of the step are a chunk's queries, the last `rows` of its
// first `context` keys, which lie in the pages of its table.
struct PrefillSpan {
  int64_t first_row, rows, context;
  const int64_t* pages;
};

// chunks [C, 3] (first row, rows, context) and pages [C, width] (each chunk's page table), for
// a step of `tokens` query rows and a pool of `num_pages` pages of `page_size` keys. Refuses a
// chunk whose rows leave the step or overlap another's, and a table that cannot hold its
// context or names a page outside the pool.
inline std::vector<PrefillSpan> checked_prefill_spans(const at::Tensor& chunks, const at::Tensor& pages,
                                                      int64_t tokens, int64_t page_size, int64_t num_pages,
                                                      const char* kernel) {
  for (const at::Tensor* t : {&chunks, &pages})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->is_contiguous(),
                kernel, " takes chunks and pages as contiguous int64 CPU tensors");
  TORCH_CHECK(chunks.dim() == 2 && chunks.size(1) == 3 && pages.dim() == 2 && pages.size(0) == chunks.size(0),
              "chunks must be [C, 3] and pages [C, width]");
  const int64_t* desc = chunks.data_ptr<int64_t>();
  const int64_t* table = pages.data_ptr<int64_t>();
  const int64_t width = pages.size(1);
  std::vector<PrefillSpan> spans;
  for (int64_t c = 0; c < chunks.size(0); ++c) {
    const int64_t first = desc[3 * c], rows = desc[3 * c + 1], context = desc[3 * c + 2];
    TORCH_CHECK(rows >= 1 && first >= 0 && first + rows <= tokens, "chunk ", c, " has rows [", first, ", ",
                first + rows, ") outside the step's ", tokens, " tokens");
    const int64_t* row = table + c * width;
    check_page_reads(row, width, context, rows, page_size, num_pages, "chunk", c);
    spans.push_back({first, rows, context, row});
  }
  std::vector<std::pair<int64_t, int64_t>> order;
  for (const PrefillSpan& s : spans) order.emplace_back(s.first_row, s.first_row + s.rows);
  std::sort(order.begin(), order.end());
  for (size_t i = 1; i < order.size(); ++i)
    TORCH_CHECK(order[i].first >= order[i - 1].second, "prefill chunks overlap at row ", order[i].first);
  return spans;
}

// One work item of a prefill kernel: query block `block` (`block_rows` queries) of head `head`
// of chunk `chunk`; `keys`: how many keys its last query sees.
struct QueryBlock {
  int64_t chunk, head, block, keys;
};

// Every query block of every head of the spans, the longest first, so that threads taking them
// as they free up finish together.
inline std::vector<QueryBlock> query_blocks(const std::vector<PrefillSpan>& spans, int64_t heads, int64_t block_rows) {
  std::vector<QueryBlock> work;
  for (int64_t c = 0; c < static_cast<int64_t>(spans.size()); ++c) {
    const PrefillSpan& s = spans[c];
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t b = 0; b * block_rows < s.rows; ++b)
        work.push_back({c, h, b, s.context - s.rows + std::min(s.rows, (b + 1) * block_rows)});
  }
  std::stable_sort(work.begin(), work.end(), [](const QueryBlock& a, const QueryBlock& b) { return a.keys > b.keys; });
  return work;
}

}  // namespace isoserve
