"""The row store: upstream row layout, whole-row round trips, deletes, buckets, bad input."""

import pytest
import torch
from hypothesis import given, strategies as st

from torchrec_kvzch import KVZCHTableParams, RowLayout, RowStore
from torchrec_kvzch.table.initializer import fill_uniform_by_id, uniform_by_id_torch
from torchrec_kvzch.table.snapshot import RowSnapshot
from torchrec_kvzch.table.layout import RowPart, make_meta, meta_count, meta_timestamp, meta_used


def bits(rows: torch.Tensor) -> torch.Tensor:
    """Whole rows as integers: header bytes read as floats can be NaN, which never equals itself."""
    return rows.view(torch.int32 if rows.element_size() == 4 else torch.int16)


def params(dim=6, optimizer="exact_rowwise_adagrad", dtype="fp32", **kw):
    return KVZCHTableParams("tbl", dim, num_embeddings=2**40, total_num_buckets=256,
                            optimizer=optimizer, weight_dtype=dtype, **kw)


def trained_store(p, ids, seed=0, backend="auto"):
    """A store whose rows hold distinct weights, optimizer state and header words."""
    store = RowStore(p, backend=backend)
    gen = torch.Generator().manual_seed(seed)
    for step, chunk in enumerate(ids.split(97)):
        store.clock = step + 1
        slots = store.find_or_insert(chunk)
        store.weights[slots] += torch.randn(slots.numel(), p.embedding_dim, generator=gen).to(p.dtype)
        if store.optimizer.shape[1]:
            store.optimizer[slots] = torch.rand(slots.numel(), store.optimizer.shape[1], generator=gen)
    return store


def test_layout_matches_upstream_widths():
    # fp32, rowwise Adagrad, D=6: 4 header + pad4(6)=8 weight + pad4(1)=4 optimizer.
    lay = RowLayout.for_table(params(6))
    assert (lay.header_width, lay.weight_width, lay.optimizer_width, lay.row_width) == (4, 8, 4, 16)
    assert lay.width_offset(RowPart.WEIGHT) == 4 and lay.width_offset(RowPart.OPTIMIZER) == 12
    # fp16: 8 header elements, the fp32 accumulator is 2 halves padded to 4.
    lay16 = RowLayout.for_table(params(6, dtype="fp16"))
    assert (lay16.header_width, lay16.weight_width, lay16.optimizer_width) == (8, 8, 4)
    assert RowLayout.for_table(params(8, optimizer="exact_sgd")).row_width == 12
    assert RowLayout(8, torch.float32, 16).optimizer_width == 16  # e.g. upstream Adam rows (m and v)


def test_header_bytes_are_the_upstream_metaheader():
    p = params(4)
    store = RowStore(p)
    store.clock = 77
    store.find_or_insert(torch.tensor([2**39 + 5, 2**39 + 5, 9]))
    row = store.read_ids(torch.tensor([2**39 + 5]), RowPart.ROW)[0]
    raw = row[:4].contiguous().view(torch.uint8)
    assert int.from_bytes(bytes(raw[:8].tolist()), "little") == 2**39 + 5  # key at byte 0
    assert int.from_bytes(bytes(raw[8:12].tolist()), "little") == 77  # timestamp at byte 8
    word = int.from_bytes(bytes(raw[12:16].tolist()), "little")
    assert word & 0x7FFFFFFF == 2 and word >> 31 == 1  # count 2 (seen twice), used bit set


def test_meta_word_helpers_round_trip():
    meta = make_meta(torch.tensor([0, 2**32 - 1]), torch.tensor([5, 2**31 - 1]))
    assert meta_timestamp(meta).tolist() == [0, 2**32 - 1]
    assert meta_count(meta).tolist() == [5, 2**31 - 1]
    assert meta_used(meta).all() and not meta_used(make_meta(1, 1, used=False)).any()


@pytest.mark.parametrize("optimizer", ["exact_rowwise_adagrad", "exact_sgd"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@given(n=st.integers(0, 700), dim=st.integers(1, 19), chunk=st.integers(1, 300), seed=st.integers(0, 99))
def test_whole_rows_round_trip_under_any_chunking(optimizer, dtype, n, dim, chunk, seed):
    p = params(dim, optimizer=optimizer, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.unique(torch.randint(0, 2**40, (n,), generator=gen))
    src = trained_store(p, ids[torch.randperm(ids.numel(), generator=gen)], seed)
    order = torch.sort(src.keys()).values
    dst = RowStore(p)
    for start in range(0, len(src), chunk):
        dst.write_rows(src.read(torch.arange(start, min(start + chunk, len(src))), RowPart.ROW))
    assert len(dst) == len(src)
    assert torch.equal(bits(dst.read_ids(order, RowPart.ROW)), bits(src.read_ids(order, RowPart.ROW)))
    header = dst.read_ids(order, RowPart.ROW)[:, : dst.layout.header_width].contiguous().view(torch.long)
    assert torch.equal(header[:, 0], order)  # header key = global id


def test_whole_row_writes_skip_unused_rows_and_validate_shape():
    p = params(4)
    src = trained_store(p, torch.arange(10))
    rows = src.read_ids(torch.tensor([1, 2, 10**6]), RowPart.ROW)  # 10**6 is absent: used bit 0
    dst = RowStore(p)
    assert dst.write_rows(rows) == 2
    assert sorted(dst.keys().tolist()) == [1, 2]
    with pytest.raises(ValueError, match=r"row values must be \[3, 16\], got \[3, 12\] \(whole rows of another"):
        RowStore(params(8)).write_rows(rows)
    with pytest.raises(ValueError, match="row values must be"):
        dst.write_rows(rows[:, :5])


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_delete_keeps_surviving_rows_intact(backend):
    p = params(5)
    ids = torch.randint(0, 2**40, (3000,)).unique()
    store = trained_store(p, ids, backend=backend)
    before = store.read_ids(ids, RowPart.ROW)
    gone = ids[::3]
    assert store.delete(torch.cat([gone, torch.tensor([7])])) == gone.numel()
    keep = torch.ones(ids.numel(), dtype=torch.bool)
    keep[::3] = False
    assert torch.equal(bits(store.read_ids(ids[keep], RowPart.ROW)), bits(before[keep]))
    assert (store.find(gone) == -1).all()
    assert len(store) == int(keep.sum())
    store.delete(ids)
    assert len(store) == 0 and store.capacity <= 1024


def test_reads_and_writes_by_part_and_slot():
    p = params(3)
    store = RowStore(p)
    ids = torch.tensor([10, 20, 30])
    store.write_ids(ids, torch.ones(3, 3), RowPart.WEIGHT)
    store.write_ids(ids[1:], torch.full((2, 1), 0.5), RowPart.OPTIMIZER)
    assert torch.equal(store.read_ids(ids, RowPart.OPTIMIZER).squeeze(1), torch.tensor([0.0, 0.5, 0.5]))
    store.write(torch.tensor([1, 2]), torch.full((2, 3), 2.0))
    assert torch.equal(store.read(torch.arange(3)), torch.tensor([[1.0] * 3, [2.0] * 3, [2.0] * 3]))
    assert torch.equal(store.read_ids(torch.tensor([99])), torch.zeros(1, 3))  # absent: zeros
    with pytest.raises(ValueError, match=r"weight values must be \[2, 3\]"):
        store.write_ids(ids[:2], torch.ones(2, 4))


def test_new_rows_are_id_seeded_and_order_independent():
    p = params(16, init_range=(-0.5, 0.5))
    a, b = RowStore(p), RowStore(p)
    ids = torch.randint(0, 2**40, (500,))
    a.find_or_insert(ids)
    b.find_or_insert(ids.flip(0))
    assert torch.equal(a.read_ids(ids), b.read_ids(ids))
    w = a.read_ids(ids)
    assert w.min() >= -0.5 and w.max() < 0.5 and w.std() > 0.2
    assert (a.read_ids(ids, RowPart.OPTIMIZER) == 0).all()


@given(ids=st.lists(st.integers(0, 2**62), max_size=200), dim=st.integers(1, 40),
       low=st.floats(-10, 0), width=st.floats(1e-3, 10), seed=st.integers(-2**40, 2**40))
def test_native_and_torch_initializers_are_bit_identical(ids, dim, low, width, seed):
    t = torch.tensor(ids, dtype=torch.long)
    native = torch.empty(len(ids), dim)
    fill_uniform_by_id(native, t, low, low + width, seed, native=True)
    assert torch.equal(native, uniform_by_id_torch(t, dim, low, low + width, seed))


def test_ids_outside_the_shard_are_rejected_before_any_change():
    p = params(4)
    shard = p.bucket_range(1, 4)  # buckets [64, 128)
    store = RowStore(p, bucket_range=shard)
    store.find_or_insert(torch.tensor([shard.id_start]))
    with pytest.raises(ValueError, match=r"table 'tbl': id 0 is outside this shard's ids"):
        store.find_or_insert(torch.tensor([shard.id_start + 1, 0]))
    assert len(store) == 1
    counts = RowSnapshot(store).bucket_counts()
    assert counts.shape == (64,) and counts.tolist()[0] == 1 and int(counts.sum()) == 1
    # The widest table int64 ids allow: its one shard spans [0, 2^63 - 1), and the last id is out.
    widest = KVZCHTableParams("wide", 4, num_embeddings=2**63 - 1, total_num_buckets=7)
    store = RowStore(widest, bucket_range=widest.bucket_range(0, 1))
    with pytest.raises(ValueError, match=r"table 'wide': id 9223372036854775807 is outside this shard's ids"):
        store.find_or_insert(torch.tensor([5, 2**63 - 1]))
    assert len(store) == 0
    with pytest.raises(ValueError, match="KV-ZCH table 'wide': num_embeddings 9223372036854775808 ids do not fit"):
        KVZCHTableParams("wide", 4, num_embeddings=2**63, total_num_buckets=8)


def test_bucket_sorted_ids_and_counts():
    p = KVZCHTableParams("b", 4, num_embeddings=1000, total_num_buckets=10)
    store = RowStore(p, bucket_range=p.bucket_range(0, 1))
    store.find_or_insert(torch.tensor([950, 3, 512, 99, 100, 101]))
    assert torch.sort(store.keys()).values.tolist() == [3, 99, 100, 101, 512, 950]
    assert RowSnapshot(store).bucket_counts().tolist() == [2, 2, 0, 0, 0, 1, 0, 0, 0, 1]


def test_memory_is_proportional_to_live_rows():
    p = KVZCHTableParams("m", 64, num_embeddings=2**50)
    store = RowStore(p)
    store.find_or_insert(torch.randint(0, 2**50, (20_000,)))
    per_row = store.nbytes / len(store)
    # 64 fp32 + 1 fp32 + 8 meta = 268 bytes of row data; geometric growth and the map add < 2x.
    assert per_row < 2 * 268 + 64


@given(slots=st.lists(st.integers(0, 63), max_size=300), clock=st.integers(0, 2**40),
       start_counts=st.lists(st.sampled_from([0, 5, 2**31 - 2, 2**31 - 1]), min_size=64, max_size=64))
def test_native_and_torch_header_touch_agree(slots, clock, start_counts):
    from torchrec_kvzch.table.layout import touch_meta

    meta = make_meta(torch.arange(64), torch.tensor(start_counts))
    native, twin = meta.clone(), meta.clone()
    s = torch.tensor(slots, dtype=torch.long)
    touch_meta(native, s, clock, native=True)
    touch_meta(twin, s, clock, native=False)
    assert torch.equal(native, twin)
    hits = torch.bincount(s, minlength=64)
    touched = hits > 0
    want = torch.clamp(torch.tensor(start_counts) + hits, max=2**31 - 1)
    assert torch.equal(meta_count(native)[touched], want[touched])
    assert (meta_timestamp(native)[touched] == clock % 2**32).all() and meta_used(native).all()


@pytest.mark.parametrize("optimizer", ["exact_rowwise_adagrad", "exact_sgd"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@given(n=st.integers(1, 300), dim=st.integers(1, 19), seed=st.integers(0, 99))
def test_native_row_gather_matches_the_torch_pack(optimizer, dtype, n, dim, seed):
    p = params(dim, optimizer=optimizer, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    store = trained_store(p, torch.randint(0, 2**40, (n,), generator=gen).unique(), seed)
    assert store.native
    slots = torch.randint(0, len(store), (2 * n,), generator=gen)  # repeats, any order
    want = store.layout.pack(store.keys()[slots], store.meta[slots], store.weights[slots],
                             store.optimizer[slots])
    assert torch.equal(bits(store.read(slots, RowPart.ROW)), bits(want))


def test_header_touch_counts_every_occurrence_of_a_large_skewed_batch():
    """Hot rows repeat thousands of times in a batch: every occurrence is counted once, as in the
    torch twin, whatever the thread count (the native touch splits the rows among threads by
    header line)."""
    from torchrec_kvzch.table.layout import touch_meta

    gen = torch.Generator().manual_seed(0)
    rows = 5000
    # Skewed (hot low rows); not a multiple of 4, so the vector filter leaves a scalar tail.
    slots = (torch.rand(200_003, generator=gen).pow(4) * rows).long()
    meta = make_meta(torch.arange(rows), torch.randint(0, 100, (rows,), generator=gen))
    results = []
    threads = torch.get_num_threads()
    for native, n_threads in ((False, threads), (True, 1), (True, 2), (True, 3), (True, 4)):
        torch.set_num_threads(n_threads)
        out = meta.clone()
        touch_meta(out, slots, 77, native=native)
        results.append(out)
    torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])
    assert int(meta_count(results[0]).sum() - meta_count(meta).sum()) == slots.numel()
