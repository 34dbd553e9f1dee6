// Cache lines that one kernel requests while another one computes: in a decode step of the
// decoder stack (decoder_stack.cpp), the next layer's keys, which its attention reads first,
// requested while this layer's down projection runs (int8_matmul.cpp's tiles issue them).
//
// Why: at batch 32 decode attention reads its KV from memory (~4 MB a layer at ~160 tokens of
// context), ~200 us a layer against ~110 with the KV in cache, while the int8 projections are
// bound by their arithmetic and use a fraction of the memory bandwidth. Requested a share per
// block of each tile, the keys arrive during the down projection's arithmetic (what a core's
// 1 MB L2 cannot hold stays in the shared L3). On a 2-core Zen 4 a batch-32 decode step took
// 3-4% less time (docs/benchmarks.md, session 34). Requesting the values too, during the down
// projection or the next layer's QKV projection, gained less; starting during the gate-up was
// slower: the extra lines evicted what the projections were about to read, and took bandwidth
// from their weights.
//
// A prefetch never faults, but a plan holds only lines that the step's attention reads anyway:
// decoder_stack.cpp builds it from page tables it has bounds-checked against the pool.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace isoserve {

// Byte ranges of an array (an offset from its start), counted in cache lines, in the order
// they are to be requested; a range that continues the one before joins it.
class LinePlan {
 public:
  void add(int64_t offset, int64_t bytes) {
    if (bytes <= 0) return;
    const int64_t first = offset & ~int64_t{63}, lines = (offset + bytes - first + 63) / 64;
    if (!first_.empty()) {
      const size_t r = first_.size() - 1;
      const int64_t last_end = first_[r] + 64 * (end_[r] - before(r));
      if (first >= first_[r] && first <= last_end) {
        end_[r] = before(r) + (std::max(last_end, first + 64 * lines) - first_[r]) / 64;
        return;
      }
    }
    first_.push_back(first);
    end_.push_back(lines_total() + lines);
  }
  int64_t lines_total() const { return end_.empty() ? 0 : end_.back(); }
  size_t ranges() const { return first_.size(); }
  int64_t first(size_t r) const { return first_[r]; }  // range r's first line, in bytes from the array's start
  int64_t end(size_t r) const { return end_[r]; }      // lines in ranges 0 .. r
  int64_t before(size_t r) const { return r ? end_[r - 1] : 0; }
  // The range holding line `line` (0 <= line < lines_total()).
  size_t range_of(int64_t line) const {
    return static_cast<size_t>(std::upper_bound(end_.begin(), end_.end(), line) - end_.begin());
  }

 private:
  std::vector<int64_t> first_, end_;
};

// Lines [begin, end) of a plan, counted over its ranges in order, in the array at `base`.
struct LineSlice {
  const LinePlan* plan = nullptr;
  const char* base = nullptr;
  int64_t begin = 0, end = 0;

  // Parts [from, to) of n equal parts of it: a thread's share, as its share of a kernel's work.
  LineSlice share(int64_t from, int64_t to, int64_t n) const {
    LineSlice s = *this;
    s.begin = begin + (end - begin) * from / n;
    s.end = begin + (end - begin) * to / n;
    return s;
  }
};

// One thread's walk over a slice, requesting its lines into L2 spread evenly over `advances`
// calls of advance(). It keeps its place as (range, line): no search or division per line.
class LineStream {
 public:
  void start(const LineSlice& slice, int64_t advances) {
    slice_ = slice;
    next_ = slice.begin;
    calls_ = 0;
    advances_ = std::max<int64_t>(1, advances);
    if (!slice.plan || slice.begin >= slice.end) {
      next_ = slice_.end = slice.begin;
      return;
    }
    const LinePlan& plan = *slice.plan;
    range_ = plan.range_of(slice.begin);
    line_ = slice.begin - plan.before(range_);
  }

  inline void advance() {
    if (next_ >= slice_.end) return;
    const int64_t count = slice_.end - slice_.begin;
    const int64_t due = slice_.begin + std::min(count, ++calls_ * count / advances_);
    const LinePlan& plan = *slice_.plan;
    for (; next_ < due; ++next_) {
      _mm_prefetch(slice_.base + plan.first(range_) + 64 * line_, _MM_HINT_T1);
      if (++line_ == plan.end(range_) - plan.before(range_)) line_ = 0, ++range_;
    }
  }

 private:
  LineSlice slice_;
  int64_t next_ = 0, calls_ = 0, advances_ = 1, line_ = 0;
  size_t range_ = 0;
};

}  // namespace isoserve
