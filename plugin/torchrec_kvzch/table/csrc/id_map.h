// What the native id map ops share (id_map_ops.cpp; row_ops.cpp uses mix64): the entry layout,
// the hash, the line scan and the prefetching probe walk. Each op has a torch twin in Python.
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
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <utility>

namespace kvzch {
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

inline void check_ids(const at::Tensor& ids) {
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.is_contiguous() &&
                  ids.dim() == 1,
              "kvzch id map: ids must be a contiguous 1-D int64 CPU tensor");
}

// The entries of a table tensor, and its position mask (capacity - 1).
inline std::pair<Entry*, uint64_t> entries(const at::Tensor& table) {
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

}  // namespace
}  // namespace kvzch
