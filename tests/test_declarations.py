"""TorchRec's own KV-ZCH declarations: every field honoured or refused, planned by our planner
and by TorchRec's stock one, trained like the same table declared natively."""

import dataclasses
import logging

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import KVZCHTBEConfig
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import KeyValueParams
from torchrec.modules.embedding_configs import (
    CountBasedEvictionPolicy,
    CountTimestampMixedEvictionPolicy,
    DataType,
    EmbeddingBagConfig,
    EmbeddingConfig,
    FeatureL2NormBasedEvictionPolicy,
    FeatureScoreBasedEvictionPolicy,
    NoEvictionPolicy,
    TimestampBasedEvictionPolicy,
)
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from torchrec_kvzch import KVZCHTableParams
from torchrec_kvzch.params import EvictionPolicy, WeightDecayMode
from torchrec_kvzch.torchrec import KVZCH_KERNEL, KVZCHParameterSharding, kvzch_sharders, table_params
from torchrec_kvzch.torchrec.declarations import VIRTUAL_KERNELS
from torchrec_kvzch.torchrec.planner import KVZCHConstraints, KVZCHShardingPlanner

ROWS, BUCKETS = 2**20, 8
MEMORY = KeyValueParams(l2_cache_size=4)  # TorchRec's default trigger: from 5 GiB (fbgemm: whole GiB > 4)
FIVE_GIB = (5 << 30) - 1  # (trigger_bytes: a pass once the shard's bytes pass it)


def config(policy=None, cls=EmbeddingBagConfig, name="t", **fields):
    return cls(name=name, embedding_dim=16, num_embeddings=ROWS, feature_names=[f"f_{name}"],
               use_virtual_table=True, total_num_buckets=BUCKETS,
               virtual_table_eviction_policy=policy, **fields)


@pytest.mark.parametrize("policy, key_value, expected", [
    (None, None, EvictionPolicy()),
    (NoEvictionPolicy(), None, EvictionPolicy()),
    (TimestampBasedEvictionPolicy(eviction_ttl_mins=90), MEMORY,
     EvictionPolicy(kind="ttl", ttl_minutes=90, trigger="bytes", trigger_bytes=FIVE_GIB)),
    (TimestampBasedEvictionPolicy(eviction_ttl_mins=0), None, EvictionPolicy()),  # 0: no eviction
    (CountBasedEvictionPolicy(eviction_threshold=3, decay_rate=0.5), MEMORY,
     EvictionPolicy(kind="lfu", count_threshold=3, count_decay=0.5, trigger="bytes", trigger_bytes=FIVE_GIB)),
    (CountTimestampMixedEvictionPolicy(eviction_threshold=2, decay_rate=0.9, eviction_ttl_mins=60), MEMORY,
     EvictionPolicy(kind="lfu", count_threshold=2, count_decay=0.9, ttl_minutes=60, trigger="bytes",
                    trigger_bytes=FIVE_GIB)),
    # fbgemm's mixed rule evicts nothing when either value is 0
    (CountTimestampMixedEvictionPolicy(eviction_threshold=0, eviction_ttl_mins=60), MEMORY, EvictionPolicy()),
    (CountTimestampMixedEvictionPolicy(eviction_threshold=5, eviction_ttl_mins=0), MEMORY, EvictionPolicy()),
    (FeatureL2NormBasedEvictionPolicy(eviction_threshold=0.25), MEMORY,
     EvictionPolicy(kind="l2", l2_threshold=0.25, trigger="bytes", trigger_bytes=FIVE_GIB)),
    (CountBasedEvictionPolicy(eviction_threshold=3, training_id_eviction_trigger_count=500),
     KeyValueParams(kvzch_tbe_config=KVZCHTBEConfig(kvzch_eviction_trigger_mode=4)),
     EvictionPolicy(kind="lfu", count_threshold=3, count_decay=0.99, trigger="rows", trigger_rows=500)),
    (TimestampBasedEvictionPolicy(eviction_ttl_mins=5),
     KeyValueParams(kvzch_tbe_config=KVZCHTBEConfig(kvzch_eviction_trigger_mode=3)),
     EvictionPolicy(kind="ttl", ttl_minutes=5, trigger="manual")),
    (FeatureScoreBasedEvictionPolicy(training_id_eviction_trigger_count=800, training_id_keep_count=600,
                                     decay_rate=0.9),
     KeyValueParams(kvzch_tbe_config=KVZCHTBEConfig(kvzch_eviction_trigger_mode=4,
                                                     threshold_calculation_bucket_stride=0.5,
                                                     threshold_calculation_bucket_num=1000)),
     EvictionPolicy(kind="feature_score", keep_rows=600, count_decay=0.9, score_bucket_width=0.5,
                    score_buckets=1000, trigger="rows", trigger_rows=800, decay_interval_minutes=24 * 60)),
    (FeatureScoreBasedEvictionPolicy(training_id_keep_count=600, enable_auto_feature_score_collection=True,
                                     feature_score_mapping={"f_t": 2.0}, feature_score_default_value=0.5), MEMORY,
     EvictionPolicy(kind="feature_score", keep_rows=600, count_decay=0.99, feature_scores={"f_t": 2.0},
                    default_feature_score=0.5, trigger="bytes", trigger_bytes=FIVE_GIB, decay_interval_minutes=24 * 60)),
    (FeatureScoreBasedEvictionPolicy(training_id_keep_count=600, enable_eviction=False), None,
     EvictionPolicy(kind="feature_score", keep_rows=600, count_decay=0.99, trigger="manual",
                    decay_interval_minutes=24 * 60)),
    (FeatureScoreBasedEvictionPolicy(eviction_ttl_mins=30, training_id_keep_count=600), MEMORY,
     EvictionPolicy(kind="ttl", ttl_minutes=30, trigger="bytes", trigger_bytes=FIVE_GIB)),
    (TimestampBasedEvictionPolicy(eviction_ttl_mins=5),
     KeyValueParams(kvzch_tbe_config=KVZCHTBEConfig(kvzch_eviction_trigger_mode=5,
                                                     eviction_free_mem_threshold_gb=2,
                                                     eviction_free_mem_check_interval_batch=10)),
     EvictionPolicy(kind="ttl", ttl_minutes=5, trigger="free_memory", free_memory_bytes=2 << 30,
                    interval_steps=10)),
])
def test_every_upstream_eviction_policy_maps_to_ours(policy, key_value, expected):
    params = table_params(config(policy), KVZCH_KERNEL, key_value)
    assert params.eviction == expected.validate("t")


@pytest.mark.parametrize("policy, key_value, message", [
    (FeatureScoreBasedEvictionPolicy(enable_auto_feature_score_collection=True), MEMORY,
     "training_id_keep_count is 0: each pass would evict every row"),
    (FeatureScoreBasedEvictionPolicy(training_id_keep_count=5, feature_score_mapping={"f_t": 1.0}), MEMORY,
     "feature_score_mapping is read only with enable_auto_feature_score_collection=True"),
    (FeatureScoreBasedEvictionPolicy(training_id_keep_count=5, enable_auto_feature_score_collection=True,
                                     feature_score_mapping={"f_t": -1.0}), MEMORY, "numbers >= 0"),
    (TimestampBasedEvictionPolicy(), None, "l2_cache_size .* is not set"),
    (TimestampBasedEvictionPolicy(), KeyValueParams(kvzch_tbe_config=KVZCHTBEConfig(kvzch_eviction_trigger_mode=1)),
     "mode 1 .* has no N"),
    (CountBasedEvictionPolicy(), KeyValueParams(kvzch_tbe_config=KVZCHTBEConfig(kvzch_eviction_trigger_mode=4)),
     "training_id_eviction_trigger_count is 0"),
    (CountBasedEvictionPolicy(decay_rate=1.5), MEMORY, "count_decay must be in"),
    (FeatureScoreBasedEvictionPolicy(training_id_keep_count=5, feature_score_default_value=1.0), MEMORY,
     "feature_score_default_value is read only with enable_auto_feature_score_collection=True"),
    (TimestampBasedEvictionPolicy(eviction_ttl_mins=5), KeyValueParams(l2_cache_size=1.5),
     r"KeyValueParams.l2_cache_size=1.5 is the memory trigger's threshold, a whole number of GB"),
    (TimestampBasedEvictionPolicy(eviction_ttl_mins=5), KeyValueParams(kvzch_tbe_config=KVZCHTBEConfig(
        kvzch_eviction_trigger_mode=5, eviction_free_mem_threshold_gb=4, eviction_free_mem_check_interval_batch=0)),
     "eviction_free_mem_check_interval_batch=0 is not a positive integer"),
    (TimestampBasedEvictionPolicy(eviction_ttl_mins=5), KeyValueParams(kvzch_tbe_config=KVZCHTBEConfig(
        kvzch_eviction_trigger_mode=5, eviction_free_mem_threshold_gb=float("inf"),
        eviction_free_mem_check_interval_batch=10)), "eviction_free_mem_threshold_gb=inf is not a positive number"),
    (None, KeyValueParams(enable_raw_embedding_streaming=True), "enable_raw_embedding_streaming is not supported"),
    (None, KeyValueParams(ps_hosts=(("::1", 2000),)), "ps_hosts is not supported"),
    (None, KeyValueParams(load_ckpt_without_opt=True), "load_optimizer=False"),
    (None, KeyValueParams(kvzch_tbe_config=KVZCHTBEConfig(load_ckpt_without_opt=True)),
     "KVZCHTBEConfig.load_ckpt_without_opt is not supported"),
])
def test_what_cannot_be_honoured_is_refused_by_name(policy, key_value, message):
    with pytest.raises(ValueError, match=f"KV-ZCH table 't': .*{message}"):
        table_params(config(policy), KVZCH_KERNEL, key_value)


def test_config_fields_are_honoured():
    params = table_params(config(weight_init_min=-0.5, weight_init_max=0.5, data_type=DataType.FP16))
    assert (params.init_range, params.weight_dtype) == ((-0.5, 0.5), "fp16")
    # TorchRec's DRAM backends keep optimizer state in the store and return whole rows.
    assert params.enable_optimizer_offloading and params.backend_return_whole_row
    default = table_params(config())
    assert default.init_range[1] == pytest.approx(1.58e-5, rel=1e-2)  # TorchRec's virtual-table default
    with pytest.raises(ValueError, match="data_type INT8 is not supported"):
        table_params(config(data_type=DataType.INT8))
    for flag in ("stash_weights", "need_pos"):
        with pytest.raises(ValueError, match=f"{flag}=True .* is not supported"):
            table_params(config(**{flag: True}))
    with pytest.raises(ValueError, match="enable_embedding_update=True on a pooled table: TorchRec writes"):
        table_params(config(enable_embedding_update=True))
    table_params(config(cls=EmbeddingConfig, enable_embedding_update=True))  # (writes.py; test_writes.py)
    with pytest.raises(ValueError, match="use_virtual_table=True and total_num_buckets"):
        table_params(EmbeddingBagConfig(name="t", embedding_dim=16, num_embeddings=ROWS, feature_names=["f"]))


def test_ssd_kernels_are_served_from_dram_with_a_notice(caplog):
    with caplog.at_level(logging.WARNING):
        params = table_params(config(name="ssd_t"), "ssd_virtual_table",
                              KeyValueParams(ssd_storage_directory="/tmp/x", max_l1_cache_size=64))
    assert "'ssd_virtual_table' is served by the DRAM row store" in caplog.text
    assert "KeyValueParams.ssd_storage_directory configures SSD placement" in caplog.text
    assert params.enable_optimizer_offloading and not params.backend_return_whole_row  # as upstream's SSD
    from fbgemm_gpu.split_embedding_configs import SparseType
    with caplog.at_level(logging.WARNING):
        table_params(config(name="half_cache"), fused_params={"cache_precision": SparseType.FP16})
    assert "'cache_precision' places or caches rows" in caplog.text and "keeps their precision" in caplog.text


def test_ssd_kernels_with_a_directory_and_a_dram_cache_keep_their_rows_on_disk(caplog, monkeypatch):
    """TorchRec's SSD kernels with ``KeyValueParams.ssd_storage_directory`` ("@local_rank" as
    TorchRec expands it) and ``l2_cache_size`` (GB of DRAM rows) get a disk tier (docs/disk.md),
    with no notice; the DRAM kernel ignores both, as before."""
    from torchrec_kvzch.params import DiskStorage
    monkeypatch.setenv("LOCAL_RANK", "3")
    kernels = ["ssd_virtual_table"] + (["dram_ssd_virtual_table"] if "dram_ssd_virtual_table" in VIRTUAL_KERNELS else [])
    for kernel in kernels:
        with caplog.at_level(logging.WARNING):
            params = table_params(config(name=f"disk_{kernel}"), kernel,
                                  KeyValueParams(ssd_storage_directory="/data/nvme@local_rank", l2_cache_size=2))
        assert params.storage == DiskStorage("/data/nvme3", shard_cache_bytes=2 << 30)
        assert f"disk_{kernel}" not in caplog.text
    params = table_params(config(name="dram_t"), "dram_virtual_table",
                          KeyValueParams(ssd_storage_directory="/data/nvme", l2_cache_size=2))
    assert not params.storage.enabled
    # With an eviction policy, under TorchRec's default trigger (memory past l2_cache_size): both.
    params = table_params(config(CountBasedEvictionPolicy(eviction_threshold=3, decay_rate=0.5), name="evicting"),
                          "ssd_virtual_table", KeyValueParams(ssd_storage_directory="/data/nvme", l2_cache_size=2))
    assert params.storage == DiskStorage("/data/nvme", shard_cache_bytes=2 << 30)
    assert params.eviction == EvictionPolicy(kind="lfu", count_threshold=3, count_decay=0.5, trigger="bytes",
                                             trigger_bytes=(3 << 30) - 1)
    # Beside the table's own KVZCHTableParams, the declared tier is kept; another one contradicts it.
    disk = KeyValueParams(ssd_storage_directory="/data/nvme", l2_cache_size=2)
    own = KVZCHTableParams("t", 16, num_embeddings=ROWS, total_num_buckets=BUCKETS)
    assert table_params(config(), "ssd_virtual_table", disk, explicit=own).storage == params.storage
    other = dataclasses.replace(own, storage=DiskStorage("/data/other", shard_cache_bytes=1 << 30))
    with pytest.raises(ValueError, match="KV-ZCH table 't': its KeyValueParams declare a disk tier"):
        table_params(config(), "ssd_virtual_table", disk, explicit=other)


def test_fused_params_fill_what_a_table_leaves_unset():
    fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.3, "eps": 0.01,
             "cache_load_factor": 0.2}
    upstream = table_params(config(), fused_params=fused)
    assert (upstream.optimizer.value, upstream.learning_rate, upstream.eps) == ("exact_sgd", 0.3, 0.01)
    own = KVZCHTableParams("t", 16, num_embeddings=ROWS, total_num_buckets=BUCKETS, learning_rate=0.05,
                           init_range=(-0.01, 0.01))
    merged = table_params(config(weight_init_min=-0.01, weight_init_max=0.01), fused_params=fused, explicit=own)
    assert (merged.optimizer.value, merged.learning_rate, merged.eps) == ("exact_sgd", 0.05, 0.01)
    bare = KVZCHTableParams("t", 16, num_embeddings=ROWS, total_num_buckets=BUCKETS)
    assert (bare.optimizer.value, bare.learning_rate, bare.eps) == ("exact_row_wise_adagrad", 0.01, 1e-8)
    from fbgemm_gpu.split_embedding_configs import SparseType
    table_params(config(), fused_params={"weight_decay": 0, "output_dtype": SparseType.FP32})  # our kernel's
    assert not table_params(config(), fused_params={"stochastic_rounding": False}).stochastic_rounding
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode as FbgemmMode  # (both stacks)
    decayed = table_params(config(), fused_params={"weight_decay": 0.1, "weight_decay_mode": FbgemmMode.DECOUPLE})
    assert (decayed.weight_decay, decayed.weight_decay_mode) == (0.1, WeightDecayMode.DECOUPLE)
    l2 = table_params(config(), fused_params={"weight_decay": 0.1, "weight_decay_mode": FbgemmMode.L2})
    assert (l2.optimizer.value, l2.weight_decay_mode) == ("exact_row_wise_adagrad", WeightDecayMode.L2)
    for kind in (EmbOptimType.ADAM, EmbOptimType.PARTIAL_ROWWISE_ADAM):  # upstream's KV-ZCH Adams, with their betas
        adam = table_params(config(), fused_params={"optimizer": kind, "beta1": 0.8, "beta2": 0.99})
        assert (adam.optimizer.value, adam.beta1, adam.beta2) == (kind.value, 0.8, 0.99)
    constrained = table_params(config(), fused_params={"optimizer": EmbOptimType.ADAM},
                               extras=KVZCHConstraints(beta2=0.9).extras())
    assert (constrained.beta1, constrained.beta2) == (0.9, 0.9)
    # Fused params may carry betas for the Adam tables of other sharders; a table's own are refused
    # where its optimizer never reads them.
    assert table_params(config(), fused_params={"beta1": 0.8}).optimizer.value == "exact_row_wise_adagrad"
    with pytest.raises(ValueError, match="KV-ZCH table 't': beta2 has no effect with optimizer exact_row_wise_adagrad"):
        table_params(config(), extras=KVZCHConstraints(beta2=0.9).extras())
    for fused, message in [({"weight_decay": 0.1}, "weight_decay 0.1 with weight_decay_mode none would be dropped"),
                           ({"weight_decay": 0.1, "weight_decay_mode": FbgemmMode.COUNTER},
                            r"weight_decay_mode 'COUNTER' is fbgemm's, but not supported by KV-ZCH tables: it needs "
                            "per-row counters"),
                           ({"weight_decay": 0.1, "weight_decay_mode": FbgemmMode.DECOUPLE_GLOBAL},
                            r"'DECOUPLE_GLOBAL' is fbgemm's, but not supported .*use one of none, l2, decouple$"),
                           ({"weight_decay": -1.0, "weight_decay_mode": FbgemmMode.L2}, "weight_decay must be")]:
        with pytest.raises(ValueError, match=message):
            table_params(config(), fused_params=fused)
    for key, value, message in [("output_dtype", SparseType.FP16, "output_dtype=.* is not supported"),
                                ("optimizer", EmbOptimType.LAMB, "optimizer .* is not supported"),
                                ("mystery_knob", 1, "'mystery_knob' is not understood"),
                                ("learning_rate", "0.1x", r"fused param learning_rate='0.1x' is not a number"),
                                ("beta1", None, "fused param beta1=None is not a number"),
                                ("stochastic_rounding", "False", "stochastic_rounding='False' is not a bool"),
                                ("l2_cache_size", 4, "key_value_params=KeyValueParams")]:
        with pytest.raises(ValueError, match=message):
            table_params(config(), fused_params={key: value})


def test_a_contradiction_between_config_and_kvzch_params_is_an_error():
    own = KVZCHTableParams("t", 16, num_embeddings=ROWS, total_num_buckets=BUCKETS)
    for fields, message in [(dict(data_type=DataType.FP16), "data_type is fp16, its KVZCHTableParams' weight_dtype fp32"),
                            (dict(weight_init_max=0.5), "weight_init_max is 0.5"),
                            (dict(policy=TimestampBasedEvictionPolicy(eviction_ttl_mins=3)), "declare eviction once")]:
        policy = fields.pop("policy", None)
        with pytest.raises(ValueError, match=message):
            table_params(config(policy, **fields), KVZCH_KERNEL, MEMORY, explicit=own)


# -- planning ----------------------------------------------------------------------------------
def upstream_model(policy=None):
    plain = EmbeddingBagConfig(name="plain", embedding_dim=8, num_embeddings=1000, feature_names=["f_plain"])
    return EmbeddingBagCollection(tables=[config(policy, name="user"), plain], device=torch.device("meta"))


def test_our_planner_plans_upstream_declarations_without_a_batch_size():
    topology = Topology(world_size=2, compute_device="cpu")
    for constraints in ({"user": ParameterConstraints(sharding_types=["row_wise"], compute_kernels=["dram_virtual_table"],
                                                      key_value_params=KeyValueParams())},
                        {}):  # a virtual table with no constraints at all is a KV-ZCH table too
        plan = KVZCHShardingPlanner(topology, constraints=constraints).plan(upstream_model(), kvzch_sharders()).plan[""]
        assert (plan["user"].sharding_type, plan["user"].compute_kernel) == ("row_wise", "dram_virtual_table")
        assert isinstance(plan["user"], KVZCHParameterSharding) and plan["user"].kvzch.name == "user"
        assert plan["plain"].compute_kernel == "fused"
    with pytest.raises(ValueError, match="KV-ZCH table 'user': constraint compute_kernels=\\['fused'\\]"):
        KVZCHShardingPlanner(topology, constraints={"user": ParameterConstraints(compute_kernels=["fused"])}).plan(
            upstream_model(), kvzch_sharders())
    with pytest.raises(ValueError, match="training_id_keep_count is 0"):
        KVZCHShardingPlanner(topology).plan(upstream_model(FeatureScoreBasedEvictionPolicy()), kvzch_sharders())


def test_a_module_mixing_feature_score_eviction_with_other_policies_is_refused_while_planning():
    """TorchRec feeds feature scores to every virtual table of a module once one evicts by them,
    and asserts the rest do too while sharding, naming no table: our planner refuses it first,
    naming both sides; a whole row's header of another width is refused too."""
    from torchrec_kvzch.torchrec.modules import store_plan

    scored = FeatureScoreBasedEvictionPolicy(training_id_keep_count=10)
    planner = KVZCHShardingPlanner(Topology(world_size=1, compute_device="cpu"))
    for other in (NoEvictionPolicy(), TimestampBasedEvictionPolicy(eviction_ttl_mins=5)):
        ebc = EmbeddingBagCollection(tables=[config(scored, name="scored"), config(other, name="other")],
                                     device=torch.device("meta"))
        with pytest.raises(ValueError, match=r"KV-ZCH tables \['scored'\] evict by feature score and "
                                             r"\['other'\], in the same module"):
            planner.plan(ebc, kvzch_sharders())
        with pytest.raises(ValueError, match=r"\['scored'\] evict by feature score"):  # (TorchRec's planner's plan)
            store_plan(ebc.embedding_bag_configs(), {}, None)
    planner = KVZCHShardingPlanner(Topology(world_size=1, compute_device="cpu"),
                                   constraints={"scored": ParameterConstraints(key_value_params=MEMORY)})
    plan = planner.plan(EmbeddingBagCollection(tables=[config(scored, name="scored"), config(name="none")],
                                               device=torch.device("meta")), kvzch_sharders())
    assert plan.plan[""]["none"].kvzch.eviction == EvictionPolicy()  # (no policy at all: fine)
    policy = TimestampBasedEvictionPolicy(eviction_ttl_mins=5)
    policy.meta_header_len = 3
    with pytest.raises(ValueError, match="KV-ZCH table 't': TimestampBasedEvictionPolicy.meta_header_len=3: a whole "
                                         "row's header is 16 bytes"):
        table_params(config(policy), KVZCH_KERNEL, MEMORY)


def test_kvzch_tables_inside_feature_processed_or_managed_collision_modules_are_refused():
    """Position weights would get no gradient under the row-wise sharding KV-ZCH tables take, and a
    managed-collision module would remap ids on each rank apart: both refused by name, naming the fix."""
    from torchrec.modules.feature_processor_ import PositionWeightedModule
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import (DistanceLFU_EvictionPolicy, ManagedCollisionCollection,
                                             MCHManagedCollisionModule)

    table = config(name="t")
    planner = KVZCHShardingPlanner(Topology(world_size=1, compute_device="cpu"))
    weighted = EmbeddingBagCollection(tables=[table], device=torch.device("meta"), is_weighted=True)
    fp = FeatureProcessedEmbeddingBagCollection(weighted, {"f_t": PositionWeightedModule(max_feature_length=4)})
    with pytest.raises(ValueError, match="KV-ZCH table 't' is inside a FeatureProcessedEmbeddingBagCollection; "
                                         ".*weights would never train; fix: "):
        planner.plan(fp, kvzch_sharders())
    ebc = EmbeddingBagCollection(tables=[table], device=torch.device("meta"))
    module = MCHManagedCollisionModule(zch_size=table.num_embeddings, device=torch.device("cpu"), eviction_interval=1,
                                       eviction_policy=DistanceLFU_EvictionPolicy(), input_hash_size=2**40)
    collisions = ManagedCollisionCollection({"t": module}, [table])
    mc = ManagedCollisionEmbeddingBagCollection(ebc, collisions, return_remapped_features=True)
    with pytest.raises(ValueError, match="KV-ZCH table 't' is inside a ManagedCollisionEmbeddingBagCollection; "
                                         ".*remap ids on each rank apart; fix: drop it"):
        planner.plan(mc, kvzch_sharders())


def test_torchrecs_stock_planner_takes_our_sharders():
    ordinary = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name="plain", embedding_dim=8, num_embeddings=1000, feature_names=["f"])], device=torch.device("meta"))
    plan = EmbeddingShardingPlanner(Topology(world_size=2, compute_device="cpu")).plan(ordinary, kvzch_sharders())
    assert plan.plan[""]["plain"].compute_kernel == "fused"  # never a virtual-table kernel unless asked
    # Without constraints, on CPU, it plans a use_virtual_table table as an ordinary one: refused by name.
    from torchrec_kvzch.torchrec.modules import store_plan
    model = upstream_model()
    fused = EmbeddingShardingPlanner(Topology(world_size=2, compute_device="cpu")).plan(model, kvzch_sharders())
    with pytest.raises(ValueError, match="table 'user' is declared use_virtual_table=True but planned on kernel "
                                         "'fused'.*plan it with KVZCHShardingPlanner"):
        store_plan(model.embedding_bag_configs(), fused.plan[""], None)
    # On CPU its perf estimator has no price for virtual-table kernels (KVZCHShardingPlanner adds one).
    virtual = {"user": ParameterConstraints(sharding_types=["row_wise"], compute_kernels=["dram_virtual_table"])}
    with pytest.raises(ValueError, match="unsupported compute kernel: dram_virtual_table"):
        EmbeddingShardingPlanner(Topology(world_size=2, compute_device="cpu"), constraints=virtual).plan(
            upstream_model(), kvzch_sharders())
    # On CUDA it prices virtual-table kernels itself: upstream declarations plan unchanged.
    constraints = {"user": ParameterConstraints(sharding_types=["row_wise"], compute_kernels=["dram_virtual_table"])}
    plan = EmbeddingShardingPlanner(Topology(world_size=2, compute_device="cuda"), constraints=constraints).plan(
        upstream_model(), kvzch_sharders()).plan[""]
    assert (plan["user"].sharding_type, plan["user"].compute_kernel) == ("row_wise", "dram_virtual_table")


def test_kvzch_constraints_still_plan_with_our_planner():
    own = KVZCHTableParams("user", 16, num_embeddings=ROWS, total_num_buckets=BUCKETS, expected_rows=1000)
    model = EmbeddingBagCollection(tables=[config(name="user", weight_init_min=-0.01, weight_init_max=0.01)],
                                   device=torch.device("meta"))
    plan = KVZCHShardingPlanner(Topology(world_size=2, compute_device="cpu"),
                                constraints={"user": KVZCHConstraints(kvzch=own)}).plan(model, kvzch_sharders())
    assert plan.plan[""]["user"].kvzch == own


def test_sequence_tables_are_declared_the_same_way():
    model = EmbeddingCollection(tables=[config(cls=EmbeddingConfig, name="seq")], device=torch.device("meta"))
    plan = KVZCHShardingPlanner(Topology(world_size=2, compute_device="cpu")).plan(model, kvzch_sharders())
    assert plan.plan[""]["seq"].compute_kernel == "dram_virtual_table"


# -- training: 1 and 2 ranks ---------------------------------------------------------------------
TRIGGER_ROWS = KeyValueParams(kvzch_tbe_config=KVZCHTBEConfig(kvzch_eviction_trigger_mode=4))
POLICIES = {
    "none": None,
    "timestamp": TimestampBasedEvictionPolicy(eviction_ttl_mins=1, training_id_eviction_trigger_count=20),
    "count": CountBasedEvictionPolicy(eviction_threshold=2, decay_rate=0.5, training_id_eviction_trigger_count=20),
    "mixed": CountTimestampMixedEvictionPolicy(eviction_threshold=2, decay_rate=1.0, eviction_ttl_mins=1,
                                               training_id_eviction_trigger_count=20),
    "l2": FeatureL2NormBasedEvictionPolicy(eviction_threshold=1.0, training_id_eviction_trigger_count=20),
}


class _BagsAndSequences(torch.nn.Module):
    """An EBC and an EC side by side: sums both outputs."""

    def __init__(self, configs) -> None:
        super().__init__()
        meta = torch.device("meta")
        self.ebc = EmbeddingBagCollection(tables=[c for c in configs if isinstance(c, EmbeddingBagConfig)], device=meta)
        self.ec = EmbeddingCollection(tables=[c for c in configs if isinstance(c, EmbeddingConfig)], device=meta)

    def forward(self, bags, sequences):
        return self.ebc(bags).values().sum() + sum(j.values().float().sum() for j in self.ec(sequences).values())


def _dmp(rank, world, configs, constraints, fused):
    from _dist import sharded

    if all(isinstance(c, EmbeddingBagConfig) for c in configs):
        return sharded(EmbeddingBagCollection(tables=configs, device=torch.device("meta")), constraints, fused)
    return sharded(_BagsAndSequences(configs), constraints, fused)


def _batch(rank, step, keys, weights=None):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(1000 * step + rank)
    # 4 examples x 2 ids per key, out of 64 ids spread over every bucket (so every rank's shard)
    ids = [torch.randint(0, 64, (8,), generator=gen) * (ROWS // 64) for _ in keys]
    return KeyedJaggedTensor(keys=keys, values=torch.cat(ids), lengths=torch.full((4 * len(keys),), 2),
                             weights=weights)


def _rows(dmp, name):
    from torchrec_kvzch.torchrec.tables import kvzch_tables

    tbe = dict(kvzch_tables(dmp))[name]
    store = tbe.store
    ids = store.keys().clone()
    order = torch.argsort(ids)
    return tbe, ids[order], store.weights[: len(store)][order].clone()


def train_declared(rank, world, policy_name):
    """The upstream declaration of KV-ZCH tables (pooled and sequence) trains; their fields and
    policy are honoured."""
    now = [0.0]
    policy = POLICIES[policy_name]
    user = config(policy, name="user", weight_init_min=-0.5, weight_init_max=0.5)
    seq = config(policy, cls=EmbeddingConfig, name="seq", data_type=DataType.FP16)
    constraints = {name: ParameterConstraints(sharding_types=["row_wise"], compute_kernels=[kernel],
                                              key_value_params=TRIGGER_ROWS)
                   for name, kernel in (("user", "dram_virtual_table"), ("seq", "ssd_virtual_table"))}
    dmp = _dmp(rank, world, [user, seq], constraints,
               {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1})
    for name in ("user", "seq"):
        _rows(dmp, name)[0].store.evictor.time_source = lambda: now[0]
    for step in range(12):
        now[0] = 60.0 * step  # a minute a step: rows older than a step pass a 1-minute TTL
        dmp(_batch(rank, step, ["f_user"]), _batch(rank, step, ["f_seq"])).backward()
    results = {}
    for name in ("user", "seq"):
        tbe, ids, weights = _rows(dmp, name)
        params = tbe.params
        results[name] = dict(
            eviction=params.eviction.kind.value, optimizer=params.optimizer.value, lr=params.learning_rate,
            init=params.init_range, whole=params.backend_return_whole_row, dtype=weights.dtype,
            evicted=tbe.store.history.evicted, dim=weights.shape[1],
            fresh=tbe.store.peek(tbe.store.bucket_range.id_start + 1 + torch.arange(1000)).abs().max().item())
    return results


@pytest.mark.parametrize("world", [1, 2])
def test_upstream_policies_train_on_one_and_two_ranks(pools, world):
    kinds = {"none": "none", "timestamp": "ttl", "count": "lfu", "mixed": "lfu", "l2": "l2"}
    fp16_init = (-0.001, 0.001)  # TorchRec's default for fp16 virtual tables
    for name, kind in kinds.items():
        for result in pools[world].run(train_declared, name):
            user, seq = result["user"], result["seq"]
            for table in (user, seq):
                assert (table["eviction"], table["optimizer"], table["lr"]) == (kind, "exact_sgd", 0.1)
                # Passes start past 20 rows a shard: every policy but none drops rows (64 ids seen).
                assert (table["evicted"] > 0) == (name != "none"), (name, table)
            assert user["init"] == (-0.5, 0.5) and user["whole"] and user["dtype"] == torch.float32
            assert seq["init"] == fp16_init and not seq["whole"] and seq["dtype"] == torch.float16
            # New rows start in the declared range, and fill it.
            assert 0.45 < user["fresh"] <= 0.5 and 0.0009 < seq["fresh"] <= 0.00101  # (fp16 rounding)
            assert user["dim"] == seq["dim"] == 16


def train_twins(rank, world):
    """An upstream-declared table and the same table declared natively train bit for bit alike;
    per-sample weights on an unweighted module never scale KV-ZCH outputs; lr = 0 freezes rows
    and a LambdaLR warm-up scales SGD updates."""
    upstream = config(name="user", weight_init_min=-0.5, weight_init_max=0.5, data_type=DataType.FP16)
    native = KVZCHTableParams("user", 16, num_embeddings=ROWS, total_num_buckets=BUCKETS, weight_dtype="fp16",
                              init_range=(-0.5, 0.5), enable_optimizer_offloading=True,
                              backend_return_whole_row=True)
    from torchrec_kvzch.torchrec import kvzch_embedding_bag_config

    fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}
    a = _dmp(rank, world, [upstream], {}, fused)
    b = _dmp(rank, world, [kvzch_embedding_bag_config(native, ["f_user"])],
             {"user": KVZCHConstraints(kvzch=native)}, fused)
    out = []
    for step in range(4):
        oa, ob = (m(_batch(rank, step, ["f_user"])).wait().values() for m in (a, b))
        oa.sum().backward(), ob.sum().backward()
        out.append(torch.equal(oa, ob))
    (_, ids_a, rows_a), (_, ids_b, rows_b) = _rows(a, "user"), _rows(b, "user")
    same = all(out) and torch.equal(ids_a, ids_b) and torch.equal(rows_a.view(torch.int16), rows_b.view(torch.int16))
    assert rows_a.dtype == torch.float16

    with torch.no_grad():  # feature scores on the batch (an unweighted module): never a factor
        plain = a(_batch(rank, 9, ["f_user"])).wait().values()
        scored = a(_batch(rank, 9, ["f_user"], weights=torch.full((8,), 0.25))).wait().values()
    unscaled = torch.equal(plain, scored)

    def step_moves(batch):
        """The largest move of a row that existed before a training step on ``batch``."""
        _, ids, before = _rows(a, "user")
        a(batch).wait().values().sum().backward()
        _, ids_after, after = _rows(a, "user")
        kept = torch.isin(ids_after, ids)  # the step may add rows; none is evicted here
        return (before.float() - after[kept].float()).abs().max().item()

    opt = a.fused_optimizer
    for group in opt.param_groups:
        group["lr"] = 0.0
    opt.zero_grad()  # (where TorchRec's fused optimizers apply a changed lr)
    batch = _batch(rank, 3, ["f_user"])  # ids seen before: their rows exist
    frozen = step_moves(batch) == 0.0
    for group in opt.param_groups:
        group["lr"] = 0.1
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)  # warm-up at half the rate
    opt.zero_grad()
    delta = step_moves(batch)
    scheduler.step()
    return dict(same=same, unscaled=unscaled, frozen=frozen, delta=delta, lrs=[g["lr"] for g in opt.param_groups])


def lr_per_update(rank, world, loop):
    """SGD on one id of a KV-ZCH table and of an ordinary FUSED table in one EBC, with a halving
    LambdaLR stepped after each update: each table's lr per update (its row's move)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_kvzch.torchrec.tables import kvzch_tables

    kv = config(name="user")
    plain = EmbeddingBagConfig(name="plain", embedding_dim=16, num_embeddings=10, feature_names=["f_plain"])
    model = _dmp(rank, world, [kv, plain], {"plain": ParameterConstraints(sharding_types=["row_wise"],
                                                                          compute_kernels=["fused"])},
                 {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 1.0})
    opt = model.fused_optimizer
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5 ** epoch)
    batch = KeyedJaggedTensor(keys=["f_user", "f_plain"], values=torch.tensor([5, 3]),
                              lengths=torch.tensor([1, 1]))
    [(_, tbe)] = kvzch_tables(model)

    def rows():  # (id 5 of the KV-ZCH table, id 3 of the ordinary one)
        plain_rows = model.state_dict()["embedding_bags.plain.weight"].local_shards()[0].tensor
        return tbe.store.read_ids(torch.tensor([5]))[0].clone(), plain_rows[3].clone()

    moves = []
    for _ in range(4):
        if loop == "zero_grad first":
            opt.zero_grad()
        out = model(batch).wait().values()
        before = rows()
        out.sum().backward()
        moves.append(tuple(float((b - a).mean()) for b, a in zip(before, rows())))
        opt.step()
        if loop == "zero_grad last":
            opt.zero_grad()
        scheduler.step()
    return moves


@pytest.mark.parametrize("loop", ["zero_grad first", "zero_grad last"])
def test_lr_changes_reach_kvzch_and_ordinary_tables_at_the_same_update(pools, loop):
    """TorchRec's fused optimizers apply a changed lr at zero_grad() or step(): ours too."""
    [moves] = pools[1].run(lr_per_update, loop)
    assert all(kv == pytest.approx(plain) for kv, plain in moves), moves
    assert [kv for kv, _ in moves] == pytest.approx([1.0, 0.5, 0.25, 0.125] if loop == "zero_grad first"
                                                    else [1.0, 1.0, 0.5, 0.25])


@pytest.mark.parametrize("world", [1, 2])
def test_upstream_and_native_declarations_train_alike_and_follow_the_lr(pools, world):
    for result in pools[world].run(train_twins):
        assert result["same"] and result["unscaled"] and result["frozen"], result
        # SUM pooling of a summed loss: each id's gradient is its count, divided by the world
        # size (TorchRec's gradient division); at lr 0.05 a row moves by 0.05 x count / world,
        # up to fp16 rounding.
        unit = 0.05 / world
        assert result["delta"] == pytest.approx(unit * round(result["delta"] / unit), abs=2e-3)
        assert result["delta"] >= unit - 2e-3 and result["lrs"] == [0.05]


def save_declared(rank, world, root):
    """Train an upstream-declared model (pooled and sequence KV-ZCH tables),
    lower its learning rate, and checkpoint it; returns its rows by table."""
    from torchrec_kvzch.checkpoint.manager import CheckpointManager

    model = _upstream_job_model(rank, world)
    for step in range(3):
        model(_batch(rank, step, ["f_user"]), _batch(rank, step, ["f_seq"])).backward()
    for group in model.fused_optimizer.param_groups:
        group["lr"] = 0.05
    model.fused_optimizer.save_param_groups(True)  # TorchRec's switch: saves lr and eps too
    CheckpointManager(root).save({"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}, 3)
    return {name: _rows(model, name)[1:] for name in ("user", "seq")}


def load_declared(rank, world, root):
    from torchrec_kvzch.checkpoint.manager import CheckpointManager

    model = _upstream_job_model(rank, world)
    model.fused_optimizer.save_param_groups(True)
    state = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
    assert CheckpointManager(root).load(state) == 3
    model.load_state_dict(state["model"])
    model.fused_optimizer.load_state_dict(state["optim"])
    rows = {name: _rows(model, name)[1:] for name in ("user", "seq")}
    model.fused_optimizer.zero_grad()  # (a training loop's: the loaded lr reaches the tables)
    model(_batch(rank, 3, ["f_user"]), _batch(rank, 3, ["f_seq"])).backward()
    used = {_rows(model, name)[0].tbe.get_learning_rate() for name in ("user", "seq")}
    return rows, sorted({g["lr"] for g in model.fused_optimizer.param_groups} | used)


def _upstream_job_model(rank, world):
    user = config(TimestampBasedEvictionPolicy(eviction_ttl_mins=60), name="user")
    seq = config(cls=EmbeddingConfig, name="seq", data_type=DataType.FP16)
    constraints = {"user": ParameterConstraints(compute_kernels=["dram_virtual_table"], key_value_params=MEMORY),
                   "seq": ParameterConstraints(compute_kernels=["ssd_virtual_table"])}
    return _dmp(rank, world, [user, seq], constraints,
                {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1})


def test_an_upstream_declared_model_checkpoints_and_resumes_at_another_world_size(pools, tmp_path):
    saved = pools[2].run(save_declared, str(tmp_path))
    [(loaded, lrs)] = pools[1].run(load_declared, str(tmp_path))
    for name in ("user", "seq"):
        ids = torch.cat([rank[name][0] for rank in saved])
        rows = torch.cat([rank[name][1] for rank in saved])
        order = torch.argsort(ids)
        assert torch.equal(loaded[name][0], ids[order])
        assert torch.equal(loaded[name][1].view(torch.int16 if rows.dtype == torch.float16 else torch.int32),
                           rows[order].view(torch.int16 if rows.dtype == torch.float16 else torch.int32))
    # The learning rate set before the save came back with the optimizer state, and trains.
    assert lrs and all(lr == pytest.approx(0.05) for lr in lrs)  # (fbgemm keeps it in fp32)
