"""The KV tensor: chunked reads, writes by id and by header, read-only views, fbgemm's PMT."""

import logging

import pytest
import torch
from fbgemm_gpu.tbe.ssd.utils.partially_materialized_tensor import PartiallyMaterializedTensor
from hypothesis import given, strategies as st

from torchrec_kvzch import KVTensor, KVZCHTableParams, RowPart, RowStore


def store_with(ids, dim=4):
    p = KVZCHTableParams("kv", dim, num_embeddings=2**40, total_num_buckets=64,
                         enable_optimizer_offloading=True, backend_return_whole_row=True)
    store = RowStore(p)
    slots = store.find_or_insert(ids)
    store.optimizer[slots] = ids.float()[:, None]
    return store


def bits(rows):
    return rows.view(torch.int32)


def test_shape_offsets_and_bucket_sorted_ids():
    store = store_with(torch.tensor([50, 7, 2**38]))
    weight, opt, row = (KVTensor(store, part) for part in (RowPart.WEIGHT, RowPart.OPTIMIZER, RowPart.ROW))
    assert row.shape == [3, 12] and row.width_offset == 0
    assert weight.shape == [3, 4] and weight.width_offset == 4
    assert opt.shape == [3, 1] and opt.width_offset == 8
    assert row.ids.tolist() == [7, 50, 2**38]
    header = row.narrow(0, 0, 3)[:, :4].contiguous().view(torch.long)
    assert header[:, 0].tolist() == [7, 50, 2**38]
    assert opt.full_tensor().squeeze(1).tolist() == [7.0, 50.0, float(2**38)]


@given(n=st.integers(1, 300), chunk=st.integers(1, 64))
def test_narrow_chunks_concatenate_to_the_full_view(n, chunk):
    store = store_with(torch.randint(0, 2**40, (n,)).unique())
    kv = KVTensor(store, RowPart.ROW)
    chunks = [kv.narrow(0, s, min(chunk, kv.shape[0] - s)) for s in range(0, kv.shape[0], chunk)]
    assert torch.equal(bits(torch.cat(chunks)), bits(kv.full_tensor()))


def test_snapshot_is_stable_and_deleted_rows_are_skipped_on_load():
    store = store_with(torch.arange(10))
    kv = KVTensor(store, RowPart.ROW)
    store.delete(torch.tensor([3]))
    rows = kv.full_tensor()  # still 10 rows: id 3 reads as unused
    fresh = RowStore(store.params)
    KVTensor(fresh, RowPart.ROW, ids=torch.empty(0, dtype=torch.long)).set_weights_and_ids(rows, kv.ids)
    assert sorted(fresh.keys().tolist()) == [0, 1, 2, 4, 5, 6, 7, 8, 9]


def test_writes_by_range_and_by_ids():
    """set_range as fbgemm's KVTensorWrapper: the rows of ids [start, start + length)."""
    store = store_with(torch.tensor([1, 2, 3]))
    kv = KVTensor(store, RowPart.WEIGHT)
    kv.set_range(0, 2, 2, torch.full((2, 4), 9.0))  # ids 2 and 3, not positions 2 and 3
    assert kv.get_weights_by_ids(torch.tensor([2, 3, 1]))[:2].eq(9.0).all()
    assert not kv.get_weights_by_ids(torch.tensor([1])).eq(9.0).any()
    kv.set_weights_and_ids(torch.ones(1, 4), torch.tensor([77]))  # creates row 77
    assert store.read_ids(torch.tensor([77])).eq(1.0).all()
    with pytest.raises(ValueError, match="only dim 0"):
        kv.narrow(1, 0, 1)
    with pytest.raises(ValueError, match="dim 0 only"):
        kv.set_range(1, 0, 1, torch.ones(1, 4))
    with pytest.raises(ValueError, match=r"kv': weight values must be \[4, 4\]"):
        kv.set_range(0, 2, 4, torch.ones(3, 4))


@pytest.mark.parametrize("part", list(RowPart))
def test_read_only_view_changes_nothing(part, caplog):
    store = store_with(torch.arange(20))
    def live():
        n = len(store)
        return (store.weights[:n], store.optimizer[:n], store.meta[:n], store.keys())

    before = [t.clone() for t in live()]
    kv = KVTensor(store, part, read_only=True)
    rows = kv.full_tensor()
    with caplog.at_level(logging.INFO, logger="torchrec_kvzch.table.kv_tensor"):
        kv.set_range(0, 0, 20, torch.zeros_like(rows))
        kv.set_weights_and_ids(torch.zeros_like(rows), torch.arange(100, 120))
    assert len(store) == 20 and all(torch.equal(a, b) for a, b in zip(before, live()))
    assert sum("read-only" in r.message for r in caplog.records) == 1  # logged once


def test_works_inside_fbgemm_partially_materialized_tensor():
    store = store_with(torch.tensor([5, 6, 7]))
    kv = KVTensor(store, RowPart.ROW)
    pmt = PartiallyMaterializedTensor(kv, is_virtual=True)
    assert pmt.shape == torch.Size([3, 12]) and pmt.dtype == torch.float32
    assert pmt.device == torch.device("cpu") and pmt.layout == torch.strided and pmt.is_virtual
    assert torch.equal(bits(pmt.narrow(0, 1, 2)), bits(kv.narrow(0, 1, 2)))
    assert torch.equal(bits(pmt.full_tensor()), bits(kv.full_tensor()))
    assert torch.equal(bits(pmt.get_weights_by_ids(torch.tensor([7]))), bits(kv.narrow(0, 2, 1)))
    fresh = RowStore(store.params)
    PartiallyMaterializedTensor(KVTensor(fresh, RowPart.ROW)).set_weights_and_ids(
        pmt.full_tensor(), torch.tensor([5, 6, 7]))
    assert torch.equal(bits(fresh.read_ids(torch.tensor([5, 6, 7]), RowPart.ROW)), bits(pmt.full_tensor()))
    assert pmt.get_kvtensor_serializable_metadata()[:2] == ["kv", "row"]
