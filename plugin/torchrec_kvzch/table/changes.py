"""What changed in a store since a moment: the base of an incremental checkpoint.

Rows. A row's header timestamp is the clock of its last training lookup, and everything training
does to a row (creating it, the fused update of its step) follows such a lookup. So the rows
changed since a mark are those stamped at or after ``mark.since``: no copy and no dirty bit,
the header word every row has anyway tells. ``since`` is the clock after the mark's step, or
that step itself while its fused update is still pending (the update will write rows stamped
with it).

Deletes (evictions). While ``logging`` is on, the ids of deleted rows are appended to a log;
a mark holds the log's length, so the ids deleted between two marks are a slice of it. The log
is opt-in (``CheckpointManager`` with deltas turns it on) and trimmed at each checkpoint, so it
holds the ids deleted since the last one, 8 bytes each.

Decays. ``lfu`` eviction's decay rewrites every row's count at once; while logging, the factors
are listed, so that a delta's restore can decay the rows it does not carry just as training did.

Everything else that changes rows without stamping them - writes and loads from outside
training, deletes and decays while not logging - counts as ``untracked``: a delta needs this
count unchanged since its base, else the save is a full one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChangeMark:
    """A store at one moment, as deltas measure change from it."""

    since: int  # rows stamped at or after this clock may have changed after the mark
    deleted: int  # the deletion log's length at the mark
    untracked: int  # untracked changes before the mark
    decays: int  # count decays logged before the mark


class ChangeLog:
    def __init__(self) -> None:
        self.logging = False
        self.untracked = 0
        self._chunks: list[torch.Tensor] = []  # deleted ids, in order
        self._start = 0  # log position of the first id of _chunks[0]
        self._length = 0  # ids ever logged
        self._decays: list[float] = []  # the factors of the count decays, in order
        self._decays_start = 0  # how many decays came before _decays[0]

    def mark(self, clock: int, update_pending: bool) -> ChangeMark:
        return ChangeMark(clock if update_pending else clock + 1, self._length, self.untracked,
                          self._decays_start + len(self._decays))

    def start(self) -> None:
        """Log deletes from now on (idempotent)."""
        self.logging = True

    def changed_untracked(self) -> None:
        self.untracked += 1

    def decayed(self, factor: float) -> None:
        if self.logging:
            self._decays.append(float(factor))
        else:  # (like a delete: nothing is kept until deltas are asked for)
            self.untracked += 1

    def decays_between(self, a: ChangeMark, b: ChangeMark) -> list[float]:
        return self._decays[a.decays - self._decays_start : b.decays - self._decays_start]

    def deleted(self, ids: torch.Tensor) -> None:
        if not self.logging:
            self.untracked += 1
        elif ids.numel():
            self._chunks.append(ids.reshape(-1).clone())
            self._length += ids.numel()

    def covers(self, a: ChangeMark, b: ChangeMark) -> bool:
        """Whether every change between marks ``a`` and ``b`` can be told: none untracked, and
        the log still holds the deletes in between (a delete while not logging is untracked)."""
        return (a.untracked == b.untracked and self._start <= a.deleted <= b.deleted
                and self._decays_start <= a.decays <= b.decays)

    def deleted_between(self, a: ChangeMark, b: ChangeMark) -> torch.Tensor:
        """Ids deleted after ``a`` and before ``b`` (``covers(a, b)``), unique, ascending."""
        if not self._start <= a.deleted <= b.deleted <= self._length:
            raise ValueError(f"the deletion log holds positions [{self._start}, {self._length}), "
                             f"not [{a.deleted}, {b.deleted})")
        out, at = [], self._start
        for chunk in self._chunks:
            lo, hi = max(a.deleted - at, 0), min(b.deleted - at, chunk.numel())
            if lo < hi:
                out.append(chunk[lo:hi])
            at += chunk.numel()
        return torch.unique(torch.cat(out)) if out else torch.empty(0, dtype=torch.long)

    def forget_before(self, mark: ChangeMark) -> None:
        """Drop the ids deleted and the decays before ``mark`` (no delta will go back further)."""
        drop = max(0, min(mark.decays - self._decays_start, len(self._decays)))
        self._decays, self._decays_start = self._decays[drop:], self._decays_start + drop
        while self._chunks and self._start + self._chunks[0].numel() <= mark.deleted:
            self._start += self._chunks.pop(0).numel()
