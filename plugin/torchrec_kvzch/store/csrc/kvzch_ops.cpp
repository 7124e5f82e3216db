// Native kernels of the id map and the row store; each has a torch twin in Python.
//
// The table is three plain tensors owned by Python:
//   table_keys  int64[capacity]  global id, kEmpty or kTomb; capacity is a power of two
//   table_slots int32[capacity]  dense row slot of the id at the same position
//   slot_keys   int64[>= size]   inverse map: the id stored in each slot
// Linear probing from mix64(id) & (capacity - 1). The torch twin uses the same hash and
// sentinels, so either implementation can operate on a table built by the other.
//
// Why hand-written: no maintained library offers a batched int64 -> dense-slot map over
// torch-owned memory; pandas' khash and std::unordered_map were 3-5x slower here (DESIGN.md §5).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kEmpty = -1;
constexpr int64_t kTomb = -2;
// How many ids ahead the lookup loop prefetches: enough outstanding misses to hide DRAM latency.
constexpr int64_t kPrefetchDistance = 16;

inline uint64_t mix64(uint64_t x) {
  // splitmix64 finalizer: cheap, and spreads clustered ids (sequential user ids) evenly.
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

void check_table(const at::Tensor& table_keys, const at::Tensor& ids) {
  TORCH_CHECK(table_keys.device().is_cpu() && ids.device().is_cpu(),
              "kvzch native id map runs on CPU tensors; use the torch backend on other devices");
  TORCH_CHECK(table_keys.scalar_type() == at::kLong && ids.scalar_type() == at::kLong,
              "kvzch id map: table keys and ids must be int64");
  TORCH_CHECK(table_keys.is_contiguous() && ids.is_contiguous() && ids.dim() == 1,
              "kvzch id map: expected contiguous 1-D tensors");
  const int64_t capacity = table_keys.numel();
  TORCH_CHECK(capacity > 0 && (capacity & (capacity - 1)) == 0,
              "kvzch id map: capacity must be a power of two, got ", capacity);
}

// Walks the probe sequence of every id in parallel, prefetching the table lines of ids a few
// steps ahead; calls on_done(i, position) with position -1 where the id is absent.
template <typename OnDone>
void probe_each(const at::Tensor& table_keys, const at::Tensor& ids, const int32_t* also_prefetch,
                OnDone on_done) {
  check_table(table_keys, ids);
  const int64_t* keys = table_keys.data_ptr<int64_t>();
  const int64_t* q = ids.data_ptr<int64_t>();
  const uint64_t mask = static_cast<uint64_t>(table_keys.numel() - 1);
  at::parallel_for(0, ids.numel(), 2048, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (i + kPrefetchDistance < end) {
        const uint64_t ahead = mix64(q[i + kPrefetchDistance]) & mask;
        __builtin_prefetch(keys + ahead);
        if (also_prefetch != nullptr) __builtin_prefetch(also_prefetch + ahead);
      }
      const int64_t id = q[i];
      uint64_t pos = mix64(id) & mask;
      int64_t found = -1;
      for (;;) {
        const int64_t k = keys[pos];
        if (k == id) {
          found = static_cast<int64_t>(pos);
          break;
        }
        if (k == kEmpty) break;
        pos = (pos + 1) & mask;
      }
      on_done(i, found);
    }
  });
}

// Position of each id in the table, or -1 where the id is absent.
at::Tensor probe(const at::Tensor& table_keys, const at::Tensor& ids) {
  auto out = at::empty_like(ids);
  int64_t* o = out.data_ptr<int64_t>();
  probe_each(table_keys, ids, nullptr, [o](int64_t i, int64_t pos) { o[i] = pos; });
  return out;
}

// Slot of each id, or -1 where the id is absent.
at::Tensor lookup(const at::Tensor& table_keys, const at::Tensor& table_slots, const at::Tensor& ids) {
  TORCH_CHECK(table_slots.scalar_type() == at::kInt && table_slots.numel() == table_keys.numel(),
              "kvzch id map: table_slots must be int32 with the capacity of table_keys");
  auto out = at::empty_like(ids);
  int64_t* o = out.data_ptr<int64_t>();
  const int32_t* slots = table_slots.data_ptr<int32_t>();
  probe_each(table_keys, ids, slots,
             [o, slots](int64_t i, int64_t pos) { o[i] = pos >= 0 ? slots[pos] : -1; });
  return out;
}

// Slot of each id; absent ids are inserted with slots size, size+1, ... in order of first
// appearance. The caller guarantees room for ids.numel() more keys (load factor and
// slot_keys length), so this never reallocates.
at::Tensor find_or_insert(at::Tensor table_keys, at::Tensor table_slots, at::Tensor slot_keys,
                          const at::Tensor& ids, int64_t size) {
  TORCH_CHECK(slot_keys.scalar_type() == at::kLong && slot_keys.is_contiguous() &&
                  slot_keys.numel() >= size + ids.numel(),
              "kvzch id map: slot_keys has no room for the batch");
  auto out = lookup(table_keys, table_slots, ids);  // parallel phase: hits resolve here
  int64_t* keys = table_keys.data_ptr<int64_t>();
  int32_t* slots = table_slots.data_ptr<int32_t>();
  int64_t* inverse = slot_keys.data_ptr<int64_t>();
  const int64_t* q = ids.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t n = ids.numel();
  // Serial phase over the misses only: re-probe (an earlier miss of this batch may have
  // inserted the same id), then take the first tombstone or empty position on the path.
  const uint64_t mask = static_cast<uint64_t>(table_keys.numel() - 1);
  for (int64_t i = 0; i < n; ++i) {
    if (o[i] >= 0) continue;
    const int64_t id = q[i];
    uint64_t p = mix64(id) & mask;
    int64_t free_pos = -1;
    int64_t slot = -1;
    for (;;) {
      const int64_t k = keys[p];
      if (k == id) {
        slot = slots[p];
        break;
      }
      if (k == kTomb && free_pos < 0) free_pos = static_cast<int64_t>(p);
      if (k == kEmpty) {
        if (free_pos < 0) free_pos = static_cast<int64_t>(p);
        break;
      }
      p = (p + 1) & mask;
    }
    if (slot < 0) {
      slot = size++;
      keys[free_pos] = id;
      slots[free_pos] = static_cast<int32_t>(slot);
      inverse[slot] = id;
    }
    o[i] = slot;
  }
  return out;
}

// Initial weights that depend only on (seed, id, column): rows come out the same whichever
// rank inserts them and in whatever order, so results do not depend on the world size.
// Each 64-bit hash yields two 24-bit uniforms (columns 2k and 2k+1). Writes into `out`
// (float32 [n, dim], e.g. the store's new rows) so no temporary is allocated.
void uniform_by_id_(at::Tensor out, const at::Tensor& ids, double low, double high, int64_t seed) {
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 1,
              "kvzch uniform_by_id_: ids must be a 1-D int64 CPU tensor");
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.dim() == 2 &&
                  out.is_contiguous() && out.size(0) == ids.numel(),
              "kvzch uniform_by_id_: out must be a contiguous float32 [len(ids), dim] CPU tensor");
  const int64_t dim = out.size(1);
  const auto ids_c = ids.contiguous();
  const int64_t* q = ids_c.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const float scale = static_cast<float>(high - low);
  const float offset = static_cast<float>(low);
  const uint64_t salt = mix64(static_cast<uint64_t>(seed));
  at::parallel_for(0, ids.numel(), 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint64_t row = mix64(static_cast<uint64_t>(q[i]) ^ salt);
      float* out_row = o + i * dim;
      const auto put = [&](int64_t j, uint64_t bits) {
        const float u = static_cast<float>(bits) * (1.0f / 16777216.0f);
        const float scaled = u * scale;
        out_row[j] = scaled + offset;
      };
      for (int64_t j = 0; j < dim; j += 2) {
        const uint64_t h = mix64(row + static_cast<uint64_t>(j >> 1));
        put(j, h >> 40);
        if (j + 1 < dim) put(j + 1, (h >> 16) & 0xFFFFFF);
      }
    }
  });
}

// Header update for rows read by a training batch: timestamp := clock, count += occurrences
// (saturating at 2^31 - 1). meta packs timestamp | count << 32 | used << 63 (store/layout.py).
// Serial on purpose: hot ids repeat within a batch (Zipf), and threads contending for the same
// rows measured slower (atomics or slot partitioning) than one prefetching pass.
void touch(at::Tensor meta, const at::Tensor& slots, int64_t clock) {
  TORCH_CHECK(meta.device().is_cpu() && meta.scalar_type() == at::kLong && meta.is_contiguous(),
              "kvzch touch: meta must be a contiguous int64 CPU tensor");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              "kvzch touch: slots must be a contiguous 1-D int64 tensor");
  auto* m = reinterpret_cast<uint64_t*>(meta.data_ptr<int64_t>());
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t n = slots.numel();
  const uint64_t ts = static_cast<uint64_t>(clock) & 0xFFFFFFFFULL;
  constexpr uint64_t kCountMask = 0x7FFFFFFFULL;
  for (int64_t i = 0; i < n; ++i) {
    if (i + kPrefetchDistance < n) __builtin_prefetch(m + s[i + kPrefetchDistance], 1);
    const uint64_t old = m[s[i]];
    const uint64_t count = std::min<uint64_t>(((old >> 32) & kCountMask) + 1, kCountMask);
    m[s[i]] = (old & (1ULL << 63)) | (count << 32) | ts;
  }
}

// Whole rows [header | weight | optimizer] of the given slots (keys[i]: row i's id), in the weight
// dtype, in one pass (store/layout.py describes the layout). Checkpoints read rows in id order,
// i.e. at random slots: prefetching the next rows' lines and writing each row once beats
// gathering every part into a temporary and packing them afterwards.
at::Tensor gather_rows(const at::Tensor& weights, const at::Tensor& optimizer, const at::Tensor& meta,
                       const at::Tensor& keys, const at::Tensor& slots, int64_t row_width,
                       int64_t optimizer_offset) {
  TORCH_CHECK(weights.is_contiguous() && optimizer.is_contiguous() && meta.is_contiguous() &&
                  keys.is_contiguous() && slots.is_contiguous() && slots.dim() == 1,
              "kvzch gather_rows: expected contiguous tensors");
  TORCH_CHECK(optimizer.scalar_type() == at::kFloat && meta.scalar_type() == at::kLong &&
                  keys.scalar_type() == at::kLong && slots.scalar_type() == at::kLong,
              "kvzch gather_rows: unexpected dtypes");
  TORCH_CHECK(keys.numel() == slots.numel(), "kvzch gather_rows: one key per slot expected");
  const int64_t n = slots.numel();
  const int64_t item = weights.element_size();
  const int64_t dim_bytes = weights.size(1) * item;
  const int64_t opt_bytes = optimizer.size(1) * 4;
  const int64_t row_bytes = row_width * item;
  auto out = at::empty({n, row_width}, weights.options());
  auto* o = static_cast<char*>(out.data_ptr());
  const auto* w = static_cast<const char*>(weights.data_ptr());
  const auto* opt = static_cast<const char*>(optimizer.data_ptr());
  const int64_t* m = meta.data_ptr<int64_t>();
  const int64_t* k = keys.data_ptr<int64_t>();
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t weight_at = 16;  // after the 16-byte header
  const int64_t optimizer_at = optimizer_offset * item;
  at::parallel_for(0, n, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (i + kPrefetchDistance < end) {
        const int64_t ahead = s[i + kPrefetchDistance];
        __builtin_prefetch(w + ahead * dim_bytes);
        __builtin_prefetch(m + ahead);
      }
      const int64_t slot = s[i];
      char* row = o + i * row_bytes;
      std::memset(row, 0, row_bytes);  // padding stays zero
      std::memcpy(row, k + i, 8);
      std::memcpy(row + 8, m + slot, 8);
      std::memcpy(row + weight_at, w + slot * dim_bytes, dim_bytes);
      if (opt_bytes) std::memcpy(row + optimizer_at, opt + slot * opt_bytes, opt_bytes);
    }
  });
  return out;
}

// A buffer in an anonymous mapping of its own. Transparent huge pages are advised (on systems
// where THP is in "madvise" mode): row stores are written at random and grow by first touch, and
// 2 MiB pages cut page faults 512x and TLB misses on lookups. Pages are committed as they are
// first written and go back to the OS the moment the tensor is freed; torch's CPU allocator
// (glibc malloc) may instead keep freed blocks of a few tens of MiB in its heap, so a store that
// reallocates its hash table under eviction would creep above its memory budget.
at::Tensor empty_mapped(int64_t nbytes) {
  TORCH_CHECK(nbytes >= 0, "kvzch empty_mapped: negative size ", nbytes);
  const size_t length = static_cast<size_t>(std::max<int64_t>(nbytes, 1));
  void* data = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(data != MAP_FAILED, "kvzch empty_mapped: mmap of ", length, " bytes failed: ",
              std::strerror(errno));
#ifdef MADV_HUGEPAGE
  madvise(data, length, MADV_HUGEPAGE);
#endif
  return at::from_blob(
      data, {nbytes}, [length](void* p) { munmap(p, length); }, at::TensorOptions().dtype(at::kByte));
}

// Gives the whole pages inside bytes [start, end) of a CPU buffer back to the OS; they read as
// zeros when touched again. After an eviction compacts a store, its dead tail rows stay committed
// otherwise: a store whose share of a memory budget shrinks would keep its old peak.
void release_pages(at::Tensor buffer, int64_t start, int64_t end) {
  TORCH_CHECK(buffer.device().is_cpu(), "kvzch release_pages: a CPU tensor is needed");
  TORCH_CHECK(0 <= start && start <= end && end <= buffer.numel() * buffer.element_size(),
              "kvzch release_pages: bytes [", start, ", ", end, ") are outside the buffer");
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto base = reinterpret_cast<uintptr_t>(buffer.data_ptr());
  const uintptr_t lo = (base + start + page - 1) / page * page;
  const uintptr_t hi = (base + end) / page * page;
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
}

}  // namespace

TORCH_LIBRARY(kvzch, m) {
  m.def("empty_mapped(int nbytes) -> Tensor", &empty_mapped);
  m.def("release_pages(Tensor(a!) buffer, int start, int end) -> ()", &release_pages);
  m.def("probe(Tensor table_keys, Tensor ids) -> Tensor");
  m.def("lookup(Tensor table_keys, Tensor table_slots, Tensor ids) -> Tensor");
  m.def(
      "find_or_insert(Tensor(a!) table_keys, Tensor(b!) table_slots, Tensor(c!) slot_keys, "
      "Tensor ids, int size) -> Tensor");
  m.def("uniform_by_id_(Tensor(a!) out, Tensor ids, float low, float high, int seed) -> ()");
  m.def("touch(Tensor(a!) meta, Tensor slots, int clock) -> ()");
  m.def("gather_rows(Tensor weights, Tensor optimizer, Tensor meta, Tensor keys, Tensor slots, "
        "int row_width, int optimizer_offset) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvzch, CPU, m) {
  m.impl("probe", &probe);
  m.impl("lookup", &lookup);
  m.impl("find_or_insert", &find_or_insert);
  m.impl("uniform_by_id_", &uniform_by_id_);
  m.impl("touch", &touch);
  m.impl("gather_rows", &gather_rows);
}

// A Python module so `import torchrec_kvzch._C` loads the library and registers the ops.
#include <Python.h>
static struct PyModuleDef kvzch_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&kvzch_module); }
