"""TorchRec's cache declarations, read into a CUDA table shard's ``DeviceCache`` (issue 34).

Upstream's DRAM virtual tables keep their rows in host memory and cache the hot ones in GPU
memory; TorchRec sizes that cache with ``CacheParams`` (or the same fused params) and caps it
with ``KeyValueParams.max_l1_cache_size``. On CUDA ranks these become the shard's
``DeviceCache`` (``store_plan`` in modules.py), and a table's own ``CacheParams`` fields that such
a cache cannot honour are refused; on CPU ranks, whose rows are in host memory already, they are
logged.
"""

from __future__ import annotations

import dataclasses

from torchrec_kvzch.params import DeviceCache, KVZCHTableParams
from torchrec_kvzch.params.checks import finite, positive_int
from torchrec_kvzch.table.row_cache import refusal
from torchrec_kvzch.torchrec.declarations import DTYPES, notice

DEFAULT_LOAD_FACTOR = 0.2  # upstream's, for a virtual table's cache declared without one


def with_device_cache(params: KVZCHTableParams, fused_params: dict | None, cache_params=None,
                      key_value_params=None, cuda: bool = True) -> KVZCHTableParams:
    """A table shard's parameters on a ``cuda`` rank (else ``params``, with a notice; its own
    ``DeviceCache`` is refused on CPU ranks): TorchRec's ``CacheParams`` (``load_factor``,
    ``algorithm``, ``prefetch_pipeline``; else the same fused params) and
    ``KeyValueParams.max_l1_cache_size`` (MB, a cap) become its ``DeviceCache`` unless it has one
    of its own. A table's ``CacheParams`` ask for a cache even without a load factor (upstream's
    0.2 then); the sharders' fused params, which ordinary tables share, only with one. The load
    factor is of the rows the shard expects, the cap per table shard (docs/porting.md)."""
    def declared(name: str, fused_name: str):  # (a table's CacheParams over the sharders' fused params)
        own = getattr(cache_params, name, None)
        if own is not None:
            return own, f"CacheParams.{name}"
        return (fused_params or {}).get(fused_name), f"the fused param {fused_name}"

    def fail(where: str, problem: str, fix: str):
        raise ValueError(f"KV-ZCH table '{params.name}': {where} {problem}; fix: {fix}")

    if not cuda:
        if params.device_cache.enabled:  # (refused when planning, before any shard is made)
            raise refusal(params.name, "CPU ranks")
        if cache_params is not None:
            notice(params.name, "CacheParams", "CacheParams size the GPU cache over host rows of a KV-ZCH table on "
                   "CUDA ranks (DeviceCache); on CPU ranks the rows are in host memory and they have no use")
        return params
    _refuse_unused(params, cache_params, fail)
    factor, factor_from = declared("load_factor", "cache_load_factor")
    megabytes = getattr(key_value_params, "max_l1_cache_size", None)
    if params.device_cache.enabled or (factor is None and megabytes is None and cache_params is None):
        return params
    if factor is not None and not (finite(factor) and 0 < factor <= 1):
        fail(factor_from, f"must be a number in (0, 1], got {factor!r}", "e.g. 0.2")
    if megabytes is not None and not positive_int(megabytes):
        fail("KeyValueParams.max_l1_cache_size", f"must be a positive whole number of MB, got {megabytes!r}",
             "e.g. 1024, or None for no cap")
    pipelined, pipelined_from = declared("prefetch_pipeline", "prefetch_pipeline")
    if pipelined is not None and not isinstance(pipelined, bool):
        fail(pipelined_from, f"must be True or False, got {pipelined!r}", "pass a bool")
    if factor is None and cache_params is not None:
        factor = DEFAULT_LOAD_FACTOR
    algorithm = declared("algorithm", "cache_algorithm")[0] or "lru"
    row_bytes = params.embedding_dim * params.dtype.itemsize
    cache = DeviceCache(rows=None if megabytes is None else max(1, (megabytes << 20) // row_bytes),
                        load_factor=None if factor is None else float(factor),
                        policy=str(getattr(algorithm, "name", algorithm)).rsplit(".", 1)[-1].lower(),
                        prefetch_pipeline=bool(pipelined))
    return dataclasses.replace(params, device_cache=cache)


def _refuse_unused(params: KVZCHTableParams, cache_params, fail) -> None:
    """Refuse the ``CacheParams`` fields a KV-ZCH table's GPU cache cannot honour."""
    precision = getattr(cache_params, "precision", None)
    if precision is not None and DTYPES.get(precision) != params.weight_dtype:
        fail("CacheParams.precision", f"{getattr(precision, 'name', precision)} cannot be honoured: the GPU cache "
             f"over a KV-ZCH table's host rows keeps their precision ({params.weight_dtype}), as upstream's "
             "virtual tables' caches do", "drop it (or give the table rows of that precision)")
    for field, why in (("reserved_memory", "the cache is sized by load_factor or max_l1_cache_size"),
                       ("multipass_prefetch_config", "prefetches run in one pass"),
                       ("stats", "the KV-ZCH planner does not read cache statistics")):
        if getattr(cache_params, field, None) is not None:
            fail(f"CacheParams.{field}", f"cannot be honoured: {why}", "drop it")
