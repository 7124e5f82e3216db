"""A table shard's rows as eviction sees them: those in DRAM by slot, then those on disk (a
disk tier, ``disk_cache.py``) by tier entry, so that the rules read both tiers as one."""

from __future__ import annotations

import torch


def shard_rows(store) -> int:
    return len(store) + (len(store.cache) if store.cache is not None else 0)


def shard_ids(store) -> torch.Tensor:
    return store.keys() if store.cache is None else torch.cat([store.keys(), store.cache.tier.keys()])


def shard_meta(store) -> torch.Tensor:
    return torch.cat(meta_parts(store)) if store.cache is not None else store.meta[: len(store)]


def meta_parts(store) -> tuple[torch.Tensor, ...]:
    """The header words of the shard's rows, writable in place: DRAM's, then the tier's."""
    dram = store.meta[: len(store)]
    return (dram,) if store.cache is None else (dram, store.cache.tier.meta)


def locate(store, ids: torch.Tensor) -> torch.Tensor:
    """Each id's index in the shard's rows, -1 where it has none."""
    slots = store.find(ids)
    if store.cache is None:
        return slots
    entries = store.cache.tier.index.find(ids)
    return torch.where(slots >= 0, slots, torch.where(entries >= 0, entries + len(store), -1))


def batch_rows(store, present: torch.Tensor) -> torch.Tensor:
    """Mask over the shard's rows of those the batch looks up (never evicted for it)."""
    protected = torch.zeros(shard_rows(store), dtype=torch.bool, device=store.device)
    protected[present[present >= 0]] = True
    return protected


def new_rows(ids: torch.Tensor, present: torch.Tensor) -> int:
    return int(torch.unique(ids[present < 0]).numel()) if ids.numel() else 0
