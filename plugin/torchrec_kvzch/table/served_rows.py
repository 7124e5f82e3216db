"""The served row of each id, on any device: ``kvzch::served_rows_py``.

A served table (``serving/table.py``) keeps its default rows first and the id in slot ``s`` at
row ``s + k``. On CPU the C++ op ``kvzch::served_rows`` maps a batch in one pass. This is the
same op over the id map's other backends - the GPU kernels on CUDA, the torch twin elsewhere -
registered as a torch custom op with a fake kernel, so that a served model on CUDA (or on a CPU
without the native op) exports too, the id check inside the program. A process that loads such
a program imports ``torchrec_kvzch.ops`` first.
"""

from __future__ import annotations

import torch

from torchrec_kvzch.table.id_map import backend_for

_BACKENDS: dict[torch.device, object] = {}


def outside_message(name: str, id_: int, position: int, lo: int, hi: int) -> str:
    """The error of an id outside ``[lo, hi)`` (the C++ op words it the same)."""
    return (f"served table '{name}': id {id_} (position {position} of the batch) is outside the ids this "
            f"table serves, [{lo}, {hi}); route it to the replica of its buckets, or check the feature's ids")


@torch.library.custom_op("kvzch::served_rows_py", mutates_args=())
def served_rows_py(table: torch.Tensor, ids: torch.Tensor, default_starts: torch.Tensor, lo: int, hi: int,
                   name: str) -> torch.Tensor:
    """Row of each id of ``ids`` (int64, on the table's device) in a served table whose id map
    is ``table``: its slot + k where it has one, else the default row whose id range
    (``default_starts``, k ascending starts) holds it. An id outside ``[lo, hi)`` raises
    ValueError naming table ``name``."""
    backend = _BACKENDS.get(ids.device)
    if backend is None:
        backend = _BACKENDS[ids.device] = backend_for("auto", ids.device)
    slots, bad, _ = backend.lookup(table, ids, lo, hi)
    if bad >= 0:
        raise ValueError(outside_message(name, int(ids[bad]), bad, lo, hi))
    k = default_starts.numel()
    if k == 1:
        default = torch.zeros_like(ids)
    else:  # (the first start is lo: every id inside has one)
        default = torch.searchsorted(default_starts, ids, right=True) - 1
    return torch.where(slots >= 0, slots + k, default)


@served_rows_py.register_fake
def _(table, ids, default_starts, lo, hi, name):
    return torch.empty_like(ids)
