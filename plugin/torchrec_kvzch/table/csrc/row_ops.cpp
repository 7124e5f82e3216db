// The native row store ops: id-seeded initial weights, the header touch of a training lookup,
// and the store's memory (mapped buffers, pages given back). Each has a torch twin in Python
// except the memory ops, which only make the store cheaper. This file also declares every op of
// the ``kvzch`` library and makes ``torchrec_kvzch._C`` a Python module.

#include "id_map.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>

namespace kvzch {
namespace {

// The same for the header touch, whose ids repeat (Zipf): most of its prefetches hit lines
// already in cache, so it looks further ahead to keep as many misses in flight. A/B on cold
// caches, 1M rows, 163,840 ids: 0.84 -> 0.46 ms with Zipf ids, 1.11 -> 0.91 ms uniform.
constexpr int64_t kTouchPrefetchDistance = 64;

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

// The same rows as a new tensor (the served model's ids without a row read them: serving/table.py),
// with a Meta kernel below so that a served model exports.
at::Tensor uniform_by_id(const at::Tensor& ids, int64_t dim, double low, double high, int64_t seed) {
  auto out = at::empty({ids.numel(), dim}, ids.options().dtype(at::kFloat));
  uniform_by_id_(out, ids, low, high, seed);
  return out;
}

at::Tensor uniform_by_id_meta(const at::Tensor& ids, int64_t dim, double low, double high, int64_t seed) {
  return at::empty_symint({ids.sym_numel(), c10::SymInt(dim)}, ids.options().dtype(at::kFloat));
}

// Lists in `out` the slots of s[begin, end) whose header line (8 slots) w owns, among
// `owner_mask` + 1 owners; returns how many. Without branches, which would mispredict: every
// slot is written and only the owned ones advance the cursor. With AVX2, four at a time, moved
// to the front by a lane permutation (and up to 3 entries past the count are written): 0.41 ->
// 0.33 ms off the touch of a Zipf batch of 163,840 ids over 1M rows, caches flushed, 2 threads.
#if defined(__AVX2__)
// kFront[m]: the 32-bit lane indices that move the 64-bit lanes set in m to the front.
#define KVZCH_LANE(a) 2 * (a), 2 * (a) + 1
alignas(32) constexpr int32_t kFront[16][8] = {
    {0}, {KVZCH_LANE(0)}, {KVZCH_LANE(1)}, {KVZCH_LANE(0), KVZCH_LANE(1)},
    {KVZCH_LANE(2)}, {KVZCH_LANE(0), KVZCH_LANE(2)}, {KVZCH_LANE(1), KVZCH_LANE(2)},
    {KVZCH_LANE(0), KVZCH_LANE(1), KVZCH_LANE(2)}, {KVZCH_LANE(3)}, {KVZCH_LANE(0), KVZCH_LANE(3)},
    {KVZCH_LANE(1), KVZCH_LANE(3)}, {KVZCH_LANE(0), KVZCH_LANE(1), KVZCH_LANE(3)},
    {KVZCH_LANE(2), KVZCH_LANE(3)}, {KVZCH_LANE(0), KVZCH_LANE(2), KVZCH_LANE(3)},
    {KVZCH_LANE(1), KVZCH_LANE(2), KVZCH_LANE(3)},
    {KVZCH_LANE(0), KVZCH_LANE(1), KVZCH_LANE(2), KVZCH_LANE(3)}};
#undef KVZCH_LANE
#endif
inline int64_t owned_slots(const int64_t* s, int64_t begin, int64_t end, uint64_t owner_mask,
                           uint64_t w, int64_t* out) {
  int64_t count = 0, i = begin;
#if defined(__AVX2__)
  const __m256i mask = _mm256_set1_epi64x(static_cast<int64_t>(owner_mask));
  const __m256i me = _mm256_set1_epi64x(static_cast<int64_t>(w));
  for (; i + 4 <= end; i += 4) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    const __m256i owner = _mm256_and_si256(_mm256_srli_epi64(v, 3), mask);
    const unsigned keep =
        _mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpeq_epi64(owner, me)));
    const __m256i front = _mm256_load_si256(reinterpret_cast<const __m256i*>(kFront[keep]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + count), _mm256_permutevar8x32_epi32(v, front));
    count += __builtin_popcount(keep);
  }
#endif
  for (; i < end; ++i) {
    out[count] = s[i];
    count += ((static_cast<uint64_t>(s[i]) >> 3) & owner_mask) == w;
  }
  return count;
}

// Header update for rows read by a training batch: timestamp := clock, count += occurrences
// (saturating at 2^31 - 1). meta packs timestamp | count << 32 | used << 63 (table/layout.py).
// Threads share the work by header line (8 rows a line), never by row or by position in the
// batch: hot (Zipf) ids repeat within a batch and their headers share lines (hot ids get low
// slots), so threads updating the same lines would pass them back and forth. Each thread reads
// the whole batch a block at a time, lists the slots of its own lines (owned_slots) and updates
// them, prefetching ahead. A/B against one prefetching serial
// pass, 163,840 slots, caches flushed: uniform ids 1.2 -> 0.8 ms over 1M rows, 1.6 -> 1.0 ms
// over 10M; Zipf ids 0.50 -> 0.48 and 0.71 -> 0.59 ms.
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
  // Owners: a power of two, so a line's owner is a mask of its index; one below 16K slots.
  // (Lines are 8 words from the array's start, which torch and empty_mapped align to 64 bytes.)
  int64_t owners = 1;
  while (owners * 2 <= at::get_num_threads() && owners * 2 * 8192 <= n) owners *= 2;
  at::parallel_for(0, owners, 1, [&](int64_t w0, int64_t w1) {
    constexpr int64_t kBlock = 4096;
    int64_t mine[kBlock + 4];  // (owned_slots may write 3 entries past its count)
    for (int64_t w = w0; w < w1; ++w) {
      for (int64_t b = 0; b < n; b += kBlock) {
        const int64_t count = owned_slots(s, b, std::min(n, b + kBlock), owners - 1, w, mine);
        for (int64_t k = 0; k < count; ++k) {
          if (k + kTouchPrefetchDistance < count) {
            __builtin_prefetch(m + mine[k + kTouchPrefetchDistance], 1);
          }
          const uint64_t old = m[mine[k]];
          const uint64_t c = std::min<uint64_t>(((old >> 32) & kCountMask) + 1, kCountMask);
          m[mine[k]] = (old & (1ULL << 63)) | (c << 32) | ts;
        }
      }
    }
  });
}

// The header update of a feature-score table's training batch (table/layout.py): timestamp :=
// clock, and each occurrence adds its score in batch order, as fbgemm adds them: the count
// field holds the fp32 bits of |score|, and score := |score + w| after each. Lines are owned by
// threads as in touch, so one thread adds a row's occurrences, in order.
void touch_scores(at::Tensor meta, const at::Tensor& slots, const at::Tensor& scores, int64_t clock) {
  TORCH_CHECK(meta.device().is_cpu() && meta.scalar_type() == at::kLong && meta.is_contiguous(),
              "kvzch touch_scores: meta must be a contiguous int64 CPU tensor");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              "kvzch touch_scores: slots must be a contiguous 1-D int64 tensor");
  TORCH_CHECK(scores.scalar_type() == at::kFloat && scores.is_contiguous() && scores.numel() == slots.numel(),
              "kvzch touch_scores: scores must be a contiguous float32 tensor, one per slot");
  auto* m = reinterpret_cast<uint64_t*>(meta.data_ptr<int64_t>());
  const int64_t* s = slots.data_ptr<int64_t>();
  const float* add = scores.data_ptr<float>();
  const int64_t n = slots.numel();
  const uint64_t ts = static_cast<uint64_t>(clock) & 0xFFFFFFFFULL;
  int64_t owners = 1;
  while (owners * 2 <= at::get_num_threads() && owners * 2 * 8192 <= n) owners *= 2;
  const uint64_t owner_mask = static_cast<uint64_t>(owners - 1);
  at::parallel_for(0, owners, 1, [&](int64_t w0, int64_t w1) {
    constexpr int64_t kBlock = 4096;
    int64_t mine[kBlock];  // positions in the batch of the slots this thread owns
    for (int64_t w = w0; w < w1; ++w) {
      for (int64_t b = 0; b < n; b += kBlock) {
        int64_t count = 0;
        for (int64_t i = b; i < std::min(n, b + kBlock); ++i) {  // (branch-free, as owned_slots)
          mine[count] = i;
          count += ((static_cast<uint64_t>(s[i]) >> 3) & owner_mask) == static_cast<uint64_t>(w);
        }
        for (int64_t k = 0; k < count; ++k) {
          if (k + kTouchPrefetchDistance < count) {
            __builtin_prefetch(m + s[mine[k + kTouchPrefetchDistance]], 1);
          }
          const int64_t i = mine[k];
          const uint64_t old = m[s[i]];
          const uint32_t bits = static_cast<uint32_t>(old >> 32) & 0x7FFFFFFFU;
          float score;
          std::memcpy(&score, &bits, sizeof(score));
          score = std::fabs(score + add[i]);
          uint32_t out;
          std::memcpy(&out, &score, sizeof(out));
          m[s[i]] = (old & (1ULL << 63)) | (static_cast<uint64_t>(out & 0x7FFFFFFFU) << 32) | ts;
        }
      }
    }
  });
}

// A buffer in an anonymous mapping of its own. MAP_NORESERVE: the store maps address space
// for growth it may never use (``regrown`` in native.py), which must not count as committed.
// Transparent huge pages are advised (on systems where THP is in "madvise" mode): row stores
// are written at random and grow by first touch, and 2 MiB pages cut page faults 512x and TLB
// misses on lookups. Pages are committed as they are first written and go back to the OS the
// moment the tensor is freed; torch's CPU allocator (glibc malloc) may instead keep freed
// blocks of a few tens of MiB in its heap, so a store that reallocates its hash table under
// eviction would creep above its memory budget.
at::Tensor empty_mapped(int64_t nbytes) {
  TORCH_CHECK(nbytes >= 0, "kvzch empty_mapped: negative size ", nbytes);
  const size_t length = static_cast<size_t>(std::max<int64_t>(nbytes, 1));
  void* data = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                    -1, 0);
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
}  // namespace kvzch

TORCH_LIBRARY(kvzch, m) {
  m.def("empty_mapped(int nbytes) -> Tensor", &kvzch::empty_mapped);
  m.def("release_pages(Tensor(a!) buffer, int start, int end) -> ()", &kvzch::release_pages);
  m.def("probe(Tensor table, Tensor ids) -> Tensor");
  m.def("lookup(Tensor table, Tensor ids, int lo, int hi) -> (Tensor, int, int)");
  m.def("served_rows(Tensor table, Tensor ids, Tensor default_starts, int lo, int hi, str name) -> Tensor");
  m.def(
      "find_or_insert(Tensor(a!) table, Tensor(b!) slot_keys, Tensor ids, int lo, int hi, int size, "
      "bool lookup_first) -> (Tensor, int, int)");
  m.def("insert_absent_(Tensor(a!) table, Tensor(b!) slot_keys, Tensor ids, Tensor(c!) slots, int absent, "
        "int size) -> int");
  m.def("uniform_by_id_(Tensor(a!) out, Tensor ids, float low, float high, int seed) -> ()");
  m.def("uniform_by_id(Tensor ids, int dim, float low, float high, int seed) -> Tensor");
  m.def("touch(Tensor(a!) meta, Tensor slots, int clock) -> ()");
  m.def("touch_scores(Tensor(a!) meta, Tensor slots, Tensor scores, int clock) -> ()");
}

TORCH_LIBRARY_IMPL(kvzch, CPU, m) {
  m.impl("uniform_by_id_", &kvzch::uniform_by_id_);
  m.impl("uniform_by_id", &kvzch::uniform_by_id);
  m.impl("touch", &kvzch::touch);
  m.impl("touch_scores", &kvzch::touch_scores);
}

TORCH_LIBRARY_IMPL(kvzch, Meta, m) { m.impl("uniform_by_id", &kvzch::uniform_by_id_meta); }

// A Python module so `import torchrec_kvzch._C` loads the library and registers the ops.
#include <Python.h>
static struct PyModuleDef kvzch_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&kvzch_module); }
