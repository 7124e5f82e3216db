"""Admission state in state dicts and checkpoints (``params/admission.py``).

A KV-ZCH table with admission adds, beside its rows, one block per rank of each of:

* ``admission_sketch`` ``[world * depth, width]`` uint8: the shard's count-min sketch;
* ``admission_totals`` ``[world, 2]`` int64: new ids admitted and rejected;
* with a trainable default row, ``default_weight`` ``[world, D]`` and its optimizer state as
  the table's rows name it (``default_momentum1``; Adam's ``default_momentum2`` too): each
  shard's default row.

The entries are views of the live state, so DCP saves them as they are and loads them in place
when the checkpoint was saved at this world size with these buckets: a resume is exact. Saved
at another world size, the blocks are merged (``merge``): the sketches add up (the sum counts
every shard's sightings and never undercounts, but conservative updates are not linear: it is
not the sketch one shard would have counted), the totals go to rank 0, and each rank's
default row becomes the mean of the saved ones. A checkpoint without admission state loads with
the admission state cleared: ids with rows are admitted, the others start counting.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

from torchrec_kvzch.table.tbe import TableTBE

SKETCH, TOTALS = "admission_sketch", "admission_totals"
DEFAULT_WEIGHT = "default_weight"  # each shard's trainable default row
ADMISSION_ENTRIES = (SKETCH, TOTALS, DEFAULT_WEIGHT, "default_momentum1", "default_momentum2")


def live_state(tbe: TableTBE) -> dict[str, torch.Tensor]:
    """Entry name -> this shard's block, as views of the live state (empty without admission)."""
    admission = tbe.store.admission
    if admission is None:
        return {}
    out = {SKETCH: admission.counts, TOTALS: admission.totals.view(1, 2)}
    out.update({f"default_{k}": v for k, v in tbe.default_state().items()})
    return out


def admission_entries(tbe: TableTBE, base: str, pg) -> dict[str, ShardedTensor]:
    """``{base}<entry>`` for each admission entry of the table shard ``tbe``."""
    return {base + name: rank_blocks(block, pg) for name, block in live_state(tbe).items()}


def placement(r: int, rank: int, device: torch.device) -> str:
    """Shard placement of rank ``r`` seen from ``rank``, whose local tensors are on ``device``:
    the local one names that device exactly (``cuda:0``; ShardedTensor checks it), another
    rank's only its type (its index is that rank's own; nothing checks it)."""
    return f"rank:{r}/{device if r == rank else device.type}"


def rank_blocks(local: torch.Tensor, pg) -> ShardedTensor:
    """Every rank's ``local`` ``[k, ...]`` (the same shape on all) stacked in rank order."""
    world = dist.get_world_size(pg) if dist.is_initialized() else 1
    rank = dist.get_rank(pg) if dist.is_initialized() else 0
    k, rest = local.shape[0], list(local.shape[1:])
    shards = [ShardMetadata([r * k] + [0] * len(rest), [k, *rest], placement(r, rank, local.device))
              for r in range(world)]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        [Shard(local, shards[rank])],
        ShardedTensorMetadata(shards, torch.Size([world * k, *rest]), TensorProperties(dtype=local.dtype)),
        process_group=pg)


def merge(live: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], table: str) -> None:
    """Fill the live blocks ``live`` (name -> this shard's block) from whole saved entries
    ``saved`` (name -> ``[saved world * k, ...]``), written at another world size or bucket
    split: sketches summed, totals to rank 0, default rows averaged."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    saved_world = saved[TOTALS].shape[0]
    for name, block in live.items():
        if name not in saved:
            continue
        blocks = saved[name].view(saved_world, -1, *block.shape[1:])
        if blocks.shape[1:] != block.shape:
            raise ValueError(f"KV-ZCH table '{table}': the saved '{name}' blocks are "
                             f"{list(blocks.shape[1:])}, this table's {list(block.shape)}; load it into a "
                             "table with the admission sketch (and default row) it was saved with")
        if name == SKETCH:
            block.copy_(blocks.sum(0, dtype=torch.long).clamp_(max=255))
        elif name == TOTALS:
            block.copy_(blocks.sum(0) if rank == 0 else torch.zeros_like(block))
        else:
            block.copy_(blocks.float().mean(0).to(block.dtype))


def admission_load(tbe: TableTBE, entries: dict) -> Callable[[], None]:
    """The load of a state dict's admission entries of this same shard (``model.load_state_dict``
    of materialised or another model's entries), checked first; entries that are this table's
    own views (a DCP load in place) need nothing, absent ones zero their state."""
    copies = []
    for name, block in live_state(tbe).items():
        entry = entries.get(name)
        local = entry.local_shards()[0].tensor if isinstance(entry, ShardedTensor) else entry
        if local is not None and local.data_ptr() == block.data_ptr():
            continue
        if local is not None and local.shape != block.shape:
            raise ValueError(f"KV-ZCH table '{tbe.params.name}': its '{name}' entry is "
                             f"{list(local.shape)}, this shard's {list(block.shape)}: saved with "
                             "another admission sketch or world size; load it through DCP")
        copies.append((block, local))

    def load() -> None:
        for block, local in copies:
            if local is None:
                block.zero_()
            else:
                block.copy_(local)
    return load
