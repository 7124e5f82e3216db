"""``KVZCHFileSystemWriter``: the files DCP's own writer would write, handed to the disk in
segments as they are written."""

import io
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings, strategies as st
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from torchrec_kvzch.checkpoint import writer
from torchrec_kvzch.checkpoint.writer import KVZCHFileSystemWriter

linux_only = pytest.mark.skipif(writer._sync_range is None, reason="no sync_file_range here")


def data_files(path) -> dict[str, bytes]:
    return {name: open(os.path.join(path, name), "rb").read()
            for name in sorted(os.listdir(path)) if name.endswith(".distcp")}


def save_both(tmp_path_factory, sizes, threads, seed):
    """The same state saved by our writer and by DCP's; ours loads back to it."""
    gen = torch.Generator().manual_seed(seed)
    state = {f"t{i}": torch.randn(n, generator=gen) for i, n in enumerate(sizes)}
    state["object"] = {"step": seed}
    ours, stock = (str(tmp_path_factory.mktemp(name)) for name in ("ours", "stock"))
    dcp.save(state, storage_writer=KVZCHFileSystemWriter(ours, thread_count=threads), no_dist=True)
    dcp.save(state, storage_writer=FileSystemWriter(stock, thread_count=threads), no_dist=True)
    back = {k: torch.zeros_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
    dcp.load(back, storage_reader=FileSystemReader(ours), no_dist=True)
    assert all(torch.equal(v, state[k]) for k, v in back.items())
    return ours, stock


@linux_only
@settings(deadline=None, max_examples=25)
@given(sizes=st.lists(st.integers(0, 40_000), min_size=1, max_size=6), threads=st.integers(1, 3),
       segment=st.sampled_from([4096, 5000, 65536]), seed=st.integers(0, 99))
def test_files_are_dcps_and_go_to_disk_segment_by_segment(tmp_path_factory, sizes, threads, segment, seed):
    """Byte for byte the files of DCP's writer, whatever the items' sizes against the segment;
    each full segment of a file is handed to the disk once, in order, and waited for _LAG
    segments later."""
    calls, real = [], writer._sync_range
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(writer, "_SEGMENT", segment)
        mp.setattr(writer, "_sync_range", lambda fd, start, n, flags: calls.append((start, n, flags))
                   or real(fd, start, n, flags))
        ours, stock = save_both(tmp_path_factory, sizes, threads, seed)
    files = data_files(ours)
    assert files == data_files(stock)
    assert all(n == segment for _, n, _ in calls)
    # Per file: writes of segments 0, 1, ...; waits of segment k - _LAG after the write of k.
    full = sorted(len(b) // segment for b in files.values())
    writes = sorted(start for start, _, flags in calls if flags == writer._WRITE)
    waits = sorted(start for start, _, flags in calls if flags == writer._WAIT)
    assert writes == sorted(k * segment for n in full for k in range(n))
    assert waits == sorted(k * segment for n in full for k in range(n - writer._LAG))


def test_without_fsync_or_sync_file_range_it_is_dcps_writer(tmp_path, monkeypatch):
    """No durability asked for, or no sync_file_range on the platform: DCP's own file system."""
    assert type(KVZCHFileSystemWriter(tmp_path, sync_files=False).fs) is FileSystem
    monkeypatch.setattr(writer, "_sync_range", None)
    assert type(KVZCHFileSystemWriter(tmp_path).fs) is FileSystem


@linux_only
def test_a_large_write_is_handed_over_as_it_goes(tmp_path, monkeypatch):
    """One write of many segments (a big tensor's storage) hands each one to the disk in turn,
    not all after the write; a seek is refused rather than mis-tracked."""
    monkeypatch.setattr(writer, "_SEGMENT", 4096)
    written_when_handed = []
    monkeypatch.setattr(writer, "_sync_range",
                        lambda fd, start, n, flags: written_when_handed.append(os.fstat(fd).st_size))
    path = tmp_path / "f"
    with writer._WritebackFileSystem().create_stream(path, "wb") as stream:
        stream.write(b"x" * (5 * 4096 + 7))
        with pytest.raises(io.UnsupportedOperation):
            stream.raw.seek(0)
    assert path.read_bytes() == b"x" * (5 * 4096 + 7)
    sizes = sorted(set(written_when_handed))
    assert sizes == [4096 * k for k in range(1, 6)]
