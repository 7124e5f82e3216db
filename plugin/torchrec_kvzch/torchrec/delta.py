"""State dicts of incremental checkpoints: a full state dict cut down to what changed.

``delta_state(state, base, pg)`` copies ``state`` (``{"model": model.state_dict(), ...}``,
nested as DCP takes it) with each KV-ZCH table's row entries - ``weight``, ``weight_id``,
``metaheader`` and the optimizer's ``momentum1`` - holding only the rows changed since the
table's base mark (``table/changes.py``), and with a ``deleted_id`` entry beside ``weight``: the
ids deleted since, ``[n, 1]`` int64, ascending within each rank, in rank order like the rows.
Everything else (rows per bucket, counters, clock, admission state, ordinary tables, dense
parameters) stays whole: it is small, and a restore takes it from the chain's last link.
Beside the state it returns each table's count decays since the base, per rank (lfu decay
rewrites every row's count; a restore replays it on the rows the delta does not carry).

The entries stay lazy chunks of the same snapshot as the full state dict's, so a delta saves
(and freezes for an async save) like a full checkpoint. Like ``state_dict()`` it is a collective:
one all-gather of the row counts, which also makes every rank agree on whether a delta can be
saved at all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchrec_kvzch.table.changes import ChangeMark
from torchrec_kvzch.table.kv_tensor import KVTensor
from torchrec_kvzch.table.layout import RowPart
from torchrec_kvzch.table.row_store import RowStore
from torchrec_kvzch.table.snapshot import RowSnapshot
from torchrec_kvzch.torchrec.state_dict import kv_view, rows_sharded_tensor

DELETED = "deleted_id"  # {table}.deleted_id, beside {table}.weight


def table_snapshots(state) -> dict[RowStore, RowSnapshot]:
    """Each KV-ZCH table store of a (nested) state dict -> the snapshot its entries read."""
    out: dict[RowStore, RowSnapshot] = {}
    for entry in _leaves(state):
        view = kv_view(entry)
        if view is not None:
            out.setdefault(view.store, view.snapshot)
    return out


def delta_state(state: dict, base: dict[RowStore, ChangeMark] | None,
                pg: dist.ProcessGroup | None) -> tuple[dict | None, dict, str | None]:
    """(``state`` cut down to the changes since ``base``, {table: [count decays since, per
    rank]} where any, None), or (None, {}, why not) when some rank's table cannot tell its
    changes: then every rank saves in full. Collective."""
    snapshots = table_snapshots(state)
    changed: dict[RowSnapshot, tuple[RowSnapshot, torch.Tensor]] = {}
    decays: dict[str, list[float]] = {}
    reason = None
    for store, snap in snapshots.items():
        name = store.params.name
        if base is None or store not in base:
            reason = f"table '{name}' has no base checkpoint in this process"
            break
        try:
            changed[snap] = (snap.changed_since(base[store]), snap.deleted_since(base[store]))
            decays[name] = snap.decays_since(base[store])
        except ValueError as e:
            reason = str(e)
            break
    local = {"reason": reason, "decays": decays,
             "sizes": {s.store.params.name: (len(c), d.numel()) for s, (c, d) in changed.items()}}
    gathered = [local]
    if dist.is_initialized() and dist.get_world_size(pg) > 1:
        gathered = [None] * dist.get_world_size(pg)
        dist.all_gather_object(gathered, local, group=pg)
    reasons = [f"rank {r}: {g['reason']}" for r, g in enumerate(gathered) if g["reason"]]
    if reasons:
        return None, {}, reasons[0]
    counts = {}  # table -> (changed rows per rank, deleted ids per rank)
    for name in local["sizes"]:
        sizes = [g["sizes"].get(name, (0, 0)) for g in gathered]
        counts[name] = ([rows for rows, _ in sizes], [deleted for _, deleted in sizes])
    per_rank = {name: [g["decays"].get(name, []) for g in gathered] for name in decays}
    return _rebuilt(state, changed, counts, pg), {n: d for n, d in per_rank.items() if any(d)}, None


def _rebuilt(obj, changed, counts, pg):
    """A copy of the containers of ``obj`` with the KV-ZCH row entries over the changed rows."""
    if isinstance(obj, list):
        return [_rebuilt(v, changed, counts, pg) for v in obj]
    if not isinstance(obj, dict):
        return obj
    out = {k: _rebuilt(v, changed, counts, pg) for k, v in obj.items()}
    for key, entry in obj.items():
        view = kv_view(entry)
        if view is None or view.snapshot not in changed:
            continue
        rows, deleted = changed[view.snapshot]
        store, (row_counts, deleted_counts) = view.store, counts[view.store.params.name]
        out[key] = rows_sharded_tensor(KVTensor(store, view.part, read_only=view.read_only, snapshot=rows,
                                                columns=view.columns),
                                       row_counts, pg)
        if view.part in (RowPart.ROW, RowPart.WEIGHT) and key.endswith("weight"):
            prefix = key[: -len("weight")]
            out[prefix + "weight_id"] = rows_sharded_tensor(KVTensor(store, RowPart.ID, snapshot=rows),
                                                            row_counts, pg)
            gone = KVTensor(store, RowPart.ID, snapshot=RowSnapshot(store, ids=deleted))
            out[prefix + DELETED] = rows_sharded_tensor(gone, deleted_counts, pg)
    return out


def _leaves(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _leaves(v)
    else:
        yield obj
