// Native row copies between a store's arrays and whole rows, for checkpoints; each has a torch
// twin in Python (arrays.py).
//
// A whole row is [key int64 | meta int64 | weight (padded to 4) | optimizer fp32 (padded to 4)]
// in the weight dtype (layout.py). The store keeps weights [capacity, D], optimizer
// [capacity, F] fp32 and meta [capacity] int64 apart, indexed by slot.
//
// gather_rows_into: rows at slots -> caller's buffer. A save reuses its chunk buffers: a fresh
//   output per chunk would cost a page fault per 4 KiB of the checkpoint. It runs on the calling
//   thread only: DCP's writer threads call it side by side, and a thread team under each of
//   them would oversubscribe the cores.
// scatter_rows: whole rows -> the arrays at slots (the inverse), for loads: one pass over each
//   chunk instead of splitting it into parts and three indexed copies.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kAhead = 16;  // rows prefetched ahead: random slots miss the cache
constexpr int64_t kUsedBit = static_cast<int64_t>(1ULL << 63);

// Asks for every cache line of a slot's row parts ahead of use: a row's weights span several
// lines, and the hardware prefetcher does not follow random slots.
inline void prefetch_row(const char* w, int64_t dim_bytes, const char* opt, int64_t opt_bytes,
                         const int64_t* m, int64_t slot, bool write) {
  const char* row = w + slot * dim_bytes;
  for (int64_t at = 0; at < dim_bytes; at += 64) {
    if (write) __builtin_prefetch(row + at, 1); else __builtin_prefetch(row + at, 0);
  }
  if (opt_bytes) {
    if (write) __builtin_prefetch(opt + slot * opt_bytes, 1); else __builtin_prefetch(opt + slot * opt_bytes, 0);
  }
  if (write) __builtin_prefetch(m + slot, 1); else __builtin_prefetch(m + slot, 0);
}

// Byte geometry shared by both directions.
struct Rows {
  int64_t n, row_bytes, dim_bytes, opt_bytes, opt_at;
};

Rows geometry(const at::Tensor& weights, const at::Tensor& optimizer, const at::Tensor& meta,
              const at::Tensor& rows, const at::Tensor& slots, int64_t optimizer_offset,
              const char* op) {
  TORCH_CHECK(weights.device().is_cpu() && rows.device().is_cpu(), "kvzch ", op, ": CPU tensors expected");
  TORCH_CHECK(weights.is_contiguous() && optimizer.is_contiguous() && meta.is_contiguous() &&
                  rows.is_contiguous() && slots.is_contiguous(),
              "kvzch ", op, ": contiguous tensors expected");
  TORCH_CHECK(weights.dim() == 2 && optimizer.dim() == 2 && rows.dim() == 2 && slots.dim() == 1,
              "kvzch ", op, ": weights, optimizer and rows must be 2-d, slots 1-d");
  TORCH_CHECK(optimizer.scalar_type() == at::kFloat && meta.scalar_type() == at::kLong &&
                  slots.scalar_type() == at::kLong && rows.scalar_type() == weights.scalar_type(),
              "kvzch ", op, ": unexpected dtypes");
  TORCH_CHECK(rows.size(0) == slots.numel(), "kvzch ", op, ": one slot per row expected");
  const int64_t item = weights.element_size();
  Rows g{slots.numel(), rows.size(1) * item, weights.size(1) * item, optimizer.size(1) * 4,
         optimizer_offset * item};
  TORCH_CHECK(16 + g.dim_bytes <= g.opt_at && g.opt_at + g.opt_bytes <= g.row_bytes,
              "kvzch ", op, ": rows of ", rows.size(1), " columns cannot hold the parts");
  const int64_t capacity = std::min(weights.size(0), std::min(optimizer.size(0), meta.numel()));
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < g.n; ++i) {
    TORCH_CHECK(s[i] >= 0 && s[i] < capacity, "kvzch ", op, ": slot ", s[i], " outside [0, ", capacity, ")");
  }
  return g;
}

void gather_rows_into(at::Tensor out, const at::Tensor& weights, const at::Tensor& optimizer,
                      const at::Tensor& meta, const at::Tensor& keys, const at::Tensor& slots,
                      int64_t optimizer_offset) {
  const Rows g = geometry(weights, optimizer, meta, out, slots, optimizer_offset, "gather_rows_into");
  TORCH_CHECK(keys.is_contiguous() && keys.scalar_type() == at::kLong && keys.numel() == g.n,
              "kvzch gather_rows_into: one contiguous int64 key per slot expected");
  auto* o = static_cast<char*>(out.data_ptr());
  const auto* w = static_cast<const char*>(weights.data_ptr());
  const auto* opt = static_cast<const char*>(optimizer.data_ptr());
  const int64_t* m = meta.data_ptr<int64_t>();
  const int64_t* k = keys.data_ptr<int64_t>();
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < g.n; ++i) {
    if (i + kAhead < g.n) prefetch_row(w, g.dim_bytes, opt, g.opt_bytes, m, s[i + kAhead], false);
    const int64_t slot = s[i];
    char* row = o + i * g.row_bytes;
    std::memcpy(row, k + i, 8);
    std::memcpy(row + 8, m + slot, 8);
    std::memcpy(row + 16, w + slot * g.dim_bytes, g.dim_bytes);
    std::memset(row + 16 + g.dim_bytes, 0, g.opt_at - 16 - g.dim_bytes);  // padding
    if (g.opt_bytes) std::memcpy(row + g.opt_at, opt + slot * g.opt_bytes, g.opt_bytes);
    std::memset(row + g.opt_at + g.opt_bytes, 0, g.row_bytes - g.opt_at - g.opt_bytes);
  }
}

void scatter_rows(at::Tensor weights, at::Tensor optimizer, at::Tensor meta, const at::Tensor& rows,
                  const at::Tensor& slots, int64_t optimizer_offset) {
  const Rows g = geometry(weights, optimizer, meta, rows, slots, optimizer_offset, "scatter_rows");
  const auto* r = static_cast<const char*>(rows.data_ptr());
  auto* w = static_cast<char*>(weights.data_ptr());
  auto* opt = static_cast<char*>(optimizer.data_ptr());
  int64_t* m = meta.data_ptr<int64_t>();
  const int64_t* s = slots.data_ptr<int64_t>();
  at::parallel_for(0, g.n, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (i + kAhead < end) prefetch_row(w, g.dim_bytes, opt, g.opt_bytes, m, s[i + kAhead], true);
      const int64_t slot = s[i];
      const char* row = r + i * g.row_bytes;
      int64_t word;
      std::memcpy(&word, row + 8, 8);
      m[slot] = word | kUsedBit;  // a written row is live
      std::memcpy(w + slot * g.dim_bytes, row + 16, g.dim_bytes);
      if (g.opt_bytes) std::memcpy(opt + slot * g.opt_bytes, row + g.opt_at, g.opt_bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvzch, m) {
  m.def("gather_rows_into(Tensor(a!) out, Tensor weights, Tensor optimizer, Tensor meta, Tensor keys, "
        "Tensor slots, int optimizer_offset) -> ()");
  m.def("scatter_rows(Tensor(a!) weights, Tensor(b!) optimizer, Tensor(c!) meta, Tensor rows, "
        "Tensor slots, int optimizer_offset) -> ()");
}

TORCH_LIBRARY_IMPL(kvzch, CPU, m) {
  m.impl("gather_rows_into", &gather_rows_into);
  m.impl("scatter_rows", &scatter_rows);
}
