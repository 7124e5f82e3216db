"""The disk tier's file I/O: whole units at positions, with ``O_DIRECT`` (``disk_tier.py``).

The native op (``csrc/disk_ops.cpp``) moves runs of units on a pool of threads, one request in
flight per thread; its Python twin, a unit at a time through one aligned buffer, stands in where
the op is not built.
"""

from __future__ import annotations

import mmap
import os

import torch


def read_units(fd: int, positions: torch.Tensor, out: torch.Tensor, unit: int, threads: int, native: bool) -> None:
    """The rows at ``positions`` (any order) into ``out`` ``[n, row_bytes]``."""
    if native:
        torch.ops.kvzch.disk_read(fd, positions.contiguous(), out, unit, threads)
    else:
        _read_twin(fd, positions, out, unit)


def write_units(fd: int, positions: torch.Tensor, rows: torch.Tensor, partial: torch.Tensor, unit: int,
                threads: int, native: bool) -> tuple[int, int]:
    """``rows`` to ``positions`` (distinct); the units in ``partial`` hold other rows and are read
    first, the others written whole. Returns (bytes read, bytes written)."""
    if native:
        return torch.ops.kvzch.disk_write(fd, positions.contiguous(), rows, partial.contiguous(), unit, threads)
    return _write_twin(fd, positions, rows, partial, unit)


# -- the native op's twins: a unit at a time through an aligned buffer ---------------------------
def _unit_groups(positions: torch.Tensor, per_unit: int):
    """(unit, [(index into positions, position within the unit)...]) in ascending unit order."""
    order = torch.argsort(positions)
    units = (positions[order] // per_unit).tolist()
    within = (positions[order] % per_unit).tolist()
    groups: dict[int, list] = {}
    for i, u, w in zip(order.tolist(), units, within):
        groups.setdefault(u, []).append((i, w))
    return groups.items()


def _read_twin(fd: int, positions: torch.Tensor, out: torch.Tensor, unit: int) -> None:
    row = out.shape[1]
    buf = mmap.mmap(-1, unit)  # page-aligned, as O_DIRECT wants
    view = torch.frombuffer(buf, dtype=torch.uint8)
    for u, members in _unit_groups(positions, unit // row):
        if os.preadv(fd, [buf], u * unit) != unit:
            raise OSError(f"disk tier: short read of unit {u}")
        for i, w in members:
            out[i] = view[w * row:(w + 1) * row]


def _write_twin(fd: int, positions: torch.Tensor, rows: torch.Tensor, partial: torch.Tensor,
                unit: int) -> tuple[int, int]:
    row = rows.shape[1]
    buf = mmap.mmap(-1, unit)
    view = torch.frombuffer(buf, dtype=torch.uint8)
    keep, read, written = set(partial.tolist()), 0, 0
    for u, members in _unit_groups(positions, unit // row):
        if u in keep:
            if os.preadv(fd, [buf], u * unit) != unit:
                raise OSError(f"disk tier: short read of unit {u}")
            read += unit
        else:
            view.zero_()
        for i, w in members:
            view[w * row:(w + 1) * row] = rows[i]
        if os.pwritev(fd, [buf], u * unit) != unit:
            raise OSError(f"disk tier: short write of unit {u}")
        written += unit
    return read, written
