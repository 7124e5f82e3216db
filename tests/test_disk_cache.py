"""A table shard over a disk tier (issue 32): training with a DRAM cache far smaller than the
table is training in DRAM - the same outputs, and the same rows (headers, weights, optimizer
state) bit for bit, wherever they are - and evaluation moves no row."""

import dataclasses

import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode

from torchrec_kvzch import KVZCHTableParams, TableTBE
from torchrec_kvzch.params import AdmissionPolicy, DiskStorage, EvictionPolicy
from torchrec_kvzch.table.layout import RowPart


def tables(tmp_path, cache_rows: int, **kw):
    p = KVZCHTableParams("t", 16, num_embeddings=2**40, total_num_buckets=8, learning_rate=0.05,
                         stochastic_rounding=False, init_range=(-0.5, 0.5), **kw)
    from torchrec_kvzch.table.layout import RowLayout
    disk = dataclasses.replace(p, storage=DiskStorage(tmp_path, RowLayout.for_table(p).stored_bytes * cache_rows))
    return disk, p


@pytest.mark.parametrize("optimizer", ["exact_rowwise_adagrad", "exact_sgd"])
@pytest.mark.parametrize("pooling", [PoolingMode.SUM, PoolingMode.MEAN])
def test_training_over_a_small_dram_cache_is_training_in_dram(tmp_path, optimizer, pooling):
    disk, dram = tables(tmp_path, 300, optimizer=optimizer)
    ours = TableTBE(disk, disk.bucket_range(0, 1), num_features=2, pooling=pooling)
    ref = TableTBE(dram, dram.bucket_range(0, 1), num_features=2, pooling=pooling)
    gen = torch.Generator().manual_seed(0)
    universe = torch.randint(0, 2**40, (2000,), generator=gen).unique()
    for _ in range(10):
        lengths = torch.randint(0, 3, (2 * 64,), generator=gen)
        ids = universe[torch.randint(0, universe.numel(), (int(lengths.sum()),), generator=gen)]
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        out, want = ours(ids, offsets), ref(ids, offsets)
        assert torch.equal(out, want)
        grad = torch.randn(want.shape, generator=gen)
        out.backward(grad)
        want.backward(grad)
    store, cache = ours.store, ours.store.cache
    assert len(store) <= cache.max_rows and cache.moved_out > 0 and cache.moved_in > 0
    assert len(store) + len(cache) == len(ref.store)
    seen = torch.sort(ref.store.keys()).values
    bits = [s.read_ids(seen, RowPart.ROW).view(torch.int32) for s in (store, ref.store)]  # (headers: no float compare)
    assert torch.equal(*bits)
    moved = (cache.moved_out, cache.moved_in, len(store))
    with torch.no_grad():  # evaluation reads rows where they are: the same outputs, nothing moves
        assert torch.equal(ours.eval()(ids, offsets), ref.eval()(ids, offsets))
    assert (cache.moved_out, cache.moved_in, len(store)) == moved
    assert store.counters["disk_rows"] == len(cache) and store.counters["disk_bytes_written"] > 0
    store.clear()  # (what a load starts with): the rows on disk go too
    assert len(store) == len(cache) == 0


def test_admission_knows_the_ids_on_disk(tmp_path):
    """An id whose row went to disk is a known id: admission never counts it again."""
    disk, dram = tables(tmp_path, 40, admission=AdmissionPolicy("count", min_count=2))
    ours = TableTBE(disk, disk.bucket_range(0, 1), num_features=1, pooling=PoolingMode.SUM)
    ref = TableTBE(dram, dram.bucket_range(0, 1), num_features=1, pooling=PoolingMode.SUM)
    gen = torch.Generator().manual_seed(1)
    for _ in range(12):
        ids = torch.randint(0, 120, (30,), generator=gen) * 2**20
        offsets = torch.arange(31)
        out, want = ours(ids, offsets), ref(ids, offsets)
        assert torch.equal(out, want)
        out.sum().backward()
        want.sum().backward()
    assert len(ours.store.cache) > 0 and ours.store.counters["admitted"] == ref.store.counters["admitted"]


def test_what_a_disk_tier_cannot_do_yet_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="storage with a disk tier takes no eviction policy yet"):
        tables(tmp_path, 10, eviction=EvictionPolicy("lru", max_rows=100))
    with pytest.raises(ValueError, match="storage cache_bytes is set without a path"):
        KVZCHTableParams("t", 16, storage=DiskStorage(cache_bytes=1 << 20))
    with pytest.raises(ValueError, match="storage cache_bytes must be a positive integer"):
        KVZCHTableParams("t", 16, storage=DiskStorage(tmp_path))
    disk, _ = tables(tmp_path, 20)
    tbe = TableTBE(disk, disk.bucket_range(0, 1), num_features=1, pooling=PoolingMode.SUM)
    with pytest.raises(ValueError, match="a batch of 30 distinct ids .* does not fit its DRAM cache of 20 rows"):
        tbe(torch.arange(30) * 2**20, torch.arange(31))
    from torchrec_kvzch.table.snapshot import RowSnapshot
    with pytest.raises(NotImplementedError, match="checkpoints of a table with a disk tier"):
        RowSnapshot(tbe.store)
