// Native kernels of the id map (see store/id_map.py for the data structure and its torch twin).
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

#include <cstdint>

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

// Position of each id in the table, or -1 where the id is absent.
at::Tensor probe(const at::Tensor& table_keys, const at::Tensor& ids) {
  check_table(table_keys, ids);
  auto out = at::empty_like(ids);
  const int64_t* keys = table_keys.data_ptr<int64_t>();
  const int64_t* q = ids.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  const uint64_t mask = static_cast<uint64_t>(table_keys.numel() - 1);
  at::parallel_for(0, ids.numel(), 2048, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (i + kPrefetchDistance < end) {
        __builtin_prefetch(keys + (mix64(q[i + kPrefetchDistance]) & mask));
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
      o[i] = found;
    }
  });
  return out;
}

// Slot of each id; absent ids are inserted with slots size, size+1, ... in order of first
// appearance. The caller guarantees room for ids.numel() more keys (load factor and
// slot_keys length), so this never reallocates.
at::Tensor find_or_insert(at::Tensor table_keys, at::Tensor table_slots, at::Tensor slot_keys,
                          const at::Tensor& ids, int64_t size) {
  TORCH_CHECK(table_slots.scalar_type() == at::kInt && table_slots.numel() == table_keys.numel(),
              "kvzch id map: table_slots must be int32 with the capacity of table_keys");
  TORCH_CHECK(slot_keys.scalar_type() == at::kLong && slot_keys.is_contiguous() &&
                  slot_keys.numel() >= size + ids.numel(),
              "kvzch id map: slot_keys has no room for the batch");
  const auto positions = probe(table_keys, ids);  // parallel phase: hits resolve here
  auto out = at::empty_like(ids);
  int64_t* keys = table_keys.data_ptr<int64_t>();
  int32_t* slots = table_slots.data_ptr<int32_t>();
  int64_t* inverse = slot_keys.data_ptr<int64_t>();
  const int64_t* q = ids.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t n = ids.numel();
  at::parallel_for(0, n, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) o[i] = pos[i] >= 0 ? slots[pos[i]] : -1;
  });
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
at::Tensor uniform_by_id(const at::Tensor& ids, int64_t dim, double low, double high,
                         int64_t seed) {
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 1,
              "kvzch uniform_by_id: ids must be a 1-D int64 CPU tensor");
  const auto ids_c = ids.contiguous();
  auto out = at::empty({ids.numel(), dim}, ids.options().dtype(at::kFloat));
  const int64_t* q = ids_c.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const float scale = static_cast<float>(high - low);
  const float offset = static_cast<float>(low);
  const uint64_t salt = mix64(static_cast<uint64_t>(seed));
  at::parallel_for(0, ids.numel(), 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint64_t row = mix64(static_cast<uint64_t>(q[i]) ^ salt);
      for (int64_t j = 0; j < dim; ++j) {
        const uint64_t bits = mix64(row + static_cast<uint64_t>(j)) >> 40;  // 24 random bits
        const float u = static_cast<float>(bits) * (1.0f / 16777216.0f);
        const float scaled = u * scale;
        o[i * dim + j] = scaled + offset;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(kvzch, m) {
  m.def("probe(Tensor table_keys, Tensor ids) -> Tensor");
  m.def(
      "find_or_insert(Tensor(a!) table_keys, Tensor(b!) table_slots, Tensor(c!) slot_keys, "
      "Tensor ids, int size) -> Tensor");
  m.def("uniform_by_id(Tensor ids, int dim, float low, float high, int seed) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvzch, CPU, m) {
  m.impl("probe", &probe);
  m.impl("find_or_insert", &find_or_insert);
  m.impl("uniform_by_id", &uniform_by_id);
}

// A Python module so `import torchrec_kvzch._C` loads the library and registers the ops.
#include <Python.h>
static struct PyModuleDef kvzch_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&kvzch_module); }
