"""The checkpoint's native row copies (``csrc/checkpoint_ops.cpp``) against their torch twins,
and saved items read straight from DCP's files against DCP's own reader; the pool of chunk
buffers a save copies rows into."""

import io
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings, strategies as st
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from torchrec_kvzch import KVZCHTableParams, RowStore
from torchrec_kvzch.checkpoint.files import SavedFiles
from torchrec_kvzch.checkpoint.integrity import ALGORITHMS, checksum, read_saved
from torchrec_kvzch.table.layout import RowPart, make_meta


def bits(rows: torch.Tensor) -> torch.Tensor:
    """Rows as integers: header bytes read as floats can be NaN, which never equals itself."""
    return rows.view(torch.int32 if rows.element_size() == 4 else torch.int16)


def params(dim, optimizer, dtype):
    return KVZCHTableParams("tbl", dim, num_embeddings=2**40, total_num_buckets=256,
                            optimizer=optimizer, weight_dtype=dtype)


def whole_rows(store, n, gen, used_every=0):
    """``n`` whole rows of distinct ids in the store's layout, with random weights, optimizer
    state and header words (every ``used_every``-th row unused, when > 0)."""
    layout = store.layout
    ids = torch.randperm(10 * n + 10, generator=gen)[:n] * 7 + 3
    meta = make_meta(torch.randint(0, 2**31, (n,), generator=gen), torch.randint(0, 2**20, (n,), generator=gen))
    if used_every:
        meta[::used_every] &= (1 << 63) - 1  # used bit (the sign bit) off
    weights = torch.randn(n, layout.embedding_dim, generator=gen).to(layout.dtype)
    optimizer = torch.rand(n, layout.optimizer_floats, generator=gen)
    return layout.pack(ids, meta, weights, optimizer)


OPTIMIZERS = ["exact_rowwise_adagrad", "exact_sgd"]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@settings(deadline=None)
@given(n=st.integers(0, 300), dim=st.integers(1, 19), seed=st.integers(0, 99), unused=st.sampled_from([0, 3]))
def test_native_row_scatter_matches_the_torch_twin(optimizer, dtype, n, dim, seed, unused):
    """Whole rows written by their header ids (``write_rows``): the native scatter and the torch
    path leave the same weights, optimizer state and header words, rows marked unused skipped;
    rows written again over existing ones replace them."""
    p = params(dim, optimizer, dtype)
    gen = torch.Generator().manual_seed(seed)
    native, twin = RowStore(p, backend="native"), RowStore(p, backend="torch")
    assert native.native and not twin.native
    layout = native.layout
    rows = whole_rows(native, n, gen, unused)
    newer = rows[: n // 2].clone()  # same headers, new weights and optimizer state
    newer[:, layout.header_width:] = whole_rows(native, n // 2, gen)[:, layout.header_width:]
    for store in (native, twin):
        assert store.write_rows(rows) == n - (len(range(0, n, unused)) if unused else 0)
        store.write_rows(newer)
    ids = torch.sort(native.keys()).values
    assert torch.equal(ids, torch.sort(twin.keys()).values)
    for part in (RowPart.ROW, RowPart.WEIGHT, RowPart.OPTIMIZER, RowPart.META):
        assert same(native.read_ids(ids, part), twin.read_ids(ids, part)), part


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(bits(a), bits(b)) if a.is_floating_point() else torch.equal(a, b)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@settings(deadline=None)
@given(n=st.integers(1, 300), dim=st.integers(1, 19), seed=st.integers(0, 99))
def test_native_row_gather_into_a_buffer_matches_the_torch_pack(optimizer, dtype, n, dim, seed):
    """Rows read into a caller's buffer (a save's chunk): the same bits as a fresh read and as
    the torch twin's pack, whatever the buffer held before."""
    p = params(dim, optimizer, dtype)
    gen = torch.Generator().manual_seed(seed)
    store = RowStore(p, backend="native")
    store.write_rows(whole_rows(store, n, gen))
    slots = torch.randint(0, len(store), (2 * n,), generator=gen)  # repeats, any order
    want = store.layout.pack(store.keys()[slots], store.meta[slots], store.weights[slots],
                             store.optimizer[slots])
    for part in RowPart:
        fresh = store.read(slots, part)
        out = torch.full_like(fresh, 7)  # stale contents, padding included, must not survive
        assert store.read(slots, part, out=out) is out
        assert same(out, fresh), part
    out = torch.full_like(want, 7)
    store.read(slots, RowPart.ROW, out=out)
    assert torch.equal(bits(out), bits(want))


def test_scatter_refuses_slots_outside_the_arrays():
    p = params(4, "exact_rowwise_adagrad", "fp32")
    store = RowStore(p, backend="native")
    rows = whole_rows(store, 3, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="outside"):
        torch.ops.kvzch.scatter_rows(store.weights, store.optimizer, store.meta, rows,
                                     torch.tensor([0, 1, store.capacity]), store.layout.optimizer_offset)


def save_items(path, tensors):
    dcp.save(tensors, storage_writer=FileSystemWriter(path), no_dist=True)
    return FileSystemReader(path).read_metadata()


def test_saved_files_read_the_values_dcp_reads(tmp_path):
    """Contiguous tensors are read straight from the file, whole or from a row on, and
    checksummed from the file alike; strided ones and pickled objects are left to DCP's reader."""
    gen = torch.Generator().manual_seed(0)
    tensors = {"rows": torch.randn(50, 7, generator=gen), "ids": torch.arange(30).unsqueeze(1),
               "half": torch.randn(9, 4, generator=gen).half(), "scalar": torch.tensor(3.5),
               "transposed": torch.randn(6, 5, generator=gen).t(), "sliced": torch.arange(100)[10:20],
               "object": {"a": 1}}
    path = str(tmp_path / "ckpt")
    metadata = save_items(path, tensors)
    files = SavedFiles(path, metadata)
    readable = set()
    for index in metadata.storage_data:
        span = files.span(index)
        if span is None:
            continue
        readable.add(index.fqn)
        want = read_saved(path, metadata, index)
        assert torch.equal(files.read_rows(span, 0, torch.empty_like(want)), want)
        for algorithm, update in ALGORITHMS.items():
            assert files.checksum(span, update) == checksum(want, algorithm)
        if want.dim() and want.shape[0] > 3:
            assert torch.equal(files.read_rows(span, 2, torch.empty_like(want[2:])), want[2:])
    # A slice is saved as a copy of its own (contiguous): DCP clones views of larger storages.
    assert readable == {"rows", "ids", "half", "scalar", "sliced"}
    files.close()


def test_saved_files_refuse_a_damaged_zip(tmp_path):
    path = str(tmp_path / "ckpt")
    metadata = save_items(path, {"rows": torch.randn(50, 7)})
    (index, info), = [(i, s) for i, s in metadata.storage_data.items() if i.fqn == "rows"]
    target = os.path.join(path, info.relative_path)
    with open(target, "r+b") as f:  # the zip's end-of-directory record: its last 22 bytes
        f.seek(info.offset + info.length - 22)
        f.write(b"\0" * 22)
    with pytest.raises(ValueError, match="zip structure"):
        SavedFiles(path, metadata).span(index)


def test_checksum_of_bytes_and_tensors_by_algorithm():
    data = torch.arange(1000, dtype=torch.int32)
    raw = io.BytesIO(data.numpy().tobytes())
    for algorithm in ("crc32c", "crc32"):
        assert checksum(data, algorithm) == checksum(raw, algorithm)
    assert checksum(data, "crc32c") != checksum(data, "crc32")


def test_a_records_size_is_read_from_the_zip_where_the_reader_cannot_tell_it(tmp_path):
    """torch 2.11's zip reader has no ``get_record_size``: the item's zip directory gives the
    size instead, for an item stored at an offset inside a larger file, as DCP stores them."""
    import io

    from torch.distributed.checkpoint.utils import _create_file_view

    from torchrec_kvzch.checkpoint.files import _record_size

    saved = io.BytesIO()
    torch.save(torch.arange(1000, dtype=torch.float32), saved)
    path = tmp_path / "items.distcp"
    path.write_bytes(b"x" * 123 + saved.getvalue() + b"y" * 77)
    with open(path, "rb") as f:
        view = _create_file_view(f, 123, len(saved.getvalue()))
        archive = torch._C.PyTorchFileReader(view)
        [record] = [r for r in archive.get_all_records() if r.startswith("data/")]

        class OlderReader:  # no get_record_size
            pass

        assert _record_size(OlderReader(), view, record) == 4000
        if hasattr(archive, "get_record_size"):  # torch >= 2.13 tells it itself
            assert _record_size(archive, view, record) == archive.get_record_size(record) == 4000


def test_a_chunk_buffer_given_back_inside_the_pools_lock_does_not_hang():
    """A lease's finalizer gives its buffer back wherever its last reference goes or the collector
    runs, which can be in a thread inside the pool's lock already (taking or giving back another)."""
    import threading

    from torchrec_kvzch.checkpoint.buffers import ChunkBuffers

    pool = ChunkBuffers(native=False)
    lent = pool.take((16,), torch.float32)

    def nested():
        with pool._lock:
            del lent_holder[0]  # (the last reference: the lease's finalizer runs here)

    lent_holder = [lent]
    del lent
    thread = threading.Thread(target=nested, daemon=True)  # (a hang stays in it, and fails below)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    assert [len(v) for v in pool._free.values()] == [1]  # (given back)
