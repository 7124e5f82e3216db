"""TorchRec's eviction declarations, read into an ``EvictionPolicy`` (``declarations.py`` reads the
rest of a table's): a ``virtual_table_eviction_policy`` and the trigger settings fbgemm takes
from ``KeyValueParams`` (``l2_cache_size``, ``kvzch_tbe_config``), computed as fbgemm computes
them, or refused naming the field (docs/porting.md maps each).
"""

from __future__ import annotations

from torchrec.modules.embedding_configs import (
    CountBasedEvictionPolicy, CountTimestampMixedEvictionPolicy, FeatureL2NormBasedEvictionPolicy,
    FeatureScoreBasedEvictionPolicy, NoEvictionPolicy, TimestampBasedEvictionPolicy)

from torchrec_kvzch.params import EvictionPolicy
from torchrec_kvzch.params.checks import finite, positive_int

HEADER_BYTES = 16  # a whole row's header: the id, then the meta word (table/layout.py)
# fbgemm's trigger modes (KVZCHTBEConfig.kvzch_eviction_trigger_mode)
_DISABLED, _ITERATION, _MEMORY, _MANUAL, _ID_COUNT, _FREE_MEMORY = range(6)


def check_feature_score_module(configs) -> None:
    """Refuse a module whose virtual tables mix feature-score eviction with another policy:
    TorchRec then feeds feature scores to every table of the module, and asserts this (its
    ``feature_score_utils``) while the module is sharded, naming no table."""
    with_policy = [c for c in configs if c.use_virtual_table and c.virtual_table_eviction_policy is not None]
    scored = [c.name for c in with_policy if isinstance(c.virtual_table_eviction_policy, FeatureScoreBasedEvictionPolicy)]
    others = [c.name for c in with_policy if c.name not in scored]
    if scored and others:
        raise ValueError(f"KV-ZCH tables {scored} evict by feature score and {others}, in the same module, by other "
                         "policies: TorchRec feeds feature scores to every virtual table of a module that has one; fix: "
                         "give those tables a module of their own, or declare no policy (None) where they need none")


def eviction_policy(table: str, policy, key_value_params=None, itemsize: int = 4) -> EvictionPolicy:
    """The ``EvictionPolicy`` doing what TorchRec's ``virtual_table_eviction_policy`` and its
    trigger settings (``KeyValueParams.kvzch_tbe_config``, ``l2_cache_size``) describe, for rows
    of ``itemsize`` bytes a value."""
    def fail(problem: str, fix: str):
        raise ValueError(f"KV-ZCH table '{table}': {problem}; fix: {fix}")

    if policy is None:
        return EvictionPolicy()
    kind = type(policy).__name__
    header = getattr(policy, "meta_header_len", 0)
    if header and header != HEADER_BYTES // itemsize:  # (0: TorchRec sets it from the data type later)
        fail(f"{kind}.meta_header_len={header}: a whole row's header is {HEADER_BYTES} bytes "
             f"({HEADER_BYTES // itemsize} values of its {itemsize}-byte type), as upstream's",
             "leave meta_header_len unset (TorchRec derives it from the data type)")
    if isinstance(policy, NoEvictionPolicy):
        return EvictionPolicy()
    if isinstance(policy, FeatureScoreBasedEvictionPolicy):
        rule = _feature_score(policy, key_value_params, fail)
        if not policy.enable_eviction:  # fbgemm never evicts it: no trigger of its starts a pass
            return EvictionPolicy(**rule, trigger="manual").validate(table)
    elif isinstance(policy, TimestampBasedEvictionPolicy):
        rule = dict(kind="ttl", ttl_minutes=policy.eviction_ttl_mins) if policy.eviction_ttl_mins else None
    elif isinstance(policy, CountBasedEvictionPolicy):
        rule = (dict(kind="lfu", count_threshold=policy.eviction_threshold,
                     count_decay=policy.decay_rate) if policy.eviction_threshold else None)
    elif isinstance(policy, CountTimestampMixedEvictionPolicy):  # (fbgemm: either at 0, no eviction)
        rule = (dict(kind="lfu", count_threshold=policy.eviction_threshold, count_decay=policy.decay_rate,
                     ttl_minutes=policy.eviction_ttl_mins)
                if policy.eviction_threshold and policy.eviction_ttl_mins else None)
    elif isinstance(policy, FeatureL2NormBasedEvictionPolicy):
        rule = dict(kind="l2", l2_threshold=policy.eviction_threshold) if policy.eviction_threshold else None
    else:
        fail(f"eviction policy {kind} is unknown", "use one of TorchRec's VirtualTableEvictionPolicy "
             "classes, or KVZCHTableParams(eviction=EvictionPolicy(...))")
    if rule is None:  # the policy's own "0 means no eviction"
        return EvictionPolicy()
    rule.update(_trigger(table, kind, policy, key_value_params, fail))
    try:
        return EvictionPolicy(**rule).validate(table)
    except ValueError as e:
        fail(f"{kind} does not map to an eviction policy ({e})", "check its thresholds")


_DECAY_MINUTES = 24 * 60  # fbgemm's interval_for_feature_statistics_decay_s, which TorchRec leaves at its default


def _feature_score(policy, key_value_params, fail) -> dict:
    """``FeatureScoreBasedEvictionPolicy`` as fbgemm runs it: a TTL instead of scores when
    ``eviction_ttl_mins`` is set; scores per feature with automatic collection, else the KJT's
    weights; the cut's buckets from ``KVZCHTBEConfig``. (With ``enable_eviction=False`` scores
    are kept and a pass runs only when asked for.)"""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import KVZCHTBEConfig

    if policy.eviction_ttl_mins:  # (the inference_* fields: publishing only, unread in training upstream too)
        return dict(kind="ttl", ttl_minutes=policy.eviction_ttl_mins)
    for field in ("feature_score_mapping", "feature_score_default_value"):
        if getattr(policy, field) is not None and getattr(policy, field) != {} and \
                not policy.enable_auto_feature_score_collection:
            fail(f"{field} is read only with enable_auto_feature_score_collection=True (without it the scores are "
                 "the KJT's weights)", f"set enable_auto_feature_score_collection=True, or drop {field}")
    if not policy.training_id_keep_count:
        fail("FeatureScoreBasedEvictionPolicy.training_id_keep_count is 0: each pass would evict every row",
             "set the rows to keep per table shard")
    config = getattr(key_value_params, "kvzch_tbe_config", None) or KVZCHTBEConfig()
    rule = dict(kind="feature_score", keep_rows=policy.training_id_keep_count, count_decay=policy.decay_rate,
                decay_interval_minutes=_DECAY_MINUTES if policy.decay_rate < 1.0 else None,
                score_bucket_width=getattr(config, "threshold_calculation_bucket_stride", 0.2),  # (older fbgemm:
                score_buckets=getattr(config, "threshold_calculation_bucket_num", None) or 1_000_000)  # its defaults)
    if policy.enable_auto_feature_score_collection:
        rule.update(feature_scores=dict(policy.feature_score_mapping or {}),
                    default_feature_score=policy.feature_score_default_value)
    return rule


def _trigger(table: str, kind: str, policy, key_value_params, fail) -> dict:
    """When passes run, from fbgemm's trigger mode (TorchRec's default: memory, once the shard's
    whole GiB pass ``KeyValueParams.l2_cache_size``, as fbgemm divides its bytes by 2^30)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import KVZCHTBEConfig

    config = getattr(key_value_params, "kvzch_tbe_config", None) or KVZCHTBEConfig()
    mode = config.kvzch_eviction_trigger_mode
    if mode == _MEMORY:
        size = getattr(key_value_params, "l2_cache_size", None)
        if not size:
            fail(f"{kind} is triggered by memory (kvzch_eviction_trigger_mode 2, TorchRec's default) "
                 "but KeyValueParams.l2_cache_size (the threshold, in GB) is not set",
                 "set key_value_params=KeyValueParams(l2_cache_size=<GB per table shard>), or "
                 "another trigger mode in KeyValueParams.kvzch_tbe_config")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            fail(f"KeyValueParams.l2_cache_size={size!r} is the memory trigger's threshold, a whole number of GB "
                 "(fbgemm's is an integer)", "give an integer, e.g. l2_cache_size=4")
        return dict(trigger="bytes", trigger_bytes=((size + 1) << 30) - 1)
    if mode == _ID_COUNT:
        if not policy.training_id_eviction_trigger_count:
            fail(f"{kind} is triggered by id count (kvzch_eviction_trigger_mode 4) but its "
                 "training_id_eviction_trigger_count is 0", "set the row count that starts a pass")
        return dict(trigger="rows", trigger_rows=policy.training_id_eviction_trigger_count)
    if mode == _MANUAL:
        return dict(trigger="manual")
    if mode == _FREE_MEMORY:
        gb, every = config.eviction_free_mem_threshold_gb, config.eviction_free_mem_check_interval_batch
        if not (finite(gb) and gb > 0):
            fail(f"KVZCHTBEConfig.eviction_free_mem_threshold_gb={gb!r} is not a positive number of GB", "e.g. 8")
        if not positive_int(every):
            fail(f"KVZCHTBEConfig.eviction_free_mem_check_interval_batch={every!r} is not a positive integer",
                 "e.g. 1000 (batches between checks)")
        return dict(trigger="free_memory", free_memory_bytes=int(gb * (1 << 30)), interval_steps=every)
    if mode == _ITERATION:
        fail("kvzch_eviction_trigger_mode 1 (every N iterations) has no N in TorchRec's declarations",
             "use KVZCHTableParams(eviction=EvictionPolicy(..., interval_steps=N)) in KVZCHConstraints")
    if mode == _DISABLED:
        fail(f"{kind} asks for eviction but kvzch_eviction_trigger_mode 0 disables it",
             "use NoEvictionPolicy, or a trigger mode")
    fail(f"kvzch_eviction_trigger_mode {mode} is unknown", "use 2 (memory), 3 (manual), 4 (id count) or 5 (free memory)")
