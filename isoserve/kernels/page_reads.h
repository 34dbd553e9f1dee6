// The bounds check every kernel that reads the KV pool through a page table makes first
// (cpu_ops.cpp's decode attention, amx_attention.cpp's prefill attention): memory safety, not
// ownership, which the read guard decides before the step (kv/guard.py).
#pragma once

#include "tensors.h"

#include <cstdint>

namespace isoserve {

// Refuses, before any read, a table row from which `reader` `index` would take keys
// [0, keys): fewer than `least`, more than its `width` pages hold, or through a page id
// outside the pool (the padding NO_PAGE, -1, included).
inline void check_page_reads(const int64_t* row, int64_t width, int64_t keys, int64_t least, int64_t page_size,
                             int64_t num_pages, const char* reader, int64_t index) {
  TORCH_CHECK(keys >= least && keys <= width * page_size,
              reader, " ", index, " reads ", keys, " keys from a ", width, "-page table");
  for (int64_t p = 0; p * page_size < keys; ++p)
    TORCH_CHECK(row[p] >= 0 && row[p] < num_pages, "page ", row[p], " is outside the pool");
}

}  // namespace isoserve
