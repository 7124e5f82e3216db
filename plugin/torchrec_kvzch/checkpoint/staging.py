"""Asynchronous saves (``dcp.async_save``) of state dicts holding KV-ZCH tables.

A stager that copies every tensor of the state dict before training may go on would copy
every row of a KV-ZCH table (and DCP's default stager of torch 2.13 fails on any
ShardedTensor). ``KVZCHAsyncStager`` copies only the ordinary entries and freezes the tables'
snapshots instead (copy on write, ``table/snapshot.py``): the call returns right after, and
only rows changed while the checkpoint is written get copied, each once.
``KVZCHSavePlanner`` releases a table's snapshot as soon as its last chunk is written::

    stager = KVZCHAsyncStager()
    future = dcp.async_save(state, checkpoint_id=path, planner=KVZCHSavePlanner(),
                            async_stager=stager, process_group=checkpoint_group)
    ...  # training goes on
    future.result()
    stager.close()  # after the last save

The save runs its collectives on a background thread, so give it a process group of its own
(``dist.new_group(backend="gloo")``): on the training group they could interleave with the
training step's collectives. The stager works with the thread-based async checkpointer only
(the rows cannot be sent to another process without copying them).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.staging import AsyncStager, BlockingAsyncStager

from torchrec_kvzch.torchrec.state_dict import kv_view
from torchrec_kvzch.table.snapshot import RowSnapshot


class KVZCHAsyncStager(AsyncStager):
    _synchronize_after_execute = False  # staging is done when stage() returns

    def __init__(self) -> None:
        self._dense = BlockingAsyncStager()  # copies tensors and ShardedTensors alike
        self._frozen: list[RowSnapshot] = []

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The state dict with its ordinary tensors copied and its KV-ZCH tables frozen."""
        kv_entries: dict[tuple, Any] = {}
        stripped = _without_kv_entries(state_dict, (), kv_entries)
        snapshots = list(dict.fromkeys(kv_view(e).snapshot for e in kv_entries.values()))
        frozen = []
        try:
            for snapshot in snapshots:
                snapshot.freeze()
                frozen.append(snapshot)
        except Exception:
            for snapshot in frozen:
                snapshot.release()
            raise
        self._frozen = [s for s in self._frozen if s.frozen] + frozen
        staged = self._dense.stage(stripped)
        for path, entry in kv_entries.items():
            _put(staged, path, entry)
        return staged

    def close(self) -> None:
        """Release snapshots a failed save left frozen, and the dense stager's buffers."""
        for snapshot in self._frozen:
            snapshot.release()
        self._frozen = []
        self._dense.close()


def _without_kv_entries(obj, path: tuple, found: dict):
    """A copy of the containers of ``obj`` with KV-ZCH entries set to None (and recorded)."""
    if kv_view(obj) is not None:
        found[path] = obj
        return None
    if isinstance(obj, dict):
        return {k: _without_kv_entries(v, (*path, k), found) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_without_kv_entries(v, (*path, i), found) for i, v in enumerate(obj)]
    return obj


def _put(obj, path: tuple, value) -> None:
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value
