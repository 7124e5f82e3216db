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

#if defined(__AVX2__)
#include <immintrin.h>
#endif

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
// How many ids ahead the loops prefetch: enough outstanding misses to hide DRAM latency. With
// repeated (Zipf) ids most of a probe's prefetches hit lines already in cache, so it looks
// further ahead than the slot writes that follow an insert, which touch only new ids' entries.
// (64 rather than 32 since the vector line compare made a cached probe cheap: 0.61 -> 0.57 ms
// for a Zipf lookup inside a training step at 1M keys, uniform ids unchanged.)
constexpr int64_t kPrefetchDistance = 16;
constexpr int64_t kBucketPrefetchDistance = 64;
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
  // splitmix64 finalizer: the id-seeded initial weights' hash.
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
  TORCH_CHECK(capacity >= static_cast<int64_t>(kBucket) && (capacity & (capacity - 1)) == 0,
              "kvzch id map: capacity must be a power of two of at least ", kBucket, ", got ",
              capacity);
  return {reinterpret_cast<Entry*>(table.data_ptr<int64_t>()), static_cast<uint64_t>(capacity - 1)};
}

// Where the probe of `id` starts: the first entry of its bucket. Fibonacci hashing: the top
// log2(capacity) bits of id * 2^64 / phi, which every bit of the id reaches, so clustered ids
// (sequential user ids, multiples of a power of two) spread evenly. One multiply instead of
// splitmix64's two and three shifts: 7-11% off a lookup at 1M keys (A/B in one process).
constexpr uint64_t kFibonacci = 0x9E3779B97F4A7C15ULL;
inline uint64_t home(int64_t id, uint64_t mask) {
  return ((static_cast<uint64_t>(id) * kFibonacci) >> __builtin_clzll(mask)) & ~(kBucket - 1);
}

// Lowers `least` to `v` if `v` is smaller (the first bad index found by any thread).
inline void lower_to(std::atomic<int64_t>& least, int64_t v) {
  int64_t seen = least.load();
  while (v < seen && !least.compare_exchange_weak(seen, v)) {
  }
}

// Where the probe of `id` ends in the line at `pos` (a bucket's first entry): the id's position
// e, or -2 - e where the id is absent and e is the line's first empty entry; -1 where the line
// holds neither, so the probe goes on to the next line.
// The id is looked for first, anywhere in the line: a present id never sits behind an empty
// entry on its path (an insert takes the path's first empty entry, and removing an id leaves a
// tombstone, never an empty entry), so only an absent id needs the first empty one.
constexpr int64_t kGoOn = -1;
#if defined(__AVX2__)
// The line's four keys against the id and against kEmpty in two vector compares: about 7
// instructions where the scalar compares took 30, which bounded lookups of cached lines. A/B
// in one process, 1M keys, 163,840 ids: a Zipf lookup inside a training step 0.81 -> 0.63 ms.
inline int64_t scan_line(const Entry* t, int64_t id, uint64_t pos) {
  const auto* line = reinterpret_cast<const __m256i*>(t + pos);
  // The keys of entries 0, 2, 1, 3 (an unpack works within each 128-bit half).
  const __m256i keys = _mm256_unpacklo_epi64(_mm256_loadu_si256(line), _mm256_loadu_si256(line + 1));
  const auto lanes_equal = [&](int64_t key) {
    return static_cast<unsigned>(_mm256_movemask_pd(
        _mm256_castsi256_pd(_mm256_cmpeq_epi64(keys, _mm256_set1_epi64x(key)))));
  };
  const unsigned found = lanes_equal(id), empty = lanes_equal(kEmpty);
  if (__builtin_expect((found | empty) == 0, 0)) return kGoOn;
  const auto entry = [](unsigned lane) { return ((lane & 1u) << 1) | (lane >> 1); };
  if (__builtin_expect(found != 0, 1)) return static_cast<int64_t>(pos + entry(__builtin_ctz(found)));
  const unsigned in_order = (empty & 9u) | ((empty & 2u) << 1) | ((empty & 4u) >> 1);
  return -2 - static_cast<int64_t>(pos + __builtin_ctz(in_order));
}
#else
inline int64_t scan_line(const Entry* t, int64_t id, uint64_t pos) {
  unsigned found = 0, empty = 0;
  for (unsigned j = 0; j < kBucket; ++j) {
    found |= static_cast<unsigned>(t[pos + j].key == id) << j;
    empty |= static_cast<unsigned>(t[pos + j].key == kEmpty) << j;
  }
  if (__builtin_expect((found | empty) == 0, 0)) return kGoOn;
  if (__builtin_expect(found != 0, 1)) return static_cast<int64_t>(pos + __builtin_ctz(found));
  return -2 - static_cast<int64_t>(pos + __builtin_ctz(empty));
}
#endif

// Walks the probes of `count` ids: visit(k, pos) scans the line at `pos` for the loop's k-th id,
// whose probe starts at the line home_at(k), and returns false where that line does not end it.
// The bucket line of the id kBucketPrefetchDistance steps on is prefetched; its bucket is
// computed once then and kept in a small ring until its probe (hashing it again cost 9-16% of a
// lookup at 1M keys). A probe that must go on to the next line does not wait for that line,
// which nothing had prefetched: it is parked in a queue, the line prefetched, and resumed
// kParkFor steps later. At load 0.6, 4-10% of the probes of present ids and about a quarter of
// those of absent ids read on, and waiting for them took 40% of a lookup at 10M keys (A/B in one
// process, 163,840 uniform ids: 2.1 -> 1.2 ms at 10M keys, 1.6 -> 0.8 ms at 1M); prefetching
// every probe's next line instead costs a second miss per id.
// The queue is first in, first out, and when it runs full it is worked off in that order
// before the walk goes on: the repeats of an id then reach each line of its path in batch order,
// after its first appearance, which the insert pass relies on (resolving any one probe out of
// turn could let a repeat overtake it).
constexpr int64_t kParkFor = 32;
constexpr int64_t kParked = 64;  // a power of two

template <typename HomeAt, typename Visit>
void walk_probes(uint64_t mask, const Entry* t, int64_t count, HomeAt home_at, Visit visit) {
  constexpr int64_t kRing = 2 * kBucketPrefetchDistance;  // a power of two above it
  static_assert(kRing > kBucketPrefetchDistance && (kRing & (kRing - 1)) == 0);
  uint64_t homes[kRing];
  struct Parked {
    int64_t k;      // the probe's id, as the loop counts them
    uint64_t pos;   // the line it reads next
    int64_t until;  // the step from which that line is expected in cache
  };
  Parked parked[kParked];
  int64_t head = 0, tail = 0;  // parked[head % kParked] .. parked[(tail - 1) % kParked]
  const auto go_on = [&](int64_t k, uint64_t pos, int64_t step) {
    pos = (pos + kBucket) & mask;
    __builtin_prefetch(t + pos);
    parked[tail++ & (kParked - 1)] = Parked{k, pos, step + kParkFor};
  };
  // Resumes, in order, the parked probes due at `step` (all of them with `all`).
  const auto resume = [&](int64_t step, bool all) {
    while (head != tail && (all || parked[head & (kParked - 1)].until <= step)) {
      const Parked p = parked[head++ & (kParked - 1)];
      if (!visit(p.k, p.pos)) go_on(p.k, p.pos, step);
    }
  };
  for (int64_t k = 0; k < std::min(count, kBucketPrefetchDistance); ++k) {
    homes[k & (kRing - 1)] = home_at(k);
  }
  for (int64_t k = 0; k < count; ++k) {
    if (k + kBucketPrefetchDistance < count) {
      const uint64_t ahead = home_at(k + kBucketPrefetchDistance);
      homes[(k + kBucketPrefetchDistance) & (kRing - 1)] = ahead;
      __builtin_prefetch(t + ahead);
    }
    resume(k, tail - head == kParked);  // a step parks at most one probe more than it resumes
    const uint64_t pos = homes[k & (kRing - 1)];
    if (!visit(k, pos)) go_on(k, pos, k);
  }
  resume(count, true);  // the last ones: nothing left to overlap them with
}

// Runs on_found(i, position or -1) for every id, in parallel. Ids outside [lo, hi) are not
// looked up: the smallest index of such an id is returned (-1 when all are inside), and the
// caller refuses the batch before changing anything. `absent` counts the ids looked up and not
// found.
template <typename OnFound>
int64_t probe_each(const Entry* t, uint64_t mask, const at::Tensor& ids, int64_t lo, int64_t hi,
                   OnFound on_found, std::atomic<int64_t>& absent) {
  const int64_t* q = ids.data_ptr<int64_t>();
  // One unsigned compare for both bounds: id - lo wraps past hi - lo when id < lo.
  const uint64_t width = hi > lo ? static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo) : 0;
  std::atomic<int64_t> bad{std::numeric_limits<int64_t>::max()};
  at::parallel_for(0, ids.numel(), 4096, [&](int64_t begin, int64_t end) {
    const int64_t* mine = q + begin;
    int64_t first_bad = std::numeric_limits<int64_t>::max(), missing = 0;
    walk_probes(
        mask, t, end - begin, [&](int64_t k) { return home(mine[k], mask); },
        [&](int64_t k, uint64_t pos) {
          const int64_t id = mine[k];
          if (__builtin_expect(static_cast<uint64_t>(id) - static_cast<uint64_t>(lo) >= width, 0)) {
            first_bad = std::min(first_bad, begin + k);
            on_found(begin + k, int64_t{-1});
            return true;
          }
          const int64_t e = scan_line(t, id, pos);
          if (e == kGoOn) return false;
          missing += e < 0;
          on_found(begin + k, e >= 0 ? e : int64_t{-1});
          return true;
        });
    lower_to(bad, first_bad);
    absent += missing;
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
  std::atomic<int64_t> absent{0};
  probe_each(t, mask, ids, std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(),
             [o](int64_t i, int64_t pos) { o[i] = pos; }, absent);
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
  }, misses);
  return {out, bad, misses.load()};
}

// Slot of every id, inserting the absent ones; returns (slots, index of the first id outside
// [lo, hi) or -1, new size). New ids take slots size, size + 1, ... in order of first appearance,
// whatever the number of threads. The caller guarantees room: the table keeps an empty entry
// with every distinct new id in it, and slot_keys has room for `size + len(ids)` slots.
// With `lookup_first`, a read-only lookup of every id comes first: it checks the bounds and
// resolves the ids already present, so that a batch with few new ids (most batches, once
// training is warm) costs little more than a lookup; the caller asks for it unless the last batch
// had many new ids, whose probes it would walk twice (A/B at LOOKUP_FIRST_BELOW in id_map.py).
// Then the ids left (all of them without `lookup_first`, after a bounds pass; a bad batch
// changes nothing) go through the insert pass: the table is cut into one contiguous region per
// thread; a thread walks (walk_probes) the ids whose bucket lies in its region, in batch order,
// so it owns every entry it writes and meets each new id first at its first appearance. A new id
// claims the first empty entry on its path (tombstones are left to the rehash), marked with
// that index; its repeats read the mark. The rare probe that would run into the next region is
// finished afterwards, serially, in batch order (every repeat of its id runs there too).
// Ranking the first appearances in batch order then gives the slots, written into the claimed
// entries and slot_keys.
constexpr int64_t kMark = int64_t{1} << 62;  // a claimed entry's slot: kMark + first index
constexpr int64_t kRepeat = std::numeric_limits<int64_t>::min();  // o[i] = kRepeat + first index

inline bool is_first(int64_t o) { return o <= -2 && o > kRepeat / 2; }

// Resolves id i where its probe ended (scan_line's answer `e`): leaves in o[i] the slot of an id
// present before the batch, kRepeat + first index for a repeat, or, where the probe ended at an
// empty entry, -2 - that entry for the first appearance of a new id, which claims the entry,
// marked with its index.
inline void claim_at(Entry* t, int64_t id, int64_t i, int64_t e, int64_t* o) {
  if (e >= 0) {
    const int64_t slot = t[e].slot;
    o[i] = slot >= kMark ? kRepeat + (slot - kMark) : slot;
  } else {
    t[-2 - e] = Entry{id, kMark + i};
    o[i] = e;
  }
}

// Writes the indices i of the ids a lookup left absent (o[i] < 0) to `absent`, in batch order.
// In parallel: each share of the batch counts its absent ids and finds its last one, and a prefix
// over the counts tells each where its list starts (serially, this took 0.4 ms of a 163,840-id
// batch at 10M keys). The lists are written without branches, which would mispredict: every
// index is stored, and only an absent one advances the cursor, so a share stops at its last
// absent id and never writes into the next share's list.
void list_absent(const int64_t* o, int64_t n, int64_t* absent) {
  const int64_t shares = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / 4096));
  const int64_t per = (n + shares - 1) / shares;
  std::vector<int64_t> counts(shares + 1, 0), last(shares, -1);
  at::parallel_for(0, shares, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      int64_t count = 0, at = -1;
      for (int64_t i = s * per; i < std::min(n, (s + 1) * per); ++i) {
        count += o[i] < 0;
        at = o[i] < 0 ? i : at;
      }
      counts[s + 1] = count;
      last[s] = at;
    }
  });
  for (int64_t s = 0; s < shares; ++s) counts[s + 1] += counts[s];
  at::parallel_for(0, shares, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      int64_t* mine = absent + counts[s];
      int64_t k = 0;
      for (int64_t i = s * per; i <= last[s]; ++i) {
        mine[k] = i;
        k += o[i] < 0;
      }
    }
  });
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
  int64_t m = n;  // the ids left to insert
  if (lookup_first) {  // present ids resolved, absent ones -1; nothing allocated when all found
    int64_t bad = -1;
    std::tie(out, bad, m) = lookup(table, ids, lo, hi);
    if (bad >= 0 || m == 0) return {out, bad, size};
  } else {
    out = at::empty_like(ids);
  }
  int64_t* o = out.data_ptr<int64_t>();
  // The ids left to insert (`absent[j]`, in batch order) and their buckets (`homes[j]`).
  std::unique_ptr<int64_t[]> absent(new int64_t[m]);
  std::unique_ptr<uint64_t[]> homes(new uint64_t[m]);
  if (lookup_first) {
    list_absent(o, n, absent.get());
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
      walk_probes(
          mask, t, count, [&](int64_t k) { return homes[own[k]]; },
          [&](int64_t k, uint64_t pos) {
            const int64_t j = own[k], i = absent[j];
            if (static_cast<int64_t>(pos) == limit) {  // (regions start on a line)
              crossing[c].push_back(j);
              return true;
            }
            const int64_t e = scan_line(t, q[i], pos);
            if (e == kGoOn) return false;
            claim_at(t, q[i], i, e, o);
            mine += is_first(o[i]);
            return true;
          });
      claimed += mine;
    }
  });
  std::vector<int64_t> rest;
  for (const auto& v : crossing) rest.insert(rest.end(), v.begin(), v.end());
  std::sort(rest.begin(), rest.end());
  for (const int64_t j : rest) {
    const int64_t i = absent[j];
    uint64_t pos = homes[j];
    int64_t e;
    while ((e = scan_line(t, q[i], pos)) == kGoOn) pos = (pos + kBucket) & mask;
    claim_at(t, q[i], i, e, o);
    claimed += is_first(o[i]);
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
// (saturating at 2^31 - 1). meta packs timestamp | count << 32 | used << 63 (store/layout.py).
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
