"""Row snapshots: a frozen snapshot reads its rows as they were at the freeze, whatever the store
does afterwards (train, insert, grow, delete, shrink, clear, reload), also from another thread."""

import threading

import pytest
import torch
from hypothesis import given, strategies as st

from torchrec_kvzch import KVZCHTableParams, RowStore
from torchrec_kvzch.table.tbe import TableTBE
from torchrec_kvzch.table.snapshot import RowSnapshot
from torchrec_kvzch.table.layout import RowPart

PARTS = (RowPart.ROW, RowPart.WEIGHT, RowPart.OPTIMIZER, RowPart.ID)


def params(**kw):
    return KVZCHTableParams("tbl", 8, num_embeddings=2**20, total_num_buckets=16, **kw)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t


def train(store: RowStore, ids: torch.Tensor, gen: torch.Generator) -> None:
    """What the kernel does in a step: look up (touch) the ids, then update their rows in place."""
    store.clock += 1
    slots = store.find_or_insert(ids)
    store.weights[slots] += torch.randn(slots.numel(), 8, generator=gen)
    store.optimizer[slots] += 1.0


def reads(snap, chunk=7) -> dict:
    """Every part of every position, read chunk by chunk."""
    return {part: torch.cat([bits(snap.read(s, min(chunk, len(snap) - s), part))
                             for s in range(0, max(len(snap), 1), chunk)]) for part in PARTS}


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[p], b[p]) for p in PARTS)


OPS = st.lists(st.tuples(st.sampled_from(["train", "insert", "delete", "write", "clear"]),
                         st.integers(0, 2**31)), max_size=12)


@pytest.mark.parametrize("backend", ["native", "torch"])
@given(rows=st.integers(0, 300), ops=OPS)
def test_frozen_snapshot_keeps_the_rows_of_the_freeze(backend, rows, ops):
    gen = torch.Generator().manual_seed(rows)
    store = RowStore(params(), backend=backend)
    ids = torch.randperm(2**20, generator=gen)[:rows]
    train(store, ids, gen)
    snap = RowSnapshot(store)
    snap.freeze()
    frozen = reads(snap)
    for op, seed in ops:
        g = torch.Generator().manual_seed(seed)
        live = torch.sort(store.keys()).values
        some = live[torch.randperm(live.numel(), generator=g)[: live.numel() // 3 + 1]] if live.numel() else live
        if op == "train":  # old and new ids, in place like fbgemm's fused update
            train(store, torch.cat([some, torch.randint(0, 2**20, (50,), generator=g)]), g)
        elif op == "insert":  # grows the arrays
            store.find_or_insert(torch.randint(0, 2**20, (2000,), generator=g))
        elif op == "delete":  # compaction moves rows; deleting most rows shrinks the arrays
            store.delete(live if seed % 3 == 0 else some)
        elif op == "write":
            store.write_ids(some, torch.randn(some.numel(), 8, generator=g))
        else:  # what a load does: clear, then rows by id
            rows_now = store.read_ids(some, RowPart.ROW)
            store.clear()
            store.write_rows(rows_now)
        assert same(reads(snap), frozen), op
    snap.release()
    assert not store._frozen and snap.copied_bytes == 0
    # Released: reads show the live rows again (rows deleted since read as absent).
    live = {p: bits(store.read_ids(snap.ids, p)) for p in PARTS[:3]} | {RowPart.ID: snap.ids.unsqueeze(1)}
    assert same(reads(snap, chunk=max(len(snap), 1)), live)


def test_only_rows_changed_while_frozen_are_copied():
    store = RowStore(params())
    gen = torch.Generator().manual_seed(0)
    train(store, torch.arange(10_000), gen)
    snap = RowSnapshot(store)
    snap.freeze()
    base = snap.copied_bytes  # the per-position index only
    train(store, torch.arange(100), gen)
    train(store, torch.arange(50), gen)  # already copied: not again
    row_bytes = store.arrays.empty_like(1).nbytes
    assert snap.copied_bytes - base <= 1024 * row_bytes  # the copies grow in blocks of 1024 rows
    assert int((snap._frozen.saved_at >= 0).sum()) == 100


def test_a_snapshot_freezes_once_and_only_while_current():
    store = RowStore(params())
    store.find_or_insert(torch.arange(10))
    snap = RowSnapshot(store)
    snap.freeze()
    with pytest.raises(ValueError, match="already being saved"):
        snap.freeze()
    stale = RowSnapshot(store)
    store.delete(torch.tensor([3]))
    with pytest.raises(ValueError, match="take the state dict again"):
        stale.freeze()


def test_dropped_snapshot_stops_the_copying():
    store = RowStore(params())
    store.find_or_insert(torch.arange(10))
    snap = RowSnapshot(store)
    snap.freeze()
    assert store._frozen
    del snap
    assert not store._frozen


def test_kernel_step_pending_at_the_freeze_is_not_in_the_snapshot():
    """Forward before the freeze, backward (the fused update) after it."""
    tbe = TableTBE(params(learning_rate=0.5), params().bucket_range(0, 1))
    ids, offsets = torch.arange(40), torch.arange(0, 41, 2)
    tbe(ids, offsets).sum().backward()
    out = tbe(ids, offsets)
    snap = RowSnapshot(tbe.store)
    snap.freeze()
    frozen = reads(snap)
    out.sum().backward()
    tbe(ids, offsets).sum().backward()
    assert not torch.equal(tbe.store.read_ids(ids), snap.read(0, 40, RowPart.WEIGHT))
    assert same(reads(snap), frozen)


def test_reading_in_another_thread_while_training():
    store = RowStore(params(), backend="native")
    gen = torch.Generator().manual_seed(1)
    train(store, torch.arange(0, 2**20, 16), gen)  # 65536 rows
    snap = RowSnapshot(store)
    snap.freeze()
    frozen = {p: bits(snap.read(0, len(snap), p)) for p in (RowPart.ROW, RowPart.WEIGHT)}
    bad, done = [], threading.Event()

    def reader():
        while not done.is_set():
            for start in range(0, len(snap), 4096):
                for part in frozen:
                    got = bits(snap.read(start, 4096, part))
                    if not torch.equal(got, frozen[part][start : start + 4096]):
                        bad.append((part, start))

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for step in range(60):
            train(store, torch.randint(0, 2**20, (3000,), generator=gen), gen)
            if step % 20 == 19:
                store.delete(torch.sort(store.keys()).values[::7])
    finally:
        done.set()
        thread.join()
    assert not bad


@given(world=st.integers(1, 5), rank=st.integers(0, 4), total=st.integers(1, 40),
       size=st.integers(1, 50_000),
       picks=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(["first", "last", "any"])),
                      max_size=60))
def test_snapshot_bucket_counts_match_the_store(world, rank, total, size, picks):
    """The snapshot counts rows per bucket by binary search over its sorted ids; it agrees with
    a count by dividing each of the store's ids, for every shard, empty buckets included, with
    ids on the first and last id of their buckets."""
    rank, total = rank % world, max(total, world)
    p = KVZCHTableParams("tbl", 8, num_embeddings=total * size, total_num_buckets=total)
    store = RowStore(p, bucket_range=p.bucket_range(rank, world))
    r = store.bucket_range
    if picks:
        ids = []
        for x, where in picks:
            bucket = r.start + x % r.num_buckets
            lo, hi = bucket * r.size, (bucket + 1) * r.size - 1
            ids.append({"first": lo, "last": hi, "any": lo + x % (hi - lo + 1)}[where])
        store.find_or_insert(torch.tensor(ids, dtype=torch.long), touch=False)
    counts = RowSnapshot(store).bucket_counts()
    want = torch.bincount(store.bucket_range.local_buckets(store.keys()), minlength=r.num_buckets)  # by division
    assert counts.tolist() == want.tolist()
    assert int(counts.sum()) == len(store)
