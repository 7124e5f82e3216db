"""The disk tier of one table shard: the rows that do not fit its DRAM budget, in a file on local
disk (issue 32; docs/design.md, "The disk tier's storage engine", says why this engine).

A row is in DRAM or here, never both: the row store moves rows here when they leave its cache
(``put``) and back when a batch needs them (``take``). The file holds whole rows of a fixed size
at positions, grouped in units (4 KiB, or the multiple of it one row needs), read and written a
unit at a time with ``O_DIRECT`` (``disk_io.py``: the native op's pool of I/O threads), never
through the page cache. In memory: the id map (id -> entry), each entry's position, which
positions are used, each unit's count of rows and, given ``meta_at`` (a row's header word),
each entry's header word (``meta``), which the tier owns: reads return rows with it, so
checkpoints and eviction read headers without the disk, and lfu's decay never touches the file.
``keep_norms``: each entry's weight norm too (the ``l2`` rule). ``generation`` counts changes.

Placement: rows put go to whole free units (written without a read) or new units at the end
while the file stays within ``SLACK`` times the rows it holds; past that, into the free
positions of partly used units first (read, patched, written back): the file never holds more
than ``SLACK`` times its largest row count, plus a unit. Positions freed while a reader
``hold``-s the tier (a checkpoint's frozen snapshot) are reused once every holder let go.

The directory is the tier's alone: a lock (``flock``) held while open refuses any other opener,
naming the holder; what a previous run left there is discarded on open (the tier caches
training state; checkpoints are its durable copy).
"""

from __future__ import annotations

import fcntl
import gc
import os
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from torchrec_kvzch.table.disk_io import read_units, write_units
from torchrec_kvzch.table.hashing import map_bytes
from torchrec_kvzch.table.id_map import IdMap, as_ids
from torchrec_kvzch.table.native import native_status

PAGE = 4096
HOLE_SCAN = 1 << 16  # units scanned at a time for free positions in them
SLACK = 1.25  # file positions per live row before freed positions in used units are filled
# Requests in flight. This machine's disk reads 41k rows/s at 8, 70k at 32 (bench_disk_engines.py)
# and about 90k at 64 and at 128 (the same, --threads 64 128): more threads stop paying at 64.
IO_THREADS = 64


def units_for(row_bytes: int) -> tuple[int, int]:
    """(bytes of a unit, rows in it): the 4 KiB pages one row needs, holding as many whole rows
    as fit."""
    unit = PAGE * -(-row_bytes // PAGE)
    return unit, unit // row_bytes


def estimated_tier_bytes(rows: int, row_bytes: int) -> tuple[int, int]:
    """(memory, disk) a tier of ``rows`` rows of ``row_bytes`` takes at most: its index (the id
    map, and per row a position, a header word, a weight norm and a used bit), and its file at
    full slack."""
    unit, per_unit = units_for(row_bytes)
    return map_bytes(rows) + rows * 29, -(-int(rows * SLACK) // per_unit) * unit + unit


class DiskTier:
    """``row_bytes``-byte rows of table ``name`` under ``directory``. ``meta_at``: the byte
    offset of a row's int64 header word, kept in memory (None: rows are opaque, ``meta`` is
    what ``put`` gives). ``native``: use the native op for the file's I/O (default: when it is
    built)."""

    def __init__(self, directory: str | os.PathLike, row_bytes: int, name: str, *, meta_at: int | None = None,
                 keep_norms: bool = False, io_threads: int = IO_THREADS, native: bool | None = None) -> None:
        if not isinstance(row_bytes, int) or row_bytes < 1:
            raise ValueError(f"disk tier of table '{name}': row_bytes must be a positive integer, got {row_bytes!r}")
        if meta_at is not None and not 0 <= meta_at <= row_bytes - 8:
            raise ValueError(f"disk tier of table '{name}': meta_at {meta_at} is not within a row of {row_bytes} bytes")
        self.fd = -1
        self.name, self.row_bytes, self.io_threads = name, row_bytes, io_threads
        self.meta_at, self.keep_norms = meta_at, keep_norms
        self.native = native_status() if native is None else native
        self.unit, self.per_unit = units_for(row_bytes)
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = self._take_lock()
        for stale in self.dir.glob("rows*"):  # a previous run's: never trusted
            stale.unlink()
        self.path = self.dir / "rows"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        self.index = IdMap("auto")
        # Per entry of the id map, per position, per unit: buffers with room to grow (the first
        # len(self), units * per_unit and units elements are live).
        self._position = torch.empty(0, dtype=torch.long)
        self._meta = torch.empty(0, dtype=torch.long)
        self._norm = torch.empty(0, dtype=torch.float32)
        self._used = torch.zeros(0, dtype=torch.bool)
        self._unit_rows = torch.zeros(0, dtype=torch.int32)
        self.units = self.generation = 0
        self._free_units = torch.empty(0, dtype=torch.long)  # units with no row, a stack
        self._holders = 0
        self._deferred: list[torch.Tensor] = []  # positions freed while held
        self._reader: ThreadPoolExecutor | None = None  # ``take``'s reads beside other work
        self.bytes_read = self.bytes_written = 0
        self.read_seconds = 0.0  # waited for reads, so far (a benchmark's measure of the disk)

    def _take_lock(self, collected: bool = False):
        lock = open(self.dir / "LOCK", "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            lock.close()
            if not collected and holder == f"pid {os.getpid()} on {socket.gethostname()}":
                gc.collect()  # (a dropped model's tier this process still holds, in a reference cycle)
                return self._take_lock(collected=True)
            raise RuntimeError(f"disk tier of table '{self.name}': {self.dir} is in use by {holder}; two jobs or "
                               "two tables must not share a tier's files: give each its own storage path") from None
        lock.truncate(0)
        lock.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        lock.flush()
        return lock

    # -- sizes ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.index)

    @property
    def position(self) -> torch.Tensor:
        """Each entry's position in the file."""
        return self._position[: len(self)]

    @property
    def meta(self) -> torch.Tensor:
        """Each entry's header word (writable: a decay rewrites it here)."""
        return self._meta[: len(self)]

    @property
    def norm(self) -> torch.Tensor:
        """Each entry's weight norm, as ``put`` gave it (with ``keep_norms``)."""
        return self._norm[: len(self)]

    @property
    def used(self) -> torch.Tensor:
        """Whether each position of the file holds a row (or one a holder may still read)."""
        return self._used[: self.units * self.per_unit]

    @property
    def unit_rows(self) -> torch.Tensor:
        """Each unit's used positions."""
        return self._unit_rows[: self.units]

    @property
    def disk_bytes(self) -> int:
        return self.units * self.unit

    @property
    def nbytes(self) -> int:
        """Memory held: the id map and the per-entry, per-position and per-unit arrays."""
        return self.index.nbytes + sum(t.numel() * t.element_size()
                                       for t in (self._position, self._meta, self._norm, self._used,
                                                 self._unit_rows, self._free_units))

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` rows in the index (written up front) and the per-entry and
        per-position arrays, so that filling the tier to it copies none of them."""
        if rows <= 0:
            return
        self.index.reserve(rows)
        self._position, self._meta = _room(self._position, rows), _room(self._meta, rows)
        if self.keep_norms:
            self._norm = _room(self._norm, rows)
        units = -(-int(rows * SLACK) // self.per_unit) + 1
        self._used, self._unit_rows = _room(self._used, units * self.per_unit), _room(self._unit_rows, units)

    # -- rows in and out ------------------------------------------------------------------------
    def put(self, ids: torch.Tensor, rows: torch.Tensor, meta: torch.Tensor | None = None,
            norms: torch.Tensor | None = None) -> None:
        """Write the rows of ``ids`` (distinct, none already here) to the file. ``meta``: their
        header words, kept in memory (default: read from the rows at ``meta_at``, else zeros);
        ``norms``: their weight norms (needed with ``keep_norms``)."""
        ids = as_ids(ids, torch.device("cpu"))
        n = ids.numel()
        if tuple(rows.shape) != (n, self.row_bytes) or rows.dtype != torch.uint8:
            raise ValueError(f"disk tier of table '{self.name}': {n} ids with rows of {rows.dtype} "
                             f"{list(rows.shape)}; expected uint8 [{n}, {self.row_bytes}]")
        if self.keep_norms and (norms is None or norms.numel() != n):
            raise ValueError(f"disk tier of table '{self.name}': put needs the {n} rows' weight norms (keep_norms)")
        if not n:
            return
        if meta is None and self.meta_at is not None:
            meta = rows[:, self.meta_at:self.meta_at + 8].contiguous().view(torch.long)
        if torch.unique(ids).numel() != n or bool((self.index.find(ids) >= 0).any()):
            raise ValueError(f"disk tier of table '{self.name}': ids put twice, or already on disk; a row is "
                             "in DRAM or on disk, never both")
        positions, taken, new_units = self._place(n)
        units = torch.unique(positions // self.per_unit)
        units = units[units < self.units]
        partial = units[self.unit_rows[units] > 0]
        self._write(positions, rows.contiguous(), partial)
        # Written: the state follows (a failed write above changed none of it).
        self._free_units = self._free_units[: self._free_units.numel() - taken]
        self.units += new_units
        self._unit_rows = _room(self._unit_rows, self.units)
        self._used = _room(self._used, self.units * self.per_unit)
        self.used[positions] = True
        self.unit_rows.index_add_(0, positions // self.per_unit, torch.ones(n, dtype=torch.int32))
        entries = self.index.find_or_insert(ids)
        self._position, self._meta = _room(self._position, len(self)), _room(self._meta, len(self))
        self.position[entries] = positions
        self.meta[entries] = 0 if meta is None else meta.reshape(-1).long()
        if self.keep_norms:
            self._norm = _room(self._norm, len(self))
            self.norm[entries] = norms.reshape(-1).float()
        self.generation += 1

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """Whether each id has a row here."""
        return self.index.find(as_ids(ids, torch.device("cpu"), check=False)) >= 0

    def read(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(which ids have a row here, their rows ``[found, row_bytes]``), changing nothing."""
        entries = self.index.find(as_ids(ids, torch.device("cpu"), check=False))
        found = entries >= 0
        entries = entries[found]
        return found, self._read(self.position[entries], self.meta[entries])

    def take(self, ids: torch.Tensor, during: Callable[[], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``read``, then the rows found leave the tier (a batch brings them into DRAM).
        ``during``: run while the reads are in flight, on a thread of their own (the cache makes
        room meanwhile). It may ``put`` rows here and nothing else: the positions being read
        stay used until the reads are done, so nothing is written over them."""
        ids = as_ids(ids, torch.device("cpu"), check=False)
        entries = self.index.find(ids)
        found = entries >= 0
        entries = entries[found]
        positions, meta = self.position[entries], self.meta[entries]  # (copies: ``during`` may move entries)
        if during is None:
            rows = self._read(positions, meta)
        else:
            if self._reader is None:
                self._reader = ThreadPoolExecutor(1, thread_name_prefix=f"kvzch-disk-{self.name}")
            reading = self._reader.submit(self._fetch, positions)
            try:
                during()
            finally:
                rows = reading.result()  # (waited for even when ``during`` failed: it fills a buffer)
            self._count_read(positions)
            self._patch_meta(rows, meta)
        self._forget(ids[found])
        return found, rows

    def remove(self, ids: torch.Tensor) -> int:
        """Drop the rows of ``ids`` (eviction, deletes); absent ids are ignored. Returns how many."""
        ids = as_ids(ids, torch.device("cpu"), check=False)
        ids = torch.unique(ids[self.index.find(ids) >= 0])
        self._forget(ids)
        return ids.numel()

    def positions(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's position in the file, -1 where it has no row here (with ``hold``, a reader
        can read them later with ``read_at`` whatever moves meanwhile)."""
        entries = self.index.find(as_ids(ids, torch.device("cpu"), check=False))
        return torch.where(entries >= 0, self.position[entries.clamp(min=0)], -1)

    def read_at(self, positions: torch.Tensor, meta: torch.Tensor | None = None) -> torch.Tensor:
        """The rows at ``positions`` (from ``positions``), ``[n, row_bytes]``, with header words
        ``meta`` (the reader's: the tier's may have changed since it took the positions)."""
        return self._read(positions.reshape(-1).long(), meta)

    def keys(self) -> torch.Tensor:
        """The ids with a row here (a view: copy it before changing the tier)."""
        return self.index.keys()

    # -- readers that need positions to stay --------------------------------------------------
    def hold(self) -> None:
        """Until the matching ``release``, no freed position is reused."""
        self._holders += 1

    def release(self) -> None:
        self._holders -= 1
        if not self._holders and self._deferred:
            freed, self._deferred = torch.cat(self._deferred), []
            self._free(freed)

    def close(self, wait: bool = True) -> None:
        """Close and delete the file (its rows are gone), and let the directory go. ``wait``: for
        the reader thread to end (no read is in flight once ``take`` has returned)."""
        if self._reader is not None:
            self._reader.shutdown(wait=wait)
            self._reader = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            self.path.unlink(missing_ok=True)
            self._lock.close()

    def __del__(self) -> None:
        # No join: the collector may run this in any thread, even one holding threading's own
        # locks (a thread starting up), which a join takes.
        try:
            self.close(wait=False)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # -- internals ------------------------------------------------------------------------------
    def _place(self, n: int) -> tuple[torch.Tensor, int, int]:
        """Ascending positions for ``n`` rows: (positions, free units taken from the stack's top,
        new units at the file's end). Nothing changes until the caller commits."""
        out = []
        if self.units * self.per_unit + n > SLACK * (len(self) + n):
            holes = self._holes(n)
            out.append(holes)
            n -= holes.numel()
        taken = min(self._free_units.numel(), -(-n // self.per_unit))
        if taken:
            units = torch.sort(self._free_units[self._free_units.numel() - taken:]).values  # (runs, where adjacent)
            out.append((units[:, None] * self.per_unit + torch.arange(self.per_unit)).view(-1)[:n])
            n -= out[-1].numel()
        new_units = -(-n // self.per_unit)
        if new_units:
            out.append(torch.arange(self.units * self.per_unit, self.units * self.per_unit + n))
        return torch.cat(out) if out else torch.empty(0, dtype=torch.long), taken, new_units

    def _holes(self, n: int) -> torch.Tensor:
        """Up to ``n`` free positions in units that hold rows, ascending. Found unit by unit
        (``unit_rows`` counts each unit's used positions), ``HOLE_SCAN`` units at a time: masks
        over every position, or even every unit, would be temporaries of many MiB outside the
        cache budget, for a piece's few thousand units."""
        out, found = [], 0
        for start in range(0, self.units, HOLE_SCAN):
            rows = self.unit_rows[start:start + HOLE_SCAN]
            units = start + torch.nonzero((rows > 0) & (rows < self.per_unit)).view(-1)
            if not units.numel():
                continue
            free = (self.per_unit - self.unit_rows[units]).cumsum(0)
            units = units[: int(torch.searchsorted(free, n - found)) + 1]  # the first with n - found free
            positions = (units[:, None] * self.per_unit + torch.arange(self.per_unit)).view(-1)
            out.append(positions[~self.used[positions]][: n - found])
            found += out[-1].numel()
            if found == n:
                break
        return torch.cat(out) if out else torch.empty(0, dtype=torch.long)

    def _forget(self, ids: torch.Tensor) -> None:
        """``ids`` (here) leave the index; their positions are freed (or deferred)."""
        ids = torch.unique(ids)
        if not ids.numel():
            return
        positions = self.position[self.index.find(ids)]
        moves = self.index.erase(ids)
        for per_entry in (self._position, self._meta) + ((self._norm,) if self.keep_norms else ()):
            per_entry[moves.dst] = per_entry[moves.src]
        self.generation += 1
        if self._holders:
            self._deferred.append(positions)
        else:
            self._free(positions)

    def _free(self, positions: torch.Tensor) -> None:
        self.used[positions] = False
        units = positions // self.per_unit
        self.unit_rows.index_add_(0, units, torch.full_like(units, -1, dtype=torch.int32))
        units = torch.unique(units)
        self._free_units = torch.cat([self._free_units, units[self.unit_rows[units] == 0]])

    def _read(self, positions: torch.Tensor, meta: torch.Tensor | None = None) -> torch.Tensor:
        out = self._fetch(positions)
        self._count_read(positions)
        self._patch_meta(out, meta)
        return out

    def _fetch(self, positions: torch.Tensor) -> torch.Tensor:
        """The file's bytes at ``positions`` (touches no state: ``take`` runs it on its reader)."""
        out = torch.empty(positions.numel(), self.row_bytes, dtype=torch.uint8)
        if positions.numel():
            start = time.perf_counter()
            read_units(self.fd, positions, out, self.unit, self.io_threads, self.native)
            self.read_seconds += time.perf_counter() - start  # (only here: no other thread adds)
        return out

    def _count_read(self, positions: torch.Tensor) -> None:
        self.bytes_read += torch.unique(positions // self.per_unit).numel() * self.unit

    def _patch_meta(self, rows: torch.Tensor, meta: torch.Tensor | None) -> None:
        if meta is not None and self.meta_at is not None and rows.numel():
            rows[:, self.meta_at:self.meta_at + 8] = meta.reshape(-1, 1).long().view(torch.uint8)

    def _write(self, positions: torch.Tensor, rows: torch.Tensor, partial: torch.Tensor) -> None:
        read, written = write_units(self.fd, positions, rows, partial, self.unit, self.io_threads, self.native)
        self.bytes_read, self.bytes_written = self.bytes_read + read, self.bytes_written + written


def _room(buffer: torch.Tensor, n: int) -> torch.Tensor:
    """``buffer`` with room for ``n`` elements (grown by doubling, new elements zero)."""
    if buffer.numel() >= n:
        return buffer
    out = torch.zeros(max(n, 2 * buffer.numel(), 1024), dtype=buffer.dtype)
    out[: buffer.numel()] = buffer
    return out
