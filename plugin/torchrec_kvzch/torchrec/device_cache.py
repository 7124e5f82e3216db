"""TorchRec's cache declarations, read into a CUDA table shard's ``DeviceCache`` (issue 34).

Upstream's DRAM virtual tables keep their rows in host memory and cache the hot ones in GPU
memory; TorchRec sizes that cache with ``CacheParams`` (or the same fused params) and caps it
with ``KeyValueParams.max_l1_cache_size``. On CUDA ranks these become the shard's
``DeviceCache`` (``store_plan`` in modules.py); on CPU ranks, whose rows are in host memory
already, they are logged, as are the ``CacheParams`` fields no DRAM store has a use for.
"""

from __future__ import annotations

import dataclasses

from torchrec_kvzch.params import DeviceCache, KVZCHTableParams
from torchrec_kvzch.table.row_cache import refusal
from torchrec_kvzch.torchrec.declarations import DTYPES, notice


def with_device_cache(params: KVZCHTableParams, fused_params: dict | None, cache_params=None,
                      key_value_params=None, cuda: bool = True) -> KVZCHTableParams:
    """A table shard's parameters on a ``cuda`` rank (else ``params``, with notices; its own
    ``DeviceCache`` is refused on CPU ranks): TorchRec's
    ``CacheParams`` (``load_factor``, ``algorithm``, ``prefetch_pipeline``; else the same fused
    params) and ``KeyValueParams.max_l1_cache_size`` (MB, a cap) become its ``DeviceCache`` unless
    it has one of its own; the load factor is of the rows the shard expects, the cap per table
    shard (docs/porting.md)."""
    def declared(name: str, fused_name: str):  # (a table's CacheParams over the sharders' fused params)
        own = getattr(cache_params, name, None)
        return (fused_params or {}).get(fused_name) if own is None else own

    _notice_unused(params, cache_params)
    if not cuda:
        if params.device_cache.enabled:  # (refused when planning, before any shard is made)
            raise refusal(params.name, "CPU ranks")
        if cache_params is not None:
            notice(params.name, "CacheParams", "CacheParams size the GPU cache over host rows of a KV-ZCH table on "
                   "CUDA ranks (DeviceCache); on CPU ranks the rows are in host memory and they have no use")
        return params
    factor = declared("load_factor", "cache_load_factor")
    megabytes = getattr(key_value_params, "max_l1_cache_size", None)
    if params.device_cache.enabled or (factor is None and not megabytes):
        return params
    algorithm = declared("algorithm", "cache_algorithm") or "lru"
    pipelined = declared("prefetch_pipeline", "prefetch_pipeline")
    row_bytes = params.embedding_dim * params.dtype.itemsize
    cache = DeviceCache(rows=max(1, (megabytes << 20) // row_bytes) if megabytes else None,
                        load_factor=None if factor is None else float(factor),
                        policy=str(getattr(algorithm, "name", algorithm)).rsplit(".", 1)[-1].lower(),
                        prefetch_pipeline=bool(pipelined))
    return dataclasses.replace(params, device_cache=cache)


def _notice_unused(params: KVZCHTableParams, cache_params) -> None:
    """Log the ``CacheParams`` fields a KV-ZCH table's cache does not take."""
    precision = getattr(cache_params, "precision", None)
    if precision is not None and DTYPES.get(precision) != params.weight_dtype:
        notice(params.name, "CacheParams.precision",
               f"CacheParams.precision {getattr(precision, 'name', precision)} is not used: a GPU cache over a "
               f"KV-ZCH table's host rows keeps their precision ({params.weight_dtype}), as upstream's virtual "
               "tables' caches do")
    for field, why in (("reserved_memory", "the cache is sized by load_factor or max_l1_cache_size"),
                       ("multipass_prefetch_config", "prefetches run in one pass"),
                       ("stats", "the KV-ZCH planner does not read cache statistics")):
        if getattr(cache_params, field, None) is not None:
            notice(params.name, f"CacheParams.{field}", f"CacheParams.{field} is not used: {why}")
