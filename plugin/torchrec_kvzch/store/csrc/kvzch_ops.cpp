// Native kernels of the id map and the row store; each has a torch twin in Python.
//
// The map is two plain tensors owned by Python:
//   table      int64[capacity, 2]  (global id or kEmpty / kTomb, dense row slot) pairs; capacity
//                                  is a power of two
//   slot_keys  int64[>= size]      inverse map: the id stored in each slot
// Linear probing from the first entry of the id's 4-entry bucket (one cache line). Key and slot
// share a 16-byte entry, so a hit costs one cache line. The torch twin uses the same hash and
// sentinels, so either implementation can operate on a table built by the other.
//
// Why hand-written: no maintained library offers a batched int64 -> dense-slot map over
// torch-owned memory; pandas' khash and std::unordered_map were 3-5x slower here.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kEmpty = -1;
constexpr int64_t kTomb = -2;
// How many ids ahead the loops prefetch: enough outstanding misses to hide DRAM latency. A
// probe's bucket line is prefetched further ahead than the line after it: with repeated (Zipf)
// ids most bucket prefetches hit lines already in cache, and the longer reach keeps as many
// misses in flight, while the next line, which a quarter of the probes need at most, stays
// close. A/B on cold caches, 163,840 ids: 15% off find_or_insert at 1M keys with Zipf ids,
// unchanged with uniform ones, and within noise (+-3%) at 10M keys with 20% new ids.
constexpr int64_t kPrefetchDistance = 16;
constexpr int64_t kBucketPrefetchDistance = 32;
// The same for the header touch, whose ids repeat (Zipf): most of its prefetches hit lines
// already in cache, so it looks further ahead to keep as many misses in flight. A/B on cold
// caches, 1M rows, 163,840 ids: 0.84 -> 0.46 ms with Zipf ids, 1.11 -> 0.91 ms uniform.
constexpr int64_t kTouchPrefetchDistance = 64;

struct Entry {
  int64_t key;
  int64_t slot;
};

// Entries per 64-byte cache line. A probe starts at the first entry of a line (its bucket), so
// the ids of a line are found in that line however full the table is, and only overflow crosses
// into the next one.
constexpr uint64_t kBucket = 4;

inline uint64_t mix64(uint64_t x) {
  // splitmix64 finalizer: cheap, and spreads clustered ids (sequential user ids) evenly.
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

void check_ids(const at::Tensor& ids) {
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.is_contiguous() &&
                  ids.dim() == 1,
              "kvzch id map: ids must be a contiguous 1-D int64 CPU tensor");
}

// The entries of a table tensor, and its position mask (capacity - 1).
std::pair<Entry*, uint64_t> entries(const at::Tensor& table) {
  TORCH_CHECK(table.device().is_cpu() && table.scalar_type() == at::kLong && table.dim() == 2 &&
                  table.size(1) == 2 && table.is_contiguous(),
              "kvzch id map: the table must be a contiguous int64 [capacity, 2] CPU tensor; use "
              "the torch backend on other devices");
  const int64_t capacity = table.size(0);
  TORCH_CHECK(capacity > 0 && (capacity & (capacity - 1)) == 0,
              "kvzch id map: capacity must be a power of two, got ", capacity);
  return {reinterpret_cast<Entry*>(table.data_ptr<int64_t>()), static_cast<uint64_t>(capacity - 1)};
}

// Where the probe of `id` starts: the first entry of its bucket.
inline uint64_t home(int64_t id, uint64_t mask) { return mix64(id) & mask & ~(kBucket - 1); }

// Prefetches, at step j of a loop over [.., end), the lines later probes read: the bucket of the
// id kBucketPrefetchDistance steps on, and the line after the bucket of the one
// kPrefetchDistance on. At the load factors the map runs at, a quarter of the absent ids'
// probes and a few percent of the hits go on into that next line, which would otherwise be a
// miss the probe waits for (A/B: 5-8% off find_or_insert at 10M keys). `home_at(k)`: the
// bucket of the loop's k-th id. Forced inline: GCC left it a call, and both probe loops took 2x.
template <typename HomeAt>
[[gnu::always_inline]] inline void prefetch_probes(const Entry* t, uint64_t mask, int64_t j,
                                                   int64_t end, HomeAt home_at) {
  if (j + kBucketPrefetchDistance < end) {
    __builtin_prefetch(t + home_at(j + kBucketPrefetchDistance));
  }
  if (j + kPrefetchDistance < end) {
    __builtin_prefetch(t + ((home_at(j + kPrefetchDistance) + kBucket) & mask));
  }
}

// Lowers `least` to `v` if `v` is smaller (the first bad index found by any thread).
inline void lower_to(std::atomic<int64_t>& least, int64_t v) {
  int64_t seen = least.load();
  while (v < seen && !least.compare_exchange_weak(seen, v)) {
  }
}

// Position of `id`, whose bucket starts at `pos`, in the table, or -1 where it is absent.
inline int64_t find_position(const Entry* t, uint64_t mask, int64_t id, uint64_t pos) {
  for (;; pos = (pos + 1) & mask) {
    const int64_t k = t[pos].key;
    if (k == id) return static_cast<int64_t>(pos);
    if (k == kEmpty) return -1;
  }
}

// Runs on_found(i, position) for every id, in parallel, prefetching the entries of ids a few
// steps ahead. Ids outside [lo, hi) are not looked up: the smallest index of such an id is
// returned (-1 when all are inside), and the caller refuses the batch before changing anything.
// Each id's bucket is hashed once, when its line is prefetched, and kept in a small ring until
// its probe: hashing it again at each of the three steps that need it cost 9-16% of a lookup
// at 1M keys (A/B in one build, 163,840 ids; within noise at 10M, where misses dominate).
template <typename OnFound>
int64_t probe_each(const Entry* t, uint64_t mask, const at::Tensor& ids, int64_t lo, int64_t hi,
                   OnFound on_found) {
  const int64_t* q = ids.data_ptr<int64_t>();
  std::atomic<int64_t> bad{std::numeric_limits<int64_t>::max()};
  at::parallel_for(0, ids.numel(), 4096, [&](int64_t begin, int64_t end) {
    constexpr int64_t kRing = 64;  // a power of two above kBucketPrefetchDistance
    static_assert(kRing > kBucketPrefetchDistance && kBucketPrefetchDistance > kPrefetchDistance);
    uint64_t homes[kRing];
    for (int64_t k = begin; k < std::min(end, begin + kBucketPrefetchDistance); ++k) {
      homes[k & (kRing - 1)] = home(q[k], mask);
    }
    int64_t first_bad = std::numeric_limits<int64_t>::max();
    for (int64_t i = begin; i < end; ++i) {
      if (i + kBucketPrefetchDistance < end) {
        const int64_t k = i + kBucketPrefetchDistance;
        homes[k & (kRing - 1)] = home(q[k], mask);
      }
      prefetch_probes(t, mask, i, end, [&homes](int64_t k) { return homes[k & (kRing - 1)]; });
      const int64_t id = q[i];
      if (id < lo || id >= hi) {
        first_bad = std::min(first_bad, i);
        on_found(i, int64_t{-1});
        continue;
      }
      on_found(i, find_position(t, mask, id, homes[i & (kRing - 1)]));
    }
    lower_to(bad, first_bad);
  });
  const int64_t b = bad.load();
  return b == std::numeric_limits<int64_t>::max() ? -1 : b;
}

// Position of each id in the table, or -1 where the id is absent.
at::Tensor probe(const at::Tensor& table, const at::Tensor& ids) {
  check_ids(ids);
  auto [t, mask] = entries(table);
  auto out = at::empty_like(ids);
  int64_t* o = out.data_ptr<int64_t>();
  probe_each(t, mask, ids, std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(),
             [o](int64_t i, int64_t pos) { o[i] = pos; });
  return out;
}

// Slot of each id (-1 where absent), the index of the first id outside [lo, hi) (-1 if none),
// and how many ids were absent. Nothing changes, so a caller can refuse a bad batch afterwards.
std::tuple<at::Tensor, int64_t, int64_t> lookup(const at::Tensor& table, const at::Tensor& ids,
                                                int64_t lo, int64_t hi) {
  check_ids(ids);
  auto [t, mask] = entries(table);
  auto out = at::empty_like(ids);
  int64_t* o = out.data_ptr<int64_t>();
  std::atomic<int64_t> misses{0};
  const int64_t bad = probe_each(t, mask, ids, lo, hi, [o, t](int64_t i, int64_t pos) {
    o[i] = pos >= 0 ? t[pos].slot : -1;
  });
  // Counted afterwards in one sequential pass: cheaper than a shared counter in the loop.
  at::parallel_for(0, ids.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
    int64_t n = 0;
    for (int64_t i = begin; i < end; ++i) n += o[i] < 0;
    misses += n;
  });
  return {out, bad, misses.load()};
}

// Slot of every id, inserting the absent ones; returns (slots, index of the first id outside
// [lo, hi) or -1, new size). New ids take slots size, size + 1, ... in order of first appearance,
// whatever the number of threads. The caller guarantees room: the table keeps an empty entry
// with every distinct new id in it, and slot_keys has room for `size + len(ids)` slots.
// With `lookup_first`, a read-only lookup of every id comes first: it checks the bounds and
// resolves the ids already present, so that a batch with few new ids (most batches, once
// training is warm) costs little more than a lookup; the caller asks for it when the last batch
// had few new ids, as probing the absent ones again costs more than it saves when they are many
// (A/B at LOOKUP_FIRST_BELOW in id_map.py). Then the ids left (all of them without
// `lookup_first`, after a bounds pass; a bad batch changes nothing) go through the insert pass:
// the table is cut into one contiguous region per thread; a thread serves the ids whose bucket
// lies in its region, in batch order, so it owns every entry it writes and meets each new id
// first at its first appearance. A new id claims the first empty entry on its path (tombstones
// are left to the rehash), marked with that index; its repeats read the mark. The rare probe
// that would run into the next region is finished afterwards, serially, in batch order (every
// repeat of its id runs there too). Ranking the first appearances in batch order then gives the
// slots, written into the claimed entries and slot_keys. The insert pass over a whole batch
// took 1.1-1.2x a lookup at 9M keys (a lookup followed by a serial insert of the absent ids took
// 1.8x).
constexpr int64_t kMark = int64_t{1} << 62;  // a claimed entry's slot: kMark + first index
constexpr int64_t kRepeat = std::numeric_limits<int64_t>::min();  // o[i] = kRepeat + first index

inline bool is_first(int64_t o) { return o <= -2 && o > kRepeat / 2; }

// Resolves id i by probing from `pos` up to the entry `limit` (exclusive; -1: none). Leaves in
// o[i] the slot of an id present before the batch, -2 - position for the first appearance of a
// new id, or kRepeat + first index for a repeat. Returns false where it reached `limit`.
inline bool claim(Entry* t, uint64_t mask, int64_t id, int64_t i, uint64_t pos, int64_t limit,
                  int64_t* o) {
  for (;; pos = (pos + 1) & mask) {
    if (static_cast<int64_t>(pos) == limit) return false;
    const int64_t k = t[pos].key;
    if (k == id) {
      const int64_t slot = t[pos].slot;
      o[i] = slot >= kMark ? kRepeat + (slot - kMark) : slot;
      return true;
    }
    if (k == kEmpty) {
      t[pos] = Entry{id, kMark + i};
      o[i] = -2 - static_cast<int64_t>(pos);
      return true;
    }
  }
}

std::tuple<at::Tensor, int64_t, int64_t> find_or_insert(at::Tensor table, at::Tensor slot_keys,
                                                        const at::Tensor& ids, int64_t lo,
                                                        int64_t hi, int64_t size,
                                                        bool lookup_first) {
  check_ids(ids);
  auto [t, mask] = entries(table);
  TORCH_CHECK(slot_keys.scalar_type() == at::kLong && slot_keys.is_contiguous(),
              "kvzch id map: slot_keys must be a contiguous int64 tensor");
  const int64_t n = ids.numel();
  TORCH_CHECK(size + n <= slot_keys.numel(), "kvzch id map: slot_keys has no room for the batch");
  const int64_t* q = ids.data_ptr<int64_t>();
  at::Tensor out;
  if (lookup_first) {  // present ids resolved, absent ones -1; nothing allocated when all found
    int64_t bad = -1, misses = 0;
    std::tie(out, bad, misses) = lookup(table, ids, lo, hi);
    if (bad >= 0 || misses == 0) return {out, bad, size};
  } else {
    out = at::empty_like(ids);
  }
  int64_t* o = out.data_ptr<int64_t>();
  // The ids left to insert (`absent[j]`, in batch order) and their buckets (`homes[j]`).
  std::unique_ptr<int64_t[]> absent(new int64_t[n]);
  std::unique_ptr<uint64_t[]> homes(new uint64_t[n]);
  int64_t m = n;
  if (lookup_first) {
    m = 0;
    for (int64_t i = 0; i < n; ++i) {  // without branches: they would mispredict
      absent[m] = i;
      m += o[i] < 0;
    }
    at::parallel_for(0, m, 1 << 14, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) homes[j] = home(q[absent[j]], mask);
    });
  } else {
    std::atomic<int64_t> bad{std::numeric_limits<int64_t>::max()};
    at::parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        if (q[i] < lo || q[i] >= hi) {
          lower_to(bad, i);
          return;
        }
        absent[i] = i;
        homes[i] = home(q[i], mask);
      }
    });
    if (bad.load() != std::numeric_limits<int64_t>::max()) return {out, bad.load(), size};
  }

  const int64_t capacity = static_cast<int64_t>(mask) + 1;
  const int64_t regions = std::clamp<int64_t>(at::get_num_threads(), 1, capacity / 1024 + 1);
  const int64_t span = capacity / regions / static_cast<int64_t>(kBucket) * kBucket;
  std::vector<std::vector<int64_t>> crossing(regions);  // positions j in `absent`
  std::atomic<int64_t> claimed{0};  // first appearances of new ids
  at::parallel_for(0, regions, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t c = r0; c < r1; ++c) {
      const uint64_t first = c * span;
      const uint64_t last = c + 1 == regions ? capacity : (c + 1) * span;
      std::unique_ptr<int64_t[]> own(new int64_t[m]);
      int64_t count = 0;
      for (int64_t j = 0; j < m; ++j) {
        own[count] = j;
        count += homes[j] >= first && homes[j] < last;
      }
      // The last region's probes wrap into the first one's (none with a single region).
      const int64_t limit = regions == 1 ? -1 : static_cast<int64_t>(last & mask);
      int64_t mine = 0;
      for (int64_t k = 0; k < count; ++k) {
        prefetch_probes(t, mask, k, count, [&](int64_t x) { return homes[own[x]]; });
        const int64_t j = own[k], i = absent[j];
        if (!claim(t, mask, q[i], i, homes[j], limit, o)) {
          crossing[c].push_back(j);
        } else {
          mine += is_first(o[i]);
        }
      }
      claimed += mine;
    }
  });
  std::vector<int64_t> rest;
  for (const auto& v : crossing) rest.insert(rest.end(), v.begin(), v.end());
  std::sort(rest.begin(), rest.end());
  for (const int64_t j : rest) {
    claim(t, mask, q[absent[j]], absent[j], homes[j], -1, o);
    claimed += is_first(o[absent[j]]);
  }
  if (claimed.load() == 0) return {out, -1, size};  // every id was present: nothing to rank

  // Ranks in batch order: each fixed chunk of the absent ids lists its first appearances, a
  // prefix over the chunks' counts gives each chunk's first slot, then the chunks write slots.
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), m));
  const int64_t per = (m + chunks - 1) / chunks;
  std::unique_ptr<int64_t[]> firsts(new int64_t[m]);  // chunk c's list starts at c * per
  std::vector<int64_t> counts(chunks);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* mine = firsts.get() + c * per;
      int64_t count = 0;
      for (int64_t j = c * per; j < std::min(m, (c + 1) * per); ++j) {
        mine[count] = absent[j];
        count += is_first(o[absent[j]]);
      }
      counts[c] = count;
    }
  });
  std::vector<int64_t> next_slot(chunks + 1, size);
  for (int64_t c = 0; c < chunks; ++c) next_slot[c + 1] = next_slot[c] + counts[c];
  int64_t* inverse = slot_keys.data_ptr<int64_t>();
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t* mine = firsts.get() + c * per;
      for (int64_t j = 0; j < counts[c]; ++j) {
        if (j + kPrefetchDistance < counts[c]) {
          __builtin_prefetch(t - 2 - o[mine[j + kPrefetchDistance]], 1);
        }
        const int64_t i = mine[j];
        const int64_t slot = next_slot[c] + j;
        t[-2 - o[i]].slot = slot;
        inverse[slot] = q[i];
        o[i] = slot;
      }
    }
  });
  // Repeats take the slot of their first appearance, resolved above.
  at::parallel_for(0, m, 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int64_t i = absent[j];
      if (o[i] <= kRepeat / 2) o[i] = o[o[i] - kRepeat];
    }
  });
  return {out, -1, next_slot[chunks]};
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
// Serial on purpose: hot ids repeat within a batch (Zipf), and their headers share cache lines
// (hot ids get low slots), so threads touching them, even each its own rows (the id map's
// regions), pass the lines back and forth: measured slower than this one prefetching pass.
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
    if (i + kTouchPrefetchDistance < n) __builtin_prefetch(m + s[i + kTouchPrefetchDistance], 1);
    const uint64_t old = m[s[i]];
    const uint64_t count = std::min<uint64_t>(((old >> 32) & kCountMask) + 1, kCountMask);
    m[s[i]] = (old & (1ULL << 63)) | (count << 32) | ts;
  }
}

// A buffer in an anonymous mapping of its own. MAP_NORESERVE: the store maps address space
// for growth it may never use (``regrown`` in id_map.py), which must not count as committed.
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

TORCH_LIBRARY(kvzch, m) {
  m.def("empty_mapped(int nbytes) -> Tensor", &empty_mapped);
  m.def("release_pages(Tensor(a!) buffer, int start, int end) -> ()", &release_pages);
  m.def("probe(Tensor table, Tensor ids) -> Tensor");
  m.def("lookup(Tensor table, Tensor ids, int lo, int hi) -> (Tensor, int, int)");
  m.def(
      "find_or_insert(Tensor(a!) table, Tensor(b!) slot_keys, Tensor ids, int lo, int hi, int size, "
      "bool lookup_first) -> (Tensor, int, int)");
  m.def("uniform_by_id_(Tensor(a!) out, Tensor ids, float low, float high, int seed) -> ()");
  m.def("touch(Tensor(a!) meta, Tensor slots, int clock) -> ()");
}

TORCH_LIBRARY_IMPL(kvzch, CPU, m) {
  m.impl("probe", &probe);
  m.impl("lookup", &lookup);
  m.impl("find_or_insert", &find_or_insert);
  m.impl("uniform_by_id_", &uniform_by_id_);
  m.impl("touch", &touch);
}

// A Python module so `import torchrec_kvzch._C` loads the library and registers the ops.
#include <Python.h>
static struct PyModuleDef kvzch_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&kvzch_module); }
