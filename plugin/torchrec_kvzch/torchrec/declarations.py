"""TorchRec's own KV-ZCH declarations, read into ``KVZCHTableParams``.

TorchRec declares a KV-ZCH table in three places: its table config (``use_virtual_table``,
``total_num_buckets``, ``virtual_table_eviction_policy``, ``weight_init_min/max``,
``data_type``), its planner constraints (``compute_kernels=["dram_virtual_table"]``,
``key_value_params``) and the sharders' ``fused_params`` (optimizer, learning rate, eps).
``table_params`` reads all three. Each field is honoured, or refused with a ``ValueError`` that
names the table, the field and what to do. Fields that only place or cache rows on SSD change
nothing a DRAM store computes and are logged once; the policies' ``inference_*`` fields are read
only when publishing for inference, which training never does (docs/porting.md lists them all).

Precedence, where two declarations say the same thing: a table's own beats the sharders'
(``KVZCHTableParams`` fields that are set, then the config), and the sharders' ``fused_params``
fill the optimizer fields a table leaves unset. A config field that contradicts the table's
``KVZCHTableParams`` is an error, never a choice. What TorchRec has no per-table field for
(``EXTRA_FIELDS``: an ``lru`` budget, admission, ``expected_rows``...) a table declared the
TorchRec way takes from its ``KVZCHConstraints``, merged into what the config declares.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import os

from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, DataType, EmbeddingBagConfig

from torchrec_kvzch.params import (OPTIMIZER_DEFAULTS, DiskStorage, EvictionPolicy, KVZCHTableParams, OptimizerKind,
                                   WeightDecayMode)
from torchrec_kvzch.torchrec.eviction_declarations import eviction_policy

logger = logging.getLogger(__name__)

# TorchRec's kernels for KV-ZCH tables: the first is the name plans carry; the SSD ones keep
# their rows beyond a DRAM cache on disk where KeyValueParams give a directory and a cache size
# (``disk_storage``), else in DRAM with a notice. TorchRec 1.6 (the torch 2.11 stack) has no
# DRAM_SSD_VIRTUAL_TABLE yet.
KVZCH_KERNEL = EmbeddingComputeKernel.DRAM_VIRTUAL_TABLE.value
VIRTUAL_KERNELS = tuple(EmbeddingComputeKernel[name].value
                        for name in ("DRAM_VIRTUAL_TABLE", "SSD_VIRTUAL_TABLE", "DRAM_SSD_VIRTUAL_TABLE")
                        if name in EmbeddingComputeKernel.__members__)

DTYPES = {DataType.FP32: "fp32", DataType.FP16: "fp16"}  # TorchRec data type -> weight_dtype
# TorchRec's init range for virtual tables that do not set one (its SSD/DRAM TBE's default).
_DEFAULT_INIT = {"fp32": math.sqrt(1 / 4_000_000_000), "fp16": 0.001}

# fused_params keys (and KeyValueParams fields) that place, cache or report rows (TorchRec's
# FUSED / SSD kernels): nothing a DRAM store computes depends on them.
_PLACEMENT_KEYS = frozenset({
    "cache_load_factor", "cache_precision", "cache_algorithm", "cache_reserved_memory",
    "prefetch_pipeline", "enforce_hbm", "bounds_check_mode", "use_cpu", "ssd_storage_directory",
    "ssd_rocksdb_write_buffer_size", "ssd_rocksdb_shards", "gather_ssd_cache_stats",
    "stats_reporter_config", "use_passed_in_path", "max_l1_cache_size",
    "enable_async_update", "bulk_init_chunk_size", "lazy_bulk_init_enabled",
    "ssd_cache_location", "report_interval", "multipass_prefetch_config",
})
# fused_params keys with a value our kernel always uses: any other value is refused.
_FIXED_KEYS = {"gradient_clipping": False, "max_norm": 0.0, "output_dtype": "FP32"}
# ParameterConstraints / ParameterSharding fields TorchRec hands the table's kernel as fused params.
_TABLE_FUSED_FIELDS = ("stochastic_rounding", "output_dtype", "bounds_check_mode", "enforce_hbm")
_KEY_VALUE_REFUSED = {
    "enable_raw_embedding_streaming": "streaming rows to a remote store is not provided",
    "res_store_shards": "streaming rows to a remote store is not provided",
    "ps_hosts": "the parameter-server backend is not provided",
    "ps_client_thread_num": "the parameter-server backend is not provided",
    "ps_max_key_per_request": "the parameter-server backend is not provided",
    "ps_max_local_index_length": "the parameter-server backend is not provided",
    "load_ckpt_without_opt": "load a checkpoint without optimizer state with "
                             "CheckpointManager.load(..., load_optimizer=False) instead",
}
_TBE_CONFIG_REFUSED = {
    "load_ckpt_without_opt": _KEY_VALUE_REFUSED["load_ckpt_without_opt"],
    "enrichment_policy": "enriching rows from external sources is not provided",
}
_noticed: set[tuple[str, str]] = set()
# KVZCHTableParams fields TorchRec's declarations have no per-table place for: a table declared
# the TorchRec way may add them alone (KVZCHConstraints(expected_rows=...)); the rest of its
# parameters come from its config, kernel and the sharders' fused params.
EXTRA_FIELDS = ("eviction", "admission", "expected_rows", "checkpoint_chunk_rows", "init_seed",
                "optimizer", "learning_rate", "eps", "weight_decay", "weight_decay_mode", "beta1", "beta2")


def table_params(config: BaseEmbeddingConfig, kernel: str = KVZCH_KERNEL, key_value_params=None,
                 fused_params: dict | None = None, explicit: KVZCHTableParams | None = None,
                 extras: dict | None = None, own: dict | None = None) -> KVZCHTableParams:
    """The KV-ZCH parameters of a table declared the TorchRec way (``config`` planned on
    ``kernel`` with ``key_value_params``, sharded with ``fused_params``), merged with its
    ``KVZCHTableParams`` when it has some (``explicit``), or with the ``EXTRA_FIELDS`` its
    ``KVZCHConstraints`` set (``extras``, which win over the fused params as a table's own do).
    ``own``: the fused params among ``fused_params`` that the table itself sets (its constraints or
    sharding: ``table_own_fields``; its optimizer in backward), which ``explicit`` may not contradict."""
    name = config.name

    def fail(problem: str, fix: str):
        raise ValueError(f"KV-ZCH table '{name}': {problem}; fix: {fix}")

    extras = dict(extras or {})
    unknown = sorted(set(extras) - set(EXTRA_FIELDS))
    if unknown:
        fail(f"{unknown} cannot be given beside a TorchRec declaration (the config declares them)",
             f"set them in the config; the fields TorchRec has no place for are {list(EXTRA_FIELDS)}")
    if explicit is not None and extras:
        fail(f"its KVZCHConstraints give kvzch=KVZCHTableParams(...) and {sorted(extras)} too",
             "give either kvzch= (every parameter) or the extra fields alone")

    if kernel not in VIRTUAL_KERNELS:
        fail(f"compute kernel {kernel!r} is not a KV-ZCH kernel",
             f"plan it on one of {', '.join(VIRTUAL_KERNELS)}")
    if not config.use_virtual_table or config.total_num_buckets is None:
        fail("a KV-ZCH table must be declared with use_virtual_table=True and total_num_buckets "
             "(TorchRec splits its rows at bucket boundaries)",
             "set both in its EmbeddingBagConfig / EmbeddingConfig")
    if config.data_type not in DTYPES:
        fail(f"data_type {config.data_type} is not supported", "use DataType.FP32 or DataType.FP16")
    for flag, why in (("stash_weights", "stashing weights"), ("need_pos", "position-weighted features")):
        if getattr(config, flag, False):
            fail(f"{flag}=True ({why}) is not supported by the DRAM row store", f"set {flag}=False")
    if getattr(config, "enable_embedding_update", False) and isinstance(config, EmbeddingBagConfig):
        fail("enable_embedding_update=True on a pooled table: TorchRec writes embeddings into "
             "EmbeddingCollection tables only (DistributedModelParallel.write)",
             "declare the table in an EmbeddingCollection (EmbeddingConfig), or set enable_embedding_update=False")
    storage = disk_storage(kernel, key_value_params)
    if kernel != KVZCH_KERNEL and not storage.enabled:
        notice(name, kernel, f"'{kernel}' is served by the DRAM row store: its rows live in host memory "
               "(device memory on CUDA), not on SSD; for a disk tier under a DRAM cache give "
               "KeyValueParams(ssd_storage_directory=..., l2_cache_size=<GB of DRAM rows per table shard>)")
    check_key_value_params(name, key_value_params, honoured={"ssd_storage_directory"} if storage.enabled else set())
    dtype = DTYPES[config.data_type]
    eviction = eviction_policy(name, config.virtual_table_eviction_policy, key_value_params,
                               2 if dtype == "fp16" else 4)
    optimizer = _optimizer_fields(name, fused_params or {})
    if explicit is not None:
        return _merge(config, explicit, dtype, eviction, storage, optimizer, own or {}, fail)
    if "eviction" in extras and eviction.enabled:
        fail(f"eviction is declared twice: the config's virtual_table_eviction_policy reads as "
             f"{eviction}, its KVZCHConstraints say {extras['eviction']}",
             "declare it once: drop the config's policy (or use NoEvictionPolicy), or the "
             "KVZCHConstraints' eviction")
    low = config.weight_init_min if config.weight_init_min is not None else -_DEFAULT_INIT[dtype]
    high = config.weight_init_max if config.weight_init_max is not None else _DEFAULT_INIT[dtype]
    # As TorchRec sets up its own DRAM/SSD backends: optimizer state in the store, whole rows
    # returned by DRAM ones.
    fields = dict(
        name=name, embedding_dim=config.embedding_dim, num_embeddings=config.num_embeddings,
        total_num_buckets=config.total_num_buckets, weight_dtype=dtype, init_range=(low, high),
        enable_optimizer_offloading=True,
        backend_return_whole_row=kernel != EmbeddingComputeKernel.SSD_VIRTUAL_TABLE.value,
        eviction=eviction, storage=storage, **optimizer)
    own = frozenset(OPTIMIZER_DEFAULTS) - extras.keys()  # (fused params may carry betas for Adam tables elsewhere)
    return KVZCHTableParams(**{**fields, **extras}, defaulted=own)


def table_own_fields(sharding_or_constraints) -> dict:
    """The kernel settings a table's own ``ParameterConstraints`` / ``ParameterSharding`` set,
    which TorchRec merges into the fused params of that table's kernel over the sharders'
    (its ``add_params_from_parameter_sharding``; the cache's are read apart, ``device_cache.py``)."""
    return {key: value for key in _TABLE_FUSED_FIELDS
            if (value := getattr(sharding_or_constraints, key, None)) is not None}


def table_fused_params(fused_params: dict | None, sharding_or_constraints, in_backward: dict | None = None) -> dict:
    """The sharders' fused params, under the optimizer applied in backward to the table's weight (``in_backward.py``)
    and its own settings (``table_own_fields``), as TorchRec merges them: all checked alike."""
    return {**(fused_params or {}), **(in_backward or {}), **table_own_fields(sharding_or_constraints)}


def _merge(config, explicit: KVZCHTableParams, dtype: str, eviction: EvictionPolicy, storage,
           optimizer: dict, own: dict, fail) -> KVZCHTableParams:
    """``explicit`` with its unset optimizer fields from the sharders and the disk tier its
    kernel's ``KeyValueParams`` declare, after checking that the config does not contradict it."""
    if (config.embedding_dim, config.num_embeddings, config.total_num_buckets) != (
            explicit.embedding_dim, explicit.num_embeddings, explicit.total_num_buckets):
        fail(f"the config declares {config.num_embeddings} x {config.embedding_dim} in "
             f"{config.total_num_buckets} buckets, its KVZCHTableParams {explicit.num_embeddings} x "
             f"{explicit.embedding_dim} in {explicit.total_num_buckets}",
             "make them agree (kvzch_embedding_bag_config builds the config from the parameters)")
    if dtype != explicit.weight_dtype:
        fail(f"the config's data_type is {dtype}, its KVZCHTableParams' weight_dtype "
             f"{explicit.weight_dtype}", "declare the dtype once, or make them agree")
    for side, value in (("min", config.weight_init_min), ("max", config.weight_init_max)):
        wanted = explicit.init_range[0 if side == "min" else 1]
        if value is not None and value != wanted:
            fail(f"the config's weight_init_{side} is {value}, its KVZCHTableParams' init_range "
                 f"{explicit.init_range}", "declare the init range once, or make them agree")
    if eviction.enabled and eviction != explicit.eviction:
        fail(f"the config's eviction policy reads as {eviction}, its KVZCHTableParams say "
             f"{explicit.eviction}", "declare eviction once: in the config or in KVZCHTableParams")
    if storage.enabled and explicit.storage.enabled and storage != explicit.storage:
        fail(f"its KeyValueParams declare a disk tier ({storage}), its KVZCHTableParams another "
             f"({explicit.storage})", "declare the disk tier once: in KeyValueParams or in KVZCHTableParams.storage")
    unset = explicit.defaulted or frozenset()
    for key, value in _optimizer_fields(config.name, own).items():  # (the table's own: may not contradict)
        if key not in unset and value != getattr(explicit, key):
            fail(f"its constraints, sharding or optimizer in backward set {key}={getattr(value, 'value', value)}, "
                 f"its KVZCHTableParams {getattr(getattr(explicit, key), 'value', getattr(explicit, key))}",
                 "declare it once, or make them agree")
    filled = {k: v for k, v in optimizer.items() if k in unset}  # (still not the table's own)
    if storage.enabled:
        filled["storage"] = storage
    return dataclasses.replace(explicit, **filled)


def _optimizer_fields(table: str, fused_params: dict) -> dict:
    """The optimizer fields a KV-ZCH table takes from the sharders' fused params; refuses
    values our kernel cannot honour."""
    def fail(problem: str, fix: str):
        raise ValueError(f"KV-ZCH table '{table}': {problem}; fix: {fix}")

    fields = {}
    for key, value in fused_params.items():
        if key == "optimizer":
            fields["optimizer"] = OptimizerKind.parse(getattr(value, "value", value), table)
        elif key in ("learning_rate", "eps", "weight_decay", "beta1", "beta2"):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                fail(f"fused param {key}={value!r} is not a number", f"pass a float, e.g. {key}=0.01")
            fields[key] = float(value)
        elif key == "weight_decay_mode":
            fields[key] = WeightDecayMode.parse(value, table)
        elif key == "stochastic_rounding":
            if not isinstance(value, bool):
                fail(f"fused param stochastic_rounding={value!r} is not a bool", "pass True or False")
            fields[key] = value
        elif key in ("l2_cache_size", "kvzch_tbe_config"):
            fail(f"fused param '{key}' sets eviction triggers, which are read per table",
                 f"pass it as ParameterConstraints(key_value_params=KeyValueParams({key}=...))")
        elif key in _FIXED_KEYS:
            if not _same(value, _FIXED_KEYS[key]):
                fail(f"fused param {key}={getattr(value, 'name', value)!r} is not supported by the KV-ZCH "
                     f"kernel (it uses {_FIXED_KEYS[key]})",
                     "drop it from the table's ParameterConstraints, or give the KV-ZCH tables sharders "
                     "without it")
        elif key in ("cache_load_factor", "cache_algorithm", "prefetch_pipeline"):
            notice(table, key, f"fused param '{key}' sizes the GPU cache over host rows of a KV-ZCH table "
                   "on CUDA ranks (DeviceCache); on CPU ranks the rows are in host memory and it has no use")
        elif key in _PLACEMENT_KEYS or key.startswith("ssd_"):
            notice(table, key, f"fused param '{key}' places or caches rows; the DRAM store has no use for it"
                   + (" (a GPU cache over its host rows keeps their precision)" if key == "cache_precision" else ""))
        else:
            fail(f"fused param '{key}' is not understood by the KV-ZCH kernel",
                 "drop it from the sharders' fused_params (or shard the KV-ZCH tables with sharders "
                 "of their own)")
    return fields


def _same(value, fixed) -> bool:
    """Whether a fused param's value is the one our kernel uses (enums by name, numbers by value)."""
    value = getattr(value, "name", value)
    if isinstance(fixed, bool) or isinstance(fixed, str):
        return value == fixed
    return isinstance(value, (int, float)) and not isinstance(value, bool) and float(value) == fixed


def disk_storage(kernel: str, key_value_params) -> DiskStorage:
    """An SSD kernel's disk tier from its ``KeyValueParams``: rows under ``ssd_storage_directory``
    ("@local_rank" becoming this process's local rank, as TorchRec does), ``l2_cache_size`` GB of
    DRAM rows per table shard (TorchRec's DRAM cache per TBE; here each table's shard has its
    own). Without both, or on the DRAM kernel: no tier."""
    directory = getattr(key_value_params, "ssd_storage_directory", None)
    l2 = getattr(key_value_params, "l2_cache_size", None)
    if kernel == KVZCH_KERNEL or directory is None or l2 is None:
        return DiskStorage()
    return DiskStorage(directory.replace("@local_rank", os.environ.get("LOCAL_RANK", "0")),
                       shard_cache_bytes=int(l2 * 2**30))


def check_key_value_params(table: str, key_value_params, honoured: set[str] = frozenset()) -> None:
    """Refuses ``KeyValueParams`` fields the row store cannot honour; notes the SSD-only ones it
    has no use for (all but ``honoured``)."""
    if key_value_params is None:
        return
    tbe_config = getattr(key_value_params, "kvzch_tbe_config", None)
    for where, owner, refused in (("KeyValueParams", key_value_params, _KEY_VALUE_REFUSED),
                                  ("KVZCHTBEConfig", tbe_config, _TBE_CONFIG_REFUSED)):
        for field, reason in refused.items():
            if owner is not None and getattr(owner, field, None):
                raise ValueError(f"KV-ZCH table '{table}': {where}.{field} is not supported "
                                 f"({reason}); fix: leave it unset")
    for field in sorted(_PLACEMENT_KEYS - {"use_passed_in_path"} - honoured):  # (True by default)
        if getattr(key_value_params, field, None) is not None:
            if field == "max_l1_cache_size":
                notice(table, field, "KeyValueParams.max_l1_cache_size caps the GPU cache over host rows of a "
                       "KV-ZCH table on CUDA ranks (DeviceCache); on CPU ranks it has no use")
                continue
            notice(table, field, f"KeyValueParams.{field} configures SSD placement or caching; "
                   "the DRAM store has no use for it")


def notice(table: str, what: str, message: str) -> None:
    """Log ``message`` about a table once per process (``what``: the field or kernel it is about)."""
    if (table, what) not in _noticed:
        _noticed.add((table, what))
        logger.warning("KV-ZCH table '%s': %s", table, message)
