// Cache lines requested into L2 a few at a time while a kernel computes, so that they arrive
// spread over its arithmetic. Two users, both in int8_matmul.cpp's tiles: the next pair of
// panels' weights (session 33, described there), and, in a decode step of the decoder stack
// (decoder_stack.cpp), the next layer's keys, which its attention reads first, requested while
// this layer's down projection runs. The latter is the rest of this comment.
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
#include <array>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace isoserve {

// Storage for at most N values without the heap: a plan rebuilt for every pair of panels.
template <size_t N>
class InlineValues {
 public:
  bool empty() const { return size_ == 0; }
  size_t size() const { return size_; }
  void clear() { size_ = 0; }
  void push_back(int64_t v) { if (size_ < N) values_[size_++] = v; }
  const int64_t& back() const { return values_[size_ - 1]; }
  int64_t& operator[](size_t i) { return values_[i]; }
  const int64_t& operator[](size_t i) const { return values_[i]; }
  const int64_t* begin() const { return values_.data(); }
  const int64_t* end() const { return values_.data() + size_; }

 private:
  std::array<int64_t, N> values_;
  size_t size_ = 0;
};

// Byte ranges, counted in cache lines, in the order they are to be requested: offsets from an
// array's start (a plan that serves every layer's K cache), or addresses (a base of 0). A range
// that continues the one before joins it. kMax: 0 for any number of ranges, else at most that
// many, held inline (more are dropped).
template <size_t kMax = 0>
class BasicLinePlan {
 public:
  void clear() { first_.clear(), end_.clear(); }
  void add(const void* p, int64_t bytes) { add(static_cast<int64_t>(reinterpret_cast<uintptr_t>(p)), bytes); }
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
    if (kMax && first_.size() == kMax) return;
    first_.push_back(first);
    end_.push_back(lines_total() + lines);
  }
  int64_t lines_total() const { return end_.empty() ? 0 : end_.back(); }
  size_t ranges() const { return first_.size(); }
  int64_t first(size_t r) const { return first_[r]; }  // range r's first line, in bytes from the base
  int64_t end(size_t r) const { return end_[r]; }      // lines in ranges 0 .. r
  int64_t before(size_t r) const { return r ? end_[r - 1] : 0; }
  // The range holding line `line` (0 <= line < lines_total()).
  size_t range_of(int64_t line) const {
    return static_cast<size_t>(std::upper_bound(end_.begin(), end_.end(), line) - end_.begin());
  }

 private:
  using Values = std::conditional_t<kMax == 0, std::vector<int64_t>, InlineValues<kMax>>;
  Values first_, end_;
};

using LinePlan = BasicLinePlan<>;

// Lines [begin, end) of a plan, counted over its ranges in order, from `base` (an array's
// address, or 0 for a plan of addresses).
template <typename Plan = LinePlan>
struct LineSlice {
  const Plan* plan = nullptr;
  uintptr_t base = 0;
  int64_t begin = 0, end = 0;

  static LineSlice all(const Plan& plan, uintptr_t base = 0) { return {&plan, base, 0, plan.lines_total()}; }
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
template <typename Plan = LinePlan>
class LineStream {
 public:
  void start(const LineSlice<Plan>& slice, int64_t advances) {
    slice_ = slice;
    next_ = slice.begin;
    calls_ = 0;
    advances_ = std::max<int64_t>(1, advances);
    if (!slice.plan || slice.begin >= slice.end) {
      next_ = slice_.end = slice.begin;
      return;
    }
    range_ = slice.begin ? slice.plan->range_of(slice.begin) : 0;  // a whole plan's: no search
    line_ = slice.begin - slice.plan->before(range_);
  }

  inline void advance() {
    if (next_ >= slice_.end) return;
    const int64_t count = slice_.end - slice_.begin;
    const int64_t due = slice_.begin + std::min(count, ++calls_ * count / advances_);
    const Plan& plan = *slice_.plan;
    for (; next_ < due; ++next_) {
      _mm_prefetch(reinterpret_cast<const char*>(slice_.base + plan.first(range_) + 64 * line_), _MM_HINT_T1);
      if (++line_ == plan.end(range_) - plan.before(range_)) line_ = 0, ++range_;
    }
  }

 private:
  LineSlice<Plan> slice_;
  int64_t next_ = 0, calls_ = 0, advances_ = 1, line_ = 0;
  size_t range_ = 0;
};

}  // namespace isoserve
