"""The id map: native op, torch twin and GPU kernels agree with a plain-Python model on any
operation sequence. Without a GPU, Triton's interpreter runs the kernels on the CPU (conftest.py)."""

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from torchrec_kvzch.table import id_map, layout, native
from torchrec_kvzch.table.hashing import BUCKET, MAX_LOAD, MIN_CAPACITY, home
from torchrec_kvzch.table.id_map import IdMap, IdOutOfRange, TorchBackend, native_status

BACKENDS = ["native", "torch"] + (["triton"] if importlib.util.find_spec("triton") else [])
# The touch's tests under Triton's interpreter, which sorts slowly (a block of 512 in about half a
# second): fewer examples there; a GPU runs the profile's count.
SORTING = settings(max_examples=15) if os.environ.get("TRITON_INTERPRET") == "1" else settings()


def new_map(backend: str) -> IdMap:
    """A map of ``backend`` on its device: the GPU kernels on CUDA where there is one."""
    return IdMap(backend, "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu")


class ReferenceMap:
    """Dense slots in first-appearance order; erase fills holes from the tail, both in slot order."""

    def __init__(self):
        self.slot_of, self.keys = {}, []

    def find(self, ids):
        return [self.slot_of.get(i, -1) for i in ids]

    def find_or_insert(self, ids):
        for i in ids:
            if i not in self.slot_of:
                self.slot_of[i] = len(self.keys)
                self.keys.append(i)
        return self.find(ids)

    def erase(self, ids):
        gone = sorted({self.slot_of[i] for i in set(ids) if i in self.slot_of})
        new_size = len(self.keys) - len(gone)
        holes = [s for s in gone if s < new_size]
        sources = [s for s in range(new_size, len(self.keys)) if s not in set(gone)]
        for s in gone:
            del self.slot_of[self.keys[s]]
        for hole, src in zip(holes, sources):
            self.keys[hole] = self.keys[src]
            self.slot_of[self.keys[hole]] = hole
        del self.keys[new_size:]
        return sources, holes


# Ids from a small pool (duplicates, re-inserts after erase) mixed with ids far beyond 2^32.
ids_st = st.lists(st.one_of(st.integers(0, 3000), st.integers(2**32, 2**62)), max_size=600)
ops_st = st.lists(st.tuples(st.sampled_from(["insert", "find", "erase"]), ids_st), min_size=1, max_size=12)


@contextlib.contextmanager
def lookup_first(on: bool):
    """find_or_insert with (on) or without a lookup of every id first, whatever the last batch."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(id_map, "LOOKUP_FIRST_BELOW", 2.0 if on else 0.0)
        yield


def test_native_op_is_built():
    assert native_status(strict=True)


def test_an_x86_cpu_without_avx2_is_not_given_the_avx2_build(monkeypatch):
    """The op is compiled with -mavx2 on x86-64: on a CPU without AVX2 it is not loaded (it
    would fault), and the reason says so."""
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_avx2_supported", lambda: False)
    ok, why = native._load_native()
    assert not ok and "AVX2" in why


@given(ops=ops_st, first=st.booleans())
def test_backends_agree_with_reference_on_any_sequence(ops, first):
    ref = ReferenceMap()
    maps = {b: new_map(b) for b in BACKENDS}
    with lookup_first(first):
        run_ops(ops, ref, maps)


def run_ops(ops, ref, maps):
    for op, ids in ops:
        t = torch.tensor(ids, dtype=torch.long)
        if op == "insert":
            want = ref.find_or_insert(ids)
            for m in maps.values():
                assert m.find_or_insert(t).tolist() == want
        elif op == "find":
            want = ref.find(ids)
            for m in maps.values():
                assert m.find(t).tolist() == want
        else:
            src, dst = ref.erase(ids)
            for m in maps.values():
                moves = m.erase(t)
                assert (moves.src.tolist(), moves.dst.tolist()) == (src, dst)
        for m in maps.values():
            assert m.keys().tolist() == ref.keys
            assert len(m) == len(ref.keys)


@pytest.mark.parametrize("backend", BACKENDS)
def test_slots_stable_across_growth_and_rehash(backend):
    m = new_map(backend)
    gen = torch.Generator().manual_seed(0)
    first = torch.randint(0, 2**60, (700,), generator=gen)
    slots = m.find_or_insert(first)
    assert m.capacity == MIN_CAPACITY  # 700 keys fit at load <= MAX_LOAD: no rehash for the batch
    for _ in range(6):  # grow through several doublings
        m.find_or_insert(torch.randint(0, 2**60, (5000,), generator=gen))
        assert MAX_LOAD * m.capacity / 2 < len(m) <= MAX_LOAD * m.capacity
    assert torch.equal(m.find(first), slots)
    # Equal ids, equal slots; distinct ids, distinct slots.
    all_slots = m.find(m.keys())
    assert torch.equal(all_slots, torch.arange(len(m), device=all_slots.device))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rehash_a_chunk_at_a_time_keeps_every_slot(backend, monkeypatch):
    """A rehash reinserts the ids a chunk at a time (not past the live ones: ``slot_keys`` has
    room beyond them), as it grows the table, drops tombstones and shrinks it."""
    monkeypatch.setattr(id_map, "REHASH_CHUNK", 97)
    m = new_map(backend)
    gen = torch.Generator().manual_seed(1)
    ids = torch.unique(torch.randint(0, 2**60, (3000,), generator=gen))
    ids = ids[torch.randperm(ids.numel(), generator=gen)]
    m.find_or_insert(ids[:2000])  # grows through rehashes
    m.erase(ids[:100])
    m.find_or_insert(ids[2000:])  # over the tombstones: a rehash at the same capacity
    m.erase(ids[100:2800])  # to a quarter of the load: a shrinking rehash
    keys = m.keys()
    assert sorted(keys.tolist()) == sorted(ids[2800:].tolist())
    assert m.capacity < 4096 and torch.equal(m.find(keys), torch.arange(len(m), device=keys.device))
    assert bool((m.find(ids[:2800]) < 0).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batch_near_the_load_limit_is_looked_up_once(backend, monkeypatch):
    """A batch that could pass the load limit were all its ids new is looked up first, to count
    the new ones; the insert reuses that lookup instead of probing again (a big table's steady
    state), and a batch of known ids ends there."""
    m = new_map(backend)
    m.find_or_insert(torch.arange(600))
    calls = {"lookup": 0, "find_or_insert": 0}
    for name in calls:
        def counted(*args, _real=getattr(m.backend, name), _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(m.backend, name, counted)
    known = torch.arange(500, 0, -1)
    assert MAX_LOAD * m.capacity < 600 + known.numel()  # (the batch takes the counting lookup)
    assert torch.equal(m.find_or_insert(known).cpu(), known)
    assert calls == {"lookup": 1, "find_or_insert": 0}
    mixed = torch.cat([torch.arange(100, 400), torch.arange(5000, 5090), torch.arange(5000, 5010)])
    slots = m.find_or_insert(mixed).cpu()  # (room for its 100 absent ids: no rehash)
    assert torch.equal(slots[:300], torch.arange(100, 400)) and torch.equal(slots[300:390], torch.arange(600, 690))
    assert torch.equal(slots[390:], torch.arange(600, 610)) and len(m) == 690
    assert calls == {"lookup": 2, "find_or_insert": 1}
    assert torch.equal(m.find(m.keys()).cpu(), torch.arange(690))


@pytest.mark.skipif(not native_status(), reason="native op not built")
def test_the_native_insert_completes_the_lookup_it_is_handed_in_place_without_probing_again():
    """The lookup handed over is the one used: a slot doctored in it stays as it is (a second
    probe would have put the true one back) and the absent ids' slots are written into it, with
    no copy; a count of absent ids that does not match it is refused before anything changes."""
    m = IdMap("native")
    m.find_or_insert(torch.arange(600))
    batch = torch.tensor([5, 9000, 7, 9000, 9001])
    slots, _, absent = m.backend.lookup(m.table, batch, *id_map.ANY_ID)
    assert absent == 3
    slots[0] = 42  # (not id 5's slot)
    m._grow_slot_keys(len(m) + batch.numel())
    table, keys = m.table.clone(), m.slot_keys.clone()
    for wrong in (2, 4):
        handed = slots.clone()
        with pytest.raises(RuntimeError, match=f"has 3 absent ids, not the {wrong} counted"):
            torch.ops.kvzch.insert_absent_(m.table, m.slot_keys, batch, handed, wrong, len(m))
        assert torch.equal(m.table, table) and torch.equal(m.slot_keys, keys) and torch.equal(handed, slots)
    size = torch.ops.kvzch.insert_absent_(m.table, m.slot_keys, batch, slots, absent, len(m))
    assert size == 602 and slots.tolist() == [42, 600, 7, 600, 601]
    assert m.slot_keys[600:602].tolist() == [9000, 9001]
    assert torch.ops.kvzch.insert_absent_(m.table, m.slot_keys, batch, slots, 0, size) == size  # (nothing absent)
    returned, bad, _ = m.backend.find_or_insert(m.table, m.slot_keys, batch, *id_map.ANY_ID, size, False,
                                                (slots, 0))
    assert returned is slots and bad == -1  # (the backend hands the completed lookup back, not a copy)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tombstones_are_reclaimed(backend):
    """Insert/erase churn at constant size must not grow the table without bound."""
    m = new_map(backend)
    live = torch.arange(300)
    m.find_or_insert(live)
    for round_ in range(1, 40):
        fresh = torch.arange(300) + 1000 * round_
        m.erase(live)
        m.find_or_insert(fresh)
        live = fresh
    assert len(m) == 300 and m.capacity <= 4 * MIN_CAPACITY
    assert torch.equal(m.find(live), torch.arange(300))


def test_state_is_shared_between_backends():
    """A table built by the native op reads identically through the torch twin, and vice versa."""
    native = IdMap("native")
    ids = torch.randint(0, 2**50, (4000,))
    native.find_or_insert(ids)
    native.erase(ids[:1000])
    queries = torch.cat([ids, torch.randint(0, 2**50, (500,))])
    twin, bad, misses = TorchBackend().lookup(native.table, queries, 0, 2**62)
    assert torch.equal(twin, native.find(queries)) and bad == -1 and misses == int((twin < 0).sum())


@given(seed=st.integers(0, 2**31), load=st.floats(0.0, 0.97), tombs=st.floats(0.0, 0.5),
       window=st.integers(2, 11))
def test_the_torch_twin_finds_the_same_entries_whatever_its_window(seed, load, tombs, window):
    """Probing several entries per round (as on a GPU) ends each probe where stepping one entry
    at a time does: on tables filled by hand up to 97% (long runs that wrap around the end) with
    tombstones, for present, erased and absent ids."""
    table, ids, gen = hand_filled(seed, load, tombs)
    queries = torch.cat([ids, torch.randint(0, 2**62, (50,), generator=gen)])
    want = TorchBackend(1).probe(table, queries)
    live = set(table[:, 0].tolist())
    assert [p >= 0 for p in want.tolist()] == [q in live for q in queries.tolist()]
    assert torch.equal(TorchBackend(window).probe(table, queries), want)


def hand_filled(seed: int, load: float, tombs: float, capacity: int = 256):
    """A table filled by linear probing by hand up to ``load`` (long runs wrap around the end),
    then a ``tombs`` share of its entries erased; (table, the ids put in, the generator)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 2**62, (int(load * capacity),), generator=gen).unique()
    table = torch.full((capacity, 2), id_map.EMPTY, dtype=torch.long)
    for slot, (i, pos) in enumerate(zip(ids.tolist(), home(ids, capacity).tolist())):
        while table[pos, 0] != id_map.EMPTY:
            pos = (pos + 1) % capacity
        table[pos] = torch.tensor([i, slot])
    erased = torch.rand(capacity, generator=gen) < tombs
    table[erased & (table[:, 0] >= 0), 0] = id_map.TOMB
    return table, ids, gen


@pytest.mark.skipif("triton" not in BACKENDS, reason="needs Triton")
@given(seed=st.integers(0, 2**31), load=st.floats(0.0, 0.9), tombs=st.floats(0.0, 0.5))
def test_the_gpu_kernels_probe_and_place_as_the_twin_on_crowded_tables(seed, load, tombs):
    """Probes walk past tombstones and around the end to where the twin's end; new ids racing
    for the same free entries each get one of their own, found again with their slots."""
    table, ids, gen = hand_filled(seed, load, tombs)
    device = new_map("triton").device
    gpu = id_map.TritonBackend(device)
    queries = torch.cat([ids, torch.randint(0, 2**62, (50,), generator=gen)])
    assert torch.equal(gpu.probe(table.to(device), queries.to(device)).cpu(), TorchBackend(1).probe(table, queries))
    room = int((table[:, 0] == id_map.EMPTY).sum()) - 1  # an empty entry stays, ending probes
    new = torch.randint(2**62, 2**63 - 1, (room,), generator=gen).unique()
    slots = torch.arange(1000, 1000 + new.numel())
    placed = table.to(device)
    gpu._place(placed, new.to(device), slots.to(device))
    placed = placed.cpu()
    kept = table[:, 0] >= 0
    assert torch.equal(placed[kept], table[kept])  # live entries untouched
    assert torch.equal(TorchBackend(1).lookup(placed, new, 0, 2**63 - 1)[0], slots)
    assert torch.equal(TorchBackend(1).lookup(placed, ids, 0, 2**63 - 1)[0],
                      TorchBackend(1).lookup(table, ids, 0, 2**63 - 1)[0])


@pytest.mark.parametrize("threads", [1, 2, 4])
@given(seed=st.integers(0, 2**31), load=st.floats(0.5, 0.97), tombs=st.floats(0.0, 0.5))
def test_native_lookup_parks_long_probes_and_finds_what_the_twin_finds(threads, seed, load, tombs):
    """The native lookup parks probes that run past their bucket's line and resumes them later
    (and works its queue off, in order, whenever it runs full). On crowded tables with
    tombstones, where most probes run on and wrap around the end, and batches of 20,000 ids
    (present, erased, absent, repeated), it finds exactly the entries the twin's one-entry steps
    find."""
    capacity = 4096
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 2**62, (int(load * capacity),), generator=gen).unique()
    table = torch.full((capacity, 2), id_map.EMPTY, dtype=torch.long)
    TorchBackend._place(table, ids, torch.arange(ids.numel()))
    table[(torch.rand(capacity, generator=gen) < tombs) & (table[:, 0] >= 0), 0] = id_map.TOMB
    pool = torch.cat([ids, torch.randint(0, 2**62, (2000,), generator=gen)])
    queries = pool[torch.randint(0, pool.numel(), (20_000,), generator=gen)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        positions = torch.ops.kvzch.probe(table, queries)
        slots, bad, misses = torch.ops.kvzch.lookup(table, queries, 0, 2**62)
    finally:
        torch.set_num_threads(before)
    want = TorchBackend(1).probe(table, queries)
    assert torch.equal(positions, want)
    found = want >= 0
    assert torch.equal(slots[found], table[want[found], 1]) and (slots[~found] == -1).all()
    assert bad == -1 and misses == int((~found).sum())


@pytest.mark.parametrize("first", [False, True, "looked"])
@pytest.mark.parametrize("threads", [1, 2, 4])
@given(seed=st.integers(0, 2**31), load=st.floats(0.5, 0.95), tombs=st.floats(0.0, 0.3))
def test_native_inserts_on_crowded_tables_keep_first_appearance_order(first, threads, seed, load,
                                                                       tombs):
    """Parked probes of an insert resume in turn, so a repeat never claims an entry before the
    first appearance of its id: on tables crowded by hand (long probe runs, tombstones, wrap
    around the end), with batches of 20,000 present and new ids, each many times, the native op
    gives every id the slot the twin gives it, and leaves a table where the twin finds them all;
    whether it looks the batch up itself first or not, or is handed the caller's lookup."""
    capacity = 4096
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 2**62, (int(load * capacity),), generator=gen).unique()
    table = torch.full((capacity, 2), id_map.EMPTY, dtype=torch.long)
    TorchBackend._place(table, ids, torch.arange(ids.numel()))
    erased = (torch.rand(capacity, generator=gen) < tombs) & (table[:, 0] >= 0)
    absent = torch.cat([table[erased, 0], torch.randint(0, 2**62, (150,), generator=gen)])
    table[erased, 0] = id_map.TOMB
    room = int((table[:, 0] == id_map.EMPTY).sum()) - 1  # new ids claim empty entries only
    pool = torch.cat([table[table[:, 0] >= 0, 0], absent[:room]])  # live, erased and new ids
    batch = pool[torch.randint(0, pool.numel(), (20_000,), generator=gen)]
    size = ids.numel()
    twin_table, twin_keys = table.clone(), torch.full((size + batch.numel(),), -1)
    want, _, want_size = TorchBackend().find_or_insert(twin_table, twin_keys, batch, 0, 2**62, size,
                                                       True)
    keys = torch.full((size + batch.numel(),), -1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if first == "looked":
            slots, _, absent = TorchBackend().lookup(table, batch, 0, 2**62)
            bad, new_size = -1, torch.ops.kvzch.insert_absent_(table, keys, batch, slots, absent, size)
        else:
            slots, bad, new_size = torch.ops.kvzch.find_or_insert(table, keys, batch, 0, 2**62, size, first)
    finally:
        torch.set_num_threads(before)
    assert bad == -1 and new_size == want_size and torch.equal(slots, want)
    assert torch.equal(keys[size:new_size], twin_keys[size:new_size])
    found, _, misses = TorchBackend().lookup(table, batch, 0, 2**62)
    assert torch.equal(found, want) and misses == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_ids_are_rejected_before_any_change(backend):
    m = new_map(backend)
    m.find_or_insert(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="ids must be non-negative global ids, got -5"):
        m.find_or_insert(torch.tensor([4, -5]))
    with pytest.raises(TypeError, match="ids must be an int64"):
        m.find_or_insert(torch.tensor([1.0, 2.0]))
    assert m.keys().tolist() == [1, 2, 3]


@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bounds_are_checked_before_any_change(backend, first):
    """A lookup refuses ids outside its bounds in the same pass, naming the first one, and inserts
    nothing; an absent id inside them reads -1."""
    m = new_map(backend)
    m.find_or_insert(torch.tensor([10, 11]))
    with pytest.raises(IdOutOfRange) as caught, lookup_first(first):
        m.find_or_insert(torch.tensor([12, 10, 25, 9, 30]), bounds=(10, 20))
    assert caught.value.id == 25 and caught.value.bounds == (10, 20)
    assert m.keys().tolist() == [10, 11]
    assert m.find(torch.tensor([11, 19]), bounds=(10, 20)).tolist() == [1, -1]
    with pytest.raises(IdOutOfRange):
        m.find(torch.tensor([20]), bounds=(10, 20))
    many = torch.full((2000,), 11)  # (GPU kernels: blocks of 512, the first bad id in a later block)
    many[[1500, 1900]] = torch.tensor([21, 5])
    with pytest.raises(IdOutOfRange) as caught:
        m.find(many, bounds=(10, 20))
    assert caught.value.id == 21


def test_memory_tracks_live_keys():
    m = IdMap("native")
    m.find_or_insert(torch.arange(100_000))
    # Load in (MAX_LOAD / 2, MAX_LOAD] with a power-of-two table of 16-byte entries, plus slot_keys.
    assert m.nbytes / len(m) <= 2 * 16 / MAX_LOAD + 8 * 1.5
    big = m.nbytes
    m.erase(torch.arange(99_000))
    assert m.nbytes < big / 16  # shrinks with the live keys
    assert m.find_or_insert(torch.tensor([10**12, 99_500])).tolist() == [1000, 500]
    assert torch.equal(m.find(torch.arange(99_000, 100_000)), torch.arange(1000))


def _ids_with_home(bucket_start: int, capacity: int, count: int) -> list[int]:
    """Ids whose probe starts at ``bucket_start`` in a table of ``capacity`` entries."""
    pool = torch.arange(1, 1 << 22)
    return pool[home(pool, capacity) == bucket_start][:count].tolist()


@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_native_slots_do_not_depend_on_threads(threads, first):
    """The native find_or_insert splits the table into one region per thread. Slots come out in
    first-appearance order whatever the split, including for ids whose probe runs from one region
    into the next, or from the table's end around to its start."""
    capacity = 4096
    span = capacity // threads // BUCKET * BUCKET  # the regions, as the op cuts them
    ends = [span * (r + 1) for r in range(threads - 1)] + [capacity]
    crowded = []  # six ids on the last bucket of every region: two of them spill over its end
    for end in ends:
        crowded += _ids_with_home(end - BUCKET, capacity, 6)
        crowded += _ids_with_home(end % capacity, capacity, 2)  # and on the next one's first
    gen = torch.Generator().manual_seed(threads)
    batches = []
    for _ in range(4):
        mixed = crowded + torch.randint(0, 2**40, (300,), generator=gen).tolist()
        order = torch.randperm(len(mixed), generator=gen).tolist()
        batches.append([mixed[i] for i in order][:200] * 2)  # every id at least twice
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        m, ref = IdMap("native"), ReferenceMap()
        m.reserve(2000)
        assert m.capacity == capacity
        with lookup_first(first):  # (then only the absent ids of a batch go through the regions)
            for batch in batches:
                assert m.find_or_insert(torch.tensor(batch)).tolist() == ref.find_or_insert(batch)
                assert m.keys().tolist() == ref.keys
    finally:
        torch.set_num_threads(before)
    # The table it built reads the same through the torch twin.
    every = torch.tensor(ref.keys + [2**41, 2**41 + 1])
    twin, bad, misses = TorchBackend().lookup(m.table, every, 0, 2**62)
    assert twin.tolist() == ref.find(every.tolist()) and bad == -1 and misses == 2


@pytest.mark.skipif("triton" not in BACKENDS, reason="needs Triton")
@SORTING
@given(seed=st.integers(0, 2**31), rows=st.integers(1, 400), n=st.integers(0, 3000), clock=st.integers(0, 2**40))
def test_the_gpu_header_touch_is_the_twins(seed, rows, n, clock):
    """Timestamps, counts grown by occurrences (saturating, hot rows included) and used bits:
    as ``layout.touch_meta``, and the scratch counters are left zero for the next batch."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.where(torch.rand(rows, generator=gen) < 0.2, layout.COUNT_MAX - torch.randint(0, 50, (rows,), generator=gen),
                         torch.randint(0, 1000, (rows,), generator=gen))
    meta = layout.make_meta(torch.randint(0, 2**32, (rows,), generator=gen), counts, used=True)
    meta = torch.where(torch.rand(rows, generator=gen) < 0.1, meta & (2**63 - 1), meta)  # unused rows
    slots = torch.randint(0, rows, (n,), generator=gen)
    slots[: n // 2] = slots[: n // 2] % 3  # a few hot rows
    gpu = id_map.TritonBackend(new_map("triton").device)
    want, got = meta.clone(), meta.to(gpu._counts.device)
    layout.touch_meta(want, slots, clock, native=False)
    gpu.touch(got, slots.to(got.device), clock)
    assert torch.equal(got.cpu(), want) and not bool(gpu._counts.any())



# Each GPU kernel's arguments: a type for Triton's compiler, or a compile-time value.
_I64, _PTR64, _PTR32 = "i64", "*i64", "*i32"
_GEOMETRY = dict(fib=_I64, shift=_I64, first=_I64, wrap=_I64, EMPTY=-1)
KERNELS = {
    "_probe_kernel": dict(table=_PTR64, ids=_PTR64, pos_out=_PTR64, slot_out=_PTR64, stats=_PTR64, n=_I64,
                          lo=_I64, hi=_I64, **_GEOMETRY, BLOCK=512),
    "_place_kernel": dict(table=_PTR64, ids=_PTR64, slots=_PTR64, n=_I64, **_GEOMETRY, NEVER=-3, BLOCK=512),
    "_count_kernel": dict(slots=_PTR64, counts=_PTR32, leads=_PTR32, n=_I64, NO_SLOT=1 << 53, LOG=9, BLOCK=512),
    "_header_kernel": dict(meta=_PTR64, slots=_PTR64, counts=_PTR32, leads=_PTR32, n=_I64, clock=_I64,
                           COUNT_MAX=2**31 - 1, USED=-(1 << 63), BLOCK=512),
}
COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from torchrec_kvzch.table import gpu_kernels

for name, args in json.loads(sys.argv[1]).items():
    fn = getattr(gpu_kernels, name)
    assert list(args) == fn.arg_names, (name, fn.arg_names)
    signature = {k: v if isinstance(v, str) else "constexpr" for k, v in args.items()}
    constants = {(fn.arg_names.index(k),): v for k, v in args.items() if not isinstance(v, str)}
    kernel = triton.compile(ASTSource(fn, signature, constexprs=constants), target=GPUTarget("cuda", 90, 32))
    assert kernel.asm["cubin"], name
"""


@pytest.mark.skipif("triton" not in BACKENDS or not (Path(importlib.util.find_spec("triton").origin).parent
                                                     / "backends" / "nvidia").is_dir(),
                    reason="needs Triton with its NVIDIA backend")
def test_the_gpu_kernels_compile_for_an_h100_without_a_gpu(tmp_path):
    """Triton's own compiler (ptxas included) builds every GPU kernel for sm_90 on a machine with
    no GPU: what the interpreter runs above is also what a GPU run gets, without device time."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(KERNELS)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.skipif("triton" not in BACKENDS, reason="needs Triton")
@SORTING
@given(seed=st.integers(0, 2**31), rows=st.integers(1, 3000), n=st.integers(0, 3000))
def test_the_gpu_count_adds_occurrences_and_elects_one_lane_per_row(seed, rows, n):
    """The touch's count (runs of a row within a block add at once): every counter grows by its
    row's occurrences, and exactly one occurrence of each row not counted before leads (writes
    its header); on a GPU two leaders of one row would race on its header."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randint(0, rows, (n,), generator=gen)
    slots[: n // 2] = slots[: n // 2] % 3  # hot rows, spread over blocks
    slots = slots[torch.randperm(n, generator=gen)]
    before = torch.where(torch.rand(rows, generator=gen) < 0.1, 5, 0).int()  # counted already
    gpu = id_map.TritonBackend(new_map("triton").device)
    counts = before.clone().to(gpu._counts.device)
    leads = gpu.kernels.count(slots.to(counts.device), counts).cpu()
    assert torch.equal(counts.cpu(), before + torch.bincount(slots, minlength=rows).int())
    assert bool((leads >= 0).all())
    led = slots[leads == 0]
    assert led.unique().numel() == led.numel()
    assert set(led.tolist()) == {s for s in slots.tolist() if before[s] == 0}
