"""The disk tier's row file (issue 32): after any sequence of puts, takes (with puts while their
reads are in flight), removes and holds, every id reads the row it was last put with, the file stays within its slack, positions a holder may
read are never overwritten, the native op and its twin write the same file; the directory is
one opener's, and what a killed run left there is discarded."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings, strategies as st

from torchrec_kvzch.table import disk_tier
from torchrec_kvzch.table.disk_tier import SLACK, DiskTier
from torchrec_kvzch.table.native import native_status

ROW = 532  # 128 fp32, a rowwise Adagrad state and the header: 7 rows a unit
OPS = st.lists(st.tuples(st.sampled_from(["put", "take", "take_put", "remove", "hold", "release"]),
                         st.lists(st.integers(0, 120), min_size=1, max_size=40, unique=True)),
               min_size=1, max_size=25)


def rows_of(ids: list[int], version: int) -> torch.Tensor:
    """Distinct bytes per (id, version): a row read back names its id and when it was put."""
    gen = torch.Generator().manual_seed(version)
    base = torch.randint(0, 256, (len(ids), ROW), dtype=torch.uint8, generator=gen)
    base[:, :8] = torch.tensor(ids, dtype=torch.long)[:, None].view(torch.uint8).view(len(ids), 8) if ids else base[:, :8]
    return base


@settings(max_examples=40, deadline=None)
@given(ops=OPS, row=st.sampled_from([ROW, 100, 4100]))
def test_after_any_sequence_every_id_reads_its_last_row_and_the_file_stays_within_its_slack(tmp_path_factory, ops, row):
    global ROW
    saved, ROW = ROW, row
    try:
        tiers = [DiskTier(tmp_path_factory.mktemp("tier"), row, "t", native=native)
                 for native in ([True, False] if native_status() else [False])]
        truth: dict[int, torch.Tensor] = {}
        held: list[tuple[list, torch.Tensor]] = []  # (positions per tier, rows) a holder may still read
        peak = 0
        for version, (op, ids) in enumerate(ops):
            if op == "put":
                ids = [i for i in ids if i not in truth]
                if not ids:
                    continue
                rows = rows_of(ids, version)
                for t in tiers:
                    t.put(torch.tensor(ids), rows)
                truth.update(zip(ids, rows))
            elif op == "take_put":  # a take whose ids' reads are in flight while the absent ids are put
                query = torch.tensor([i for i in ids if i in truth] or [ids[0]])
                new = [i for i in ids if i not in truth and i != int(query[0])]
                rows = rows_of(new, version)
                for t in tiers:
                    found, taken = t.take(query, during=lambda t=t: t.put(torch.tensor(new, dtype=torch.long), rows))
                    assert found.tolist() == [i in truth for i in query.tolist()]
                    assert all(torch.equal(r, truth[i]) for i, r in zip(query[found].tolist(), taken))
                peak = max(peak, len(truth) + len(new))  # (the rows taken leave after the put)
                for i in query.tolist():
                    truth.pop(i, None)
                truth.update(zip(new, rows))
            elif op in ("take", "remove"):
                query = torch.tensor(ids)
                for t in tiers:
                    if op == "take":
                        found, rows = t.take(query)
                        assert found.tolist() == [i in truth for i in ids]
                        assert all(torch.equal(r, truth[i]) for i, r in zip(query[found].tolist(), rows))
                    else:
                        assert t.remove(query) == len(truth.keys() & set(ids))
                for i in ids:
                    truth.pop(i, None)
            elif op == "hold":
                present = [i for i in ids if i in truth]
                for t in tiers:
                    t.hold()
                if present:
                    held.append(([t.positions(torch.tensor(present)) for t in tiers],
                                 torch.stack([truth[i] for i in present])))
            elif tiers[0]._holders:  # release
                for t in tiers:
                    t.release()
                if not tiers[0]._holders:
                    held.clear()
            peak = max(peak, len(truth) + sum(len(d) for d in tiers[0]._deferred))
            for positions, rows in held:  # what a holder reads has not moved
                assert all(torch.equal(t.read_at(p), rows) for t, p in zip(tiers, positions))
        for t in tiers:
            assert len(t) == len(truth)
            assert t.units * t.per_unit <= SLACK * peak + t.per_unit
            query = torch.arange(0, 121)
            found, rows = t.read(query)
            assert found.tolist() == [i in truth for i in range(121)]
            assert all(torch.equal(r, truth[i]) for i, r in zip(query[found].tolist(), rows))
        if len(tiers) == 2:  # the native op and the twin: the same bytes moved
            assert (tiers[0].bytes_read, tiers[0].bytes_written) == (tiers[1].bytes_read, tiers[1].bytes_written)
        for t in tiers:
            t.close()
    finally:
        ROW = saved


@pytest.mark.parametrize("scan", [disk_tier.HOLE_SCAN, 2])
def test_freed_units_are_reused_whole_and_partial_units_are_read_before_they_are_patched(tmp_path, monkeypatch, scan):
    monkeypatch.setattr(disk_tier, "HOLE_SCAN", scan)  # (2: the holes are found over several scans)
    t = DiskTier(tmp_path, ROW, "t")
    per = t.per_unit
    ids = torch.arange(10 * per)
    t.put(ids, rows_of(ids.tolist(), 0))
    assert (t.units, t.bytes_read, t.bytes_written) == (10, 0, 10 * t.unit)  # new units: no read
    t.take(ids[: 3 * per])  # three whole units free (read once, to take their rows)
    before = t.bytes_read
    t.put(torch.arange(1000, 1000 + 3 * per), rows_of(list(range(1000, 1000 + 3 * per)), 1))
    assert (t.units, t.bytes_read) == (10, before)  # the freed units, written whole: no read
    t.take(torch.cat([ids[u * per:u * per + 3] for u in range(3, 10)]))  # holes: the file past its slack
    assert t.units * per + 3 > SLACK * (len(t) + 3)
    before = t.bytes_read
    t.put(torch.arange(2000, 2010), rows_of(list(range(2000, 2010)), 2))
    assert t.units == 10 and t.bytes_read > before  # into holes: read, patched, written back
    assert int(t.used.sum()) == int(t.unit_rows.sum()) == len(t)
    found, rows = t.read(torch.arange(0, 3000))
    assert int(found.sum()) == len(t) == 10 * per - 21 + 10
    assert torch.equal(rows[-10:], rows_of(list(range(2000, 2010)), 2))


def test_a_take_whose_work_meanwhile_fails_takes_nothing(tmp_path):
    t = DiskTier(tmp_path, ROW, "t")
    t.put(torch.tensor([1, 2]), rows_of([1, 2], 0))

    def fail():
        raise RuntimeError("room could not be made")
    with pytest.raises(RuntimeError, match="room could not be made"):
        t.take(torch.tensor([1]), during=fail)
    assert len(t) == 2 and torch.equal(t.read(torch.tensor([1, 2]))[1], rows_of([1, 2], 0))
    t.close()


def test_bad_input_names_the_table_and_changes_nothing(tmp_path):
    t = DiskTier(tmp_path, ROW, "user")
    t.put(torch.tensor([1, 2]), rows_of([1, 2], 0))
    for ids, rows, match in [
        (torch.tensor([3]), torch.zeros(1, ROW - 1, dtype=torch.uint8), r"disk tier of table 'user': 1 ids with rows"),
        (torch.tensor([3]), torch.zeros(1, ROW), r"expected uint8 \[1, 532\]"),
        (torch.tensor([2]), rows_of([2], 1), "already on disk"),
        (torch.tensor([4, 4]), rows_of([4, 4], 1), "ids put twice"),
    ]:
        with pytest.raises(ValueError, match=match):
            t.put(ids, rows)
    assert len(t) == 2 and t.units == 1
    assert torch.equal(t.read(torch.tensor([1, 2]))[1], rows_of([1, 2], 0))


def test_a_directory_is_one_openers_and_a_killed_runs_files_are_discarded(tmp_path):
    t = DiskTier(tmp_path, ROW, "user")
    with pytest.raises(RuntimeError, match=rf"disk tier of table 'other': {tmp_path} is in use by pid {os.getpid()}"):
        DiskTier(tmp_path, ROW, "other")
    t.close()
    assert not (tmp_path / "rows").exists()  # a closed tier's rows are gone
    script = textwrap.dedent(f"""
        import os, sys, torch
        from torchrec_kvzch.table.disk_tier import DiskTier
        t = DiskTier({str(tmp_path)!r}, {ROW}, "user")
        t.put(torch.arange(100), torch.full((100, {ROW}), 7, dtype=torch.uint8))
        print("ready", flush=True)
        sys.stdin.read()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    with pytest.raises(RuntimeError, match="is in use by pid"):
        DiskTier(tmp_path, ROW, "user")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert (tmp_path / "rows").stat().st_size > 0  # what the killed run left
    fresh = DiskTier(tmp_path, ROW, "user")  # its lock died with it: taken, the file discarded
    assert len(fresh) == 0 and (tmp_path / "rows").stat().st_size == 0
    assert not fresh.read(torch.arange(100))[0].any()
    fresh.close()


def test_an_io_error_is_an_exception_and_a_dropped_tier_in_a_cycle_lets_its_directory_go(tmp_path):
    """A failed read or write inside the native op's threads reaches Python as an error (it
    used to abort the process); a tier only a reference cycle holds is collected when its
    directory is opened again by this process."""
    t = DiskTier(tmp_path / "a", ROW, "user")
    t.put(torch.arange(20), rows_of(list(range(20)), 0))
    os.truncate(t.path, 0)
    with pytest.raises(RuntimeError, match="disk tier: reading .* failed: end of file"):
        t.read(torch.arange(20))
    t.close()
    cycle = [DiskTier(tmp_path / "b", ROW, "user")]
    cycle.append(cycle)
    del cycle
    DiskTier(tmp_path / "b", ROW, "user").close()


def test_a_tier_the_collector_finalises_does_not_wait_for_its_reader_thread(tmp_path):
    """The garbage collector may finalise a tier inside any allocation, as in a thread starting up
    while it holds threading's shutdown lock; a join of the tier's reader thread then takes that
    lock again and hangs for ever (the suite once hung so, in test_disk_cache). Finalising lets
    the reader go without a join; the file and the directory's lock are let go as by ``close``."""
    script = textwrap.dedent(f"""
        import threading, torch
        from torchrec_kvzch.table.disk_tier import DiskTier
        t = DiskTier({str(tmp_path)!r}, {ROW}, "t")
        t.take(torch.tensor([1]), during=lambda: None)  # (its reader thread starts)
        with threading._shutdown_locks_lock:  # held, as by a thread starting when the collector runs
            t.__del__()
        print(t.fd, flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "-1", done.stderr[-2000:]
    assert not (tmp_path / "rows").exists()
    DiskTier(tmp_path, ROW, "t").close()  # (the directory's lock was let go)
