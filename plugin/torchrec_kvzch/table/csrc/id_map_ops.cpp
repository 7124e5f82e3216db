// The native id map ops: probe, lookup, find_or_insert and insert_absent_ over the table
// described in id_map.h.

#include "id_map.h"

#include <algorithm>
#include <limits>
#include <memory>
#include <tuple>
#include <vector>

namespace kvzch {
namespace {

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

// (f(entries, position or -1) of every id, the index of the first id outside [lo, hi) or -1).
template <typename F>
std::tuple<at::Tensor, int64_t> map_probes(const at::Tensor& table, const at::Tensor& ids, int64_t lo,
                                           int64_t hi, F f) {
  check_ids(ids);
  auto [t, mask] = entries(table);
  auto out = at::empty_like(ids);
  int64_t* o = out.data_ptr<int64_t>();
  std::atomic<int64_t> absent{0};
  const int64_t bad = probe_each(t, mask, ids, lo, hi, [o, t = t, &f](int64_t i, int64_t pos) { o[i] = f(t, pos); },
                                 absent);
  return {out, bad};
}

// Position of each id in the table, or -1 where the id is absent; any id allowed.
at::Tensor probe(const at::Tensor& table, const at::Tensor& ids) {
  return std::get<0>(map_probes(table, ids, std::numeric_limits<int64_t>::min(),
                                std::numeric_limits<int64_t>::max(),
                                [](const Entry*, int64_t pos) { return pos; }));
}

// The served row of each id (serving/table.py). Rows 0..k-1 are the default rows, k =
// len(default_starts): default r serves the absent ids from default_starts[r] on (ascending;
// one per saving rank of the checkpoint, whose default rows differ); the id in slot s lives in
// row s + k. An id outside [lo, hi), the ids the replica serves, is refused with a ValueError
// naming the table. One tensor out, so that it exports (its Meta kernel below), the check with it.
at::Tensor served_rows(const at::Tensor& table, const at::Tensor& ids, const at::Tensor& default_starts, int64_t lo,
                       int64_t hi, c10::string_view name) {
  TORCH_CHECK(default_starts.scalar_type() == at::kLong && default_starts.is_contiguous() &&
                  default_starts.dim() == 1 && default_starts.numel() >= 1,
              "served_rows: default_starts must be a contiguous 1-D int64 tensor of at least one start");
  const int64_t k = default_starts.numel();
  const int64_t* starts = default_starts.data_ptr<int64_t>();
  auto [out, bad] = map_probes(table, ids, lo, hi, [k](const Entry* t, int64_t pos) {
    return pos >= 0 ? t[pos].slot + k : int64_t{-1};
  });
  TORCH_CHECK_VALUE(bad < 0, "served table '", name, "': id ", bad < 0 ? 0 : ids.data_ptr<int64_t>()[bad],
                    " (position ", bad, " of the batch) is outside the ids this table serves, [", lo, ", ",
                    hi, "); route it to the replica of its buckets, or check the feature's ids");
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t* q = ids.data_ptr<int64_t>();
  if (k == 1) {
    at::parallel_for(0, out.numel(), 1 << 14, [o](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) o[i] = o[i] < 0 ? 0 : o[i];
    });
  } else {
    at::parallel_for(0, out.numel(), 1 << 14, [o, q, starts, k](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        if (o[i] < 0) o[i] = std::max<int64_t>(std::upper_bound(starts, starts + k, q[i]) - starts - 1, 0);
    });
  }
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

void check_room(const at::Tensor& slot_keys, int64_t size, int64_t n) {
  TORCH_CHECK(slot_keys.scalar_type() == at::kLong && slot_keys.is_contiguous(),
              "kvzch id map: slot_keys must be a contiguous int64 tensor");
  TORCH_CHECK(size + n <= slot_keys.numel(), "kvzch id map: slot_keys has no room for the batch");
}

// Slot of every id, inserting the absent ones; returns (slots, index of the first id outside
// [lo, hi) or -1, new size). New ids take slots size, size + 1, ... in order of first appearance,
// whatever the number of threads. The caller guarantees room: the table keeps an empty entry
// with every distinct new id in it, and slot_keys has room for `size + len(ids)` slots.
// With `lookup_first`, a read-only lookup of every id comes first: it checks the bounds and
// resolves the ids already present, so that a batch with few new ids (most batches, once
// training is warm) costs little more than a lookup; the caller asks for it unless the last batch
// had many new ids, whose probes it would walk twice (A/B at LOOKUP_FIRST_BELOW in id_map.py).
// A caller that has looked the batch up already (its bounds checked) hands that lookup to
// `insert_absent_` instead, which completes it in place: no id is probed twice or copied.
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

// Writes the indices i of the ids a lookup left absent (o[i] < 0) to `absent`, in batch order;
// refuses a lookup whose absent ids are not `m` (a caller's count that does not match it).
// In parallel: each share of the batch counts its absent ids and finds its last one, and a prefix
// over the counts tells each where its list starts (serially, this took 0.4 ms of a 163,840-id
// batch at 10M keys). The lists are written without branches, which would mispredict: every
// index is stored, and only an absent one advances the cursor, so a share stops at its last
// absent id and never writes into the next share's list.
void list_absent(const int64_t* o, int64_t n, int64_t m, int64_t* absent) {
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
  TORCH_CHECK(counts[shares] == m, "kvzch id map: the lookup handed over has ", counts[shares],
              " absent ids, not the ", m, " counted");
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

// The insert pass and the ranking over the `m` ids left (indices `absent`, buckets `homes`, in
// batch order), whose slots it writes into `o`; returns the new size.
int64_t insert_listed(Entry* t, uint64_t mask, at::Tensor& slot_keys, const int64_t* q, int64_t* o, int64_t m,
                      const int64_t* absent, const uint64_t* homes, int64_t size) {
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
  if (claimed.load() == 0) return size;  // every id was present: nothing to rank

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
  return next_slot[chunks];
}

// Inserts the ids a lookup of the batch left absent (`slots`: -1 there; `absent` of them) and
// writes their slots into it, in place: after the caller's own lookup, no id is probed twice and
// the lookup is not copied. Returns the new size.
int64_t insert_absent_(at::Tensor table, at::Tensor slot_keys, const at::Tensor& ids, at::Tensor slots,
                       int64_t absent_count, int64_t size) {
  check_ids(ids);
  auto [t, mask] = entries(table);
  const int64_t n = ids.numel();
  check_room(slot_keys, size, n);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == n &&
                  absent_count >= 0 && absent_count <= n,
              "kvzch id map: `slots` must be the batch's lookup (contiguous int64, one slot per id) "
              "with its absent count");
  if (absent_count == 0) return size;
  int64_t* o = slots.data_ptr<int64_t>();
  const int64_t* q = ids.data_ptr<int64_t>();
  // The ids left to insert (`absent[j]`, in batch order) and their buckets (`homes[j]`).
  std::unique_ptr<int64_t[]> absent(new int64_t[absent_count]);
  std::unique_ptr<uint64_t[]> homes(new uint64_t[absent_count]);
  list_absent(o, n, absent_count, absent.get());  // (refuses a count that is not the lookup's)
  at::parallel_for(0, absent_count, 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) homes[j] = home(q[absent[j]], mask);
  });
  return insert_listed(t, mask, slot_keys, q, o, absent_count, absent.get(), homes.get(), size);
}

std::tuple<at::Tensor, int64_t, int64_t> find_or_insert(at::Tensor table, at::Tensor slot_keys,
                                                        const at::Tensor& ids, int64_t lo,
                                                        int64_t hi, int64_t size,
                                                        bool lookup_first) {
  if (lookup_first) {  // present ids resolved, absent ones -1; nothing allocated when all found
    auto [out, bad, m] = lookup(table, ids, lo, hi);
    return {out, bad, bad >= 0 ? size : insert_absent_(table, slot_keys, ids, out, m, size)};
  }
  check_ids(ids);
  auto [t, mask] = entries(table);
  const int64_t n = ids.numel();
  check_room(slot_keys, size, n);
  const int64_t* q = ids.data_ptr<int64_t>();
  at::Tensor out = at::empty_like(ids);
  std::unique_ptr<int64_t[]> absent(new int64_t[n]);  // every id, after a bounds pass
  std::unique_ptr<uint64_t[]> homes(new uint64_t[n]);
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
  int64_t* o = out.data_ptr<int64_t>();
  return {out, -1, insert_listed(t, mask, slot_keys, q, o, n, absent.get(), homes.get(), size)};
}

at::Tensor served_rows_meta(const at::Tensor& table, const at::Tensor& ids, const at::Tensor& default_starts, int64_t lo,
                            int64_t hi, c10::string_view name) {
  return at::empty_like(ids);
}

}  // namespace
}  // namespace kvzch

TORCH_LIBRARY_IMPL(kvzch, CPU, m) {
  m.impl("probe", &kvzch::probe);
  m.impl("lookup", &kvzch::lookup);
  m.impl("find_or_insert", &kvzch::find_or_insert);
  m.impl("insert_absent_", &kvzch::insert_absent_);
  m.impl("served_rows", &kvzch::served_rows);
}

TORCH_LIBRARY_IMPL(kvzch, Meta, m) { m.impl("served_rows", &kvzch::served_rows_meta); }
