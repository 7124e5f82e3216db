"""The fused updates a row store has been told of and that have not started yet.

fbgemm's TBE writes each training batch's update into the store's arrays during backward, at
the slots its forward looked up; until then no row may move (``RowStore`` refuses to evict or
grow) and a frozen snapshot copies those rows aside first. Usually one is pending at a time;
TorchRec's semi-sync pipeline looks the next batch up before this one's backward, so two are.
A training output's gradient hook (``UpdateHook``) tells the store its update is starting.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch


class PendingUpdate:
    """One announced update: the ``slots`` it will write and the ``clock`` of its forward (the
    stamp its rows carry)."""

    __slots__ = ("slots", "clock")

    def __init__(self, slots: torch.Tensor, clock: int) -> None:
        self.slots, self.clock = slots, clock


class PendingUpdates:
    def __init__(self) -> None:
        self._updates: list[PendingUpdate] = []

    def __bool__(self) -> bool:
        return bool(self._updates)

    def add(self, slots: torch.Tensor, clock: int) -> PendingUpdate:
        update = PendingUpdate(slots, clock)
        self._updates.append(update)
        return update

    def started(self, update: PendingUpdate | None) -> None:
        """``update`` is under way (or will never be); None: every one."""
        self._updates = [u for u in self._updates if update is not None and u is not update]

    def slots(self) -> torch.Tensor | None:
        """The slots of every pending update (repeats possible), or None."""
        if not self._updates:
            return None
        return self._updates[0].slots if len(self._updates) == 1 else torch.cat([u.slots for u in self._updates])

    def oldest_clock(self) -> int | None:
        return min(u.clock for u in self._updates) if self._updates else None

    def check_lookup(self, store, n: int) -> None:
        """Refuse, while an update is pending, a training lookup of ``n`` ids in ``store`` that could
        grow it (growth drops the arrays the update writes) or that may move rows (eviction, a rank
        budget, a disk tier), before the lookup changes anything."""
        if not self._updates:
            return
        if len(store) + n > store.capacity:
            raise _refusal(store.params.name, f"grow the row store past {store.capacity:,} rows", "reserve the rows "
                           "up front (expected_rows in the table's KV-ZCH parameters, or RowStore.reserve)")
        if store.evictor.in_lookups or store.cache is not None:
            raise self.refuse_moves(store.params.name, disk=not store.evictor.in_lookups)

    def refuse_moves(self, table: str, disk: bool = False) -> RuntimeError:
        if disk:
            return _refusal(table, "move rows between DRAM and its disk tier", "give the table no disk tier")
        return _refusal(table, "evict rows, as its eviction policy or rank budget may in any lookup (a delete "
                        "moves rows)", "drop them, or evict with trigger 'manual' (evictor.run_pass() between steps)")


def _refusal(table: str, what: str, fix: str) -> RuntimeError:
    """The error for a change that would move rows under a pending update."""
    return RuntimeError(
        f"KV-ZCH table '{table}': a forward before the backward of the one before it (as "
        f"TorchRec's semi-sync and prefetch pipelines do) would have to {what} while that backward's "
        f"fused update is pending, which would then write the wrong rows; {fix}, or run "
        "backward between forwards (a plain loop, or TrainPipelineSparseDist)")


class UpdateHook:
    """The gradient hook of a training output: its fused update is starting. Held by the output
    and its graph only, so an output dropped without a backward ends its pending update too."""

    def __init__(self, store, update, before: Callable[[], None] | None = None) -> None:
        self.store, self.update, self.before = store, update, before
        weakref.finalize(self, store.update_started, update)

    def __call__(self, grad: torch.Tensor) -> None:
        if self.before is not None:  # (what the update needs done to its rows first)
            self.before()
        self.store.update_started(self.update)
