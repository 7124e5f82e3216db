// The disk tier's row file (table/disk_tier.py): rows of fixed size at positions of a file
// opened with O_DIRECT, grouped in units of `unit` bytes (a multiple of 4 KiB) that hold
// unit / row_bytes whole rows each. Reads and writes move whole units, on `threads` threads at
// once (the disk's queue depth: one thread per request in flight), never through the page cache.
#include <torch/extension.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace kvzch {
namespace {

constexpr int64_t kAlign = 4096;
constexpr int64_t kRunUnits = 64;  // consecutive units moved by one request, at most

// A thread's O_DIRECT buffer, as large as its largest run so far: random reads are runs of one
// unit, so 64 threads hold 64 units, not 64 times the longest run a write may have.
class Aligned {
 public:
  uint8_t* get(int64_t bytes) {
    if (bytes > size_) {
      std::free(p_);
      p_ = static_cast<uint8_t*>(std::aligned_alloc(kAlign, bytes));
      TORCH_CHECK(p_ != nullptr, "disk tier: out of memory for an I/O buffer of ", bytes, " bytes");
      size_ = bytes;
    }
    return p_;
  }
  ~Aligned() { std::free(p_); }

 private:
  uint8_t* p_ = nullptr;
  int64_t size_ = 0;
};

void full_io(bool write, int64_t fd, uint8_t* buf, int64_t bytes, int64_t offset) {
  for (int64_t done = 0; done < bytes;) {
    ssize_t n = write ? pwrite(fd, buf + done, bytes - done, offset + done)
                      : pread(fd, buf + done, bytes - done, offset + done);
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n > 0, "disk tier: ", write ? "writing" : "reading", " ", bytes, " bytes at offset ", offset,
                " failed: ", n < 0 ? std::strerror(errno) : "end of file");
    done += n;
  }
}

// The first error raised inside an OpenMP loop, rethrown after it: an exception must not leave
// a parallel region (it would terminate the process), and a failed read or write must reach
// Python as an error it can report.
class LoopError {
 public:
  template <class F>
  void run(F&& body) {
    if (failed_.load(std::memory_order_relaxed)) return;  // (the rest of the loop is skipped)
    try {
      body();
    } catch (const c10::Error& e) {
      keep(e.what_without_backtrace());
    } catch (const std::exception& e) {
      keep(e.what());
    }
  }
  void rethrow() const { TORCH_CHECK(!failed_.load(), message_); }

 private:
  void keep(const char* what) {
    std::lock_guard<std::mutex> hold(mutex_);
    if (!failed_.exchange(true)) message_ = what;
  }
  std::atomic<bool> failed_{false};
  std::mutex mutex_;
  std::string message_;
};

// Runs of consecutive units among the sorted (position, row) pairs: [begin, end) of `order`.
std::vector<std::pair<int64_t, int64_t>> unit_runs(const std::vector<std::pair<int64_t, int64_t>>& order,
                                                   int64_t per_unit) {
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (int64_t b = 0, n = (int64_t)order.size(); b < n;) {
    int64_t first = order[b].first / per_unit, e = b + 1;
    while (e < n && order[e].first / per_unit - first < kRunUnits &&
           order[e].first / per_unit - order[e - 1].first / per_unit <= 1)
      ++e;
    runs.emplace_back(b, e);
    b = e;
  }
  return runs;
}

std::vector<std::pair<int64_t, int64_t>> sorted_positions(const at::Tensor& positions) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.is_contiguous() &&
                  positions.device().is_cpu(),
              "disk tier: positions must be a contiguous 1-D int64 CPU tensor");
  const int64_t* p = positions.data_ptr<int64_t>();
  std::vector<std::pair<int64_t, int64_t>> order(positions.numel());
  for (int64_t i = 0; i < positions.numel(); ++i) order[i] = {p[i], i};
  std::sort(order.begin(), order.end());
  return order;
}

void check_rows(const at::Tensor& rows, int64_t n, int64_t unit) {
  TORCH_CHECK(rows.scalar_type() == at::kByte && rows.dim() == 2 && rows.is_contiguous() && rows.device().is_cpu() &&
                  rows.size(0) == n && rows.size(1) > 0 && rows.size(1) <= unit,
              "disk tier: rows must be a contiguous uint8 CPU tensor [", n, ", row_bytes <= ", unit, "]");
  TORCH_CHECK(unit > 0 && unit % kAlign == 0, "disk tier: unit must be a positive multiple of 4096, got ", unit);
}

// The rows at `positions` (any order, repeats allowed) into `out` [n, row_bytes].
void disk_read(int64_t fd, const at::Tensor& positions, at::Tensor out, int64_t unit, int64_t threads) {
  const int64_t n = positions.numel();
  check_rows(out, n, unit);
  const int64_t row = out.size(1), per_unit = unit / row;
  auto order = sorted_positions(positions);
  auto runs = unit_runs(order, per_unit);
  uint8_t* o = out.data_ptr<uint8_t>();
  LoopError error;
#pragma omp parallel num_threads(std::max<int64_t>(1, threads))
  {
    Aligned scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < (int64_t)runs.size(); ++r) {
      error.run([&] {
        auto [b, e] = runs[r];
        int64_t first = order[b].first / per_unit, last = order[e - 1].first / per_unit;
        uint8_t* buf = scratch.get((last - first + 1) * unit);
        full_io(false, fd, buf, (last - first + 1) * unit, first * unit);
        for (int64_t j = b; j < e; ++j) {
          int64_t pos = order[j].first, u = pos / per_unit - first;
          std::memcpy(o + order[j].second * row, buf + u * unit + (pos % per_unit) * row, row);
        }
      });
    }
  }
  error.rethrow();
}

// `rows` [n, row_bytes] to `positions` (distinct). Units listed in `partial` (ascending) hold
// other live rows: they are read before being patched; the others are written whole, their
// unused rows zero. Returns the bytes read and written.
std::tuple<int64_t, int64_t> disk_write(int64_t fd, const at::Tensor& positions, const at::Tensor& rows,
                                        const at::Tensor& partial, int64_t unit, int64_t threads) {
  const int64_t n = positions.numel();
  check_rows(rows, n, unit);
  TORCH_CHECK(partial.scalar_type() == at::kLong && partial.dim() == 1 && partial.is_contiguous() &&
                  partial.device().is_cpu(),
              "disk tier: partial must be a contiguous 1-D int64 CPU tensor of unit indices");
  const int64_t row = rows.size(1), per_unit = unit / row;
  auto order = sorted_positions(positions);
  for (int64_t j = 1; j < n; ++j)
    TORCH_CHECK(order[j].first != order[j - 1].first, "disk tier: position ", order[j].first, " written twice");
  auto runs = unit_runs(order, per_unit);
  const uint8_t* src = rows.data_ptr<uint8_t>();
  const int64_t *pb = partial.data_ptr<int64_t>(), *pe = pb + partial.numel();
  int64_t read = 0, written = 0;
  LoopError error;
#pragma omp parallel num_threads(std::max<int64_t>(1, threads)) reduction(+ : read, written)
  {
    Aligned scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < (int64_t)runs.size(); ++r) {
      error.run([&] {
        auto [b, e] = runs[r];
        int64_t first = order[b].first / per_unit, last = order[e - 1].first / per_unit;
        uint8_t* buf = scratch.get((last - first + 1) * unit);
        for (int64_t u = first; u <= last; ++u) {
          uint8_t* at = buf + (u - first) * unit;
          if (std::binary_search(pb, pe, u)) {
            full_io(false, fd, at, unit, u * unit);
            read += unit;
          } else {
            std::memset(at, 0, unit);
          }
        }
        for (int64_t j = b; j < e; ++j) {
          int64_t pos = order[j].first;
          std::memcpy(buf + (pos / per_unit - first) * unit + (pos % per_unit) * row, src + order[j].second * row, row);
        }
        full_io(true, fd, buf, (last - first + 1) * unit, first * unit);
        written += (last - first + 1) * unit;
      });
    }
  }
  error.rethrow();
  return {read, written};
}

}  // namespace
}  // namespace kvzch

TORCH_LIBRARY_FRAGMENT(kvzch, m) {
  m.def("disk_read(int fd, Tensor positions, Tensor(a!) out, int unit, int threads) -> ()", &kvzch::disk_read);
  m.def("disk_write(int fd, Tensor positions, Tensor rows, Tensor partial, int unit, int threads) -> (int, int)",
        &kvzch::disk_write);
}
