"""A table declared the TorchRec way takes the plugin's extras (an lru budget, admission,
expected_rows...) from its KVZCHConstraints alone, merged into what its config declares; and a
table's own stochastic_rounding constraint is honoured (TorchRec's per-table field)."""

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.types import KeyValueParams, ParameterSharding
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, TimestampBasedEvictionPolicy
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from _dist import run_ranks
from torchrec_kvzch import AdmissionPolicy, EvictionPolicy, KVZCHConstraints, KVZCHTableParams
from torchrec_kvzch.torchrec import KVZCHShardingPlanner, kvzch_sharders
from torchrec_kvzch.torchrec.modules import store_plan

ROWS, BUCKETS = 2**20, 64  # the config's 64 buckets, not KVZCHTableParams' default 1,024
FUSED = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.05, "eps": 0.01}


def config(policy=None, name="user", **fields):
    return EmbeddingBagConfig(name=name, embedding_dim=16, num_embeddings=ROWS, feature_names=[f"f_{name}"],
                              use_virtual_table=True, total_num_buckets=BUCKETS,
                              virtual_table_eviction_policy=policy, **fields)


def planned(constraints, policy=None, fused=FUSED, **fields):
    ebc = EmbeddingBagCollection(tables=[config(policy, **fields)], device=torch.device("meta"))
    planner = KVZCHShardingPlanner(Topology(world_size=2, compute_device="cpu"), constraints={"user": constraints})
    return planner.plan(ebc, kvzch_sharders(fused)).plan[""]["user"].kvzch


def test_extras_alone_merge_into_the_torchrec_declaration():
    lru = EvictionPolicy(kind="lru", max_rows=100)
    admission = AdmissionPolicy("count", min_count=2)
    params = planned(KVZCHConstraints(compute_kernels=["dram_virtual_table"], expected_rows=5000,
                                      eviction=lru, admission=admission, learning_rate=0.2))
    # The shape comes from the config, the extras from the constraints, the rest from the sharders.
    assert (params.name, params.embedding_dim, params.num_embeddings, params.total_num_buckets) == (
        "user", 16, ROWS, BUCKETS)
    assert (params.expected_rows, params.eviction, params.admission) == (5000, lru.validate("user"),
                                                                         admission.validate("user"))
    assert (params.optimizer.value, params.learning_rate, params.eps) == ("exact_sgd", 0.2, 0.01)
    assert params.enable_optimizer_offloading and params.backend_return_whole_row  # as the kernel says
    # No extras at all: the TorchRec declaration as it is.
    assert planned(KVZCHConstraints()).expected_rows == KVZCHTableParams("x", 4).expected_rows


def test_conflicting_or_bad_extras_are_refused_by_name():
    ttl = TimestampBasedEvictionPolicy(eviction_ttl_mins=60)
    with pytest.raises(ValueError, match="KV-ZCH table 'user': eviction is declared twice: the config's "
                                         "virtual_table_eviction_policy .* fix: declare it once"):
        planned(KVZCHConstraints(key_value_params=KeyValueParams(l2_cache_size=4),
                                 eviction=EvictionPolicy(kind="lru", max_rows=100)), ttl)
    own = KVZCHTableParams("user", 16, num_embeddings=ROWS, total_num_buckets=BUCKETS)
    with pytest.raises(ValueError, match=r"KV-ZCH table 'user': its KVZCHConstraints give kvzch=.* and "
                                         r"\['expected_rows'\] too; fix: give either kvzch="):
        planned(KVZCHConstraints(kvzch=own, expected_rows=10))
    with pytest.raises(ValueError, match="KV-ZCH table 'user': expected_rows must be a positive integer"):
        planned(KVZCHConstraints(expected_rows=-1))


def test_a_tables_stochastic_rounding_constraint_beats_the_sharders():
    fused = {**FUSED, "stochastic_rounding": True}
    assert not planned(ParameterConstraints(stochastic_rounding=False), fused=fused,
                       data_type=DataType.FP16).stochastic_rounding
    # Planned elsewhere (TorchRec's planner puts it in the ParameterSharding): the sharder reads it.
    sharding = ParameterSharding(sharding_type="row_wise", compute_kernel="dram_virtual_table", ranks=[0],
                                 stochastic_rounding=False)
    [(name, kept)] = store_plan([config(data_type=DataType.FP16)], {"user": sharding}, fused).items()
    assert not kept.kvzch.stochastic_rounding


def test_a_tables_own_kernel_settings_are_checked_like_the_sharders():
    """TorchRec hands a table's own output_dtype / stochastic_rounding to its kernel as fused
    params: one our kernel cannot honour is refused, not dropped, and a constraint may not
    contradict the table's KVZCHTableParams."""
    with pytest.raises(ValueError, match="KV-ZCH table 'user': fused param output_dtype='FP16' is not supported"):
        planned(ParameterConstraints(output_dtype=DataType.FP16))
    sharding = ParameterSharding(sharding_type="row_wise", compute_kernel="dram_virtual_table", ranks=[0],
                                 output_dtype=DataType.FP16)
    with pytest.raises(ValueError, match="KV-ZCH table 'user': fused param output_dtype='FP16'"):
        store_plan([config()], {"user": sharding}, FUSED)
    assert planned(ParameterConstraints(output_dtype=DataType.FP32)).name == "user"
    own = KVZCHTableParams("user", 16, num_embeddings=ROWS, total_num_buckets=BUCKETS, weight_dtype="fp16",
                           stochastic_rounding=True)
    with pytest.raises(ValueError, match="KV-ZCH table 'user': its constraints.*set stochastic_rounding=False, "
                                         "its KVZCHTableParams True; fix: declare it once"):
        planned(KVZCHConstraints(kvzch=own, stochastic_rounding=False), data_type=DataType.FP16)
    assert planned(KVZCHConstraints(kvzch=own, stochastic_rounding=True), data_type=DataType.FP16).stochastic_rounding
    unset = KVZCHTableParams("user", 16, num_embeddings=ROWS, total_num_buckets=BUCKETS, weight_dtype="fp16")
    assert not planned(KVZCHConstraints(kvzch=unset, stochastic_rounding=False),
                       data_type=DataType.FP16).stochastic_rounding  # (the table left it to its declaration)


def train_with_extras(rank, world):
    from _dist import sharded
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    from torchrec_kvzch import kvzch_tables

    ebc = EmbeddingBagCollection(tables=[config(name="user"), config(name="item")], device=torch.device("meta"))
    constraints = {"user": KVZCHConstraints(eviction=EvictionPolicy(kind="lru", max_rows=50)),
                   "item": KVZCHConstraints(expected_rows=40_000)}
    model = sharded(ebc, constraints, {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1})
    for step in range(4):
        ids = torch.arange(200) * (ROWS // 200) + step
        model(KeyedJaggedTensor(keys=["f_user", "f_item"], values=torch.cat([ids, ids]),
                                lengths=torch.ones(400, dtype=torch.long))).wait().values().sum().backward()
    tables = dict(kvzch_tables(model))
    user, item = tables["user"].store, tables["item"].store
    return user.params.eviction.kind.value, user.history.evicted > 0, item.capacity >= 40_000 // world


def test_extras_reach_the_stores_on_two_ranks():
    assert run_ranks(2, train_with_extras) == [("lru", True, True)] * 2


def _with_optimizer_in_backward(optimizer_class, kwargs, constraints=None, fused=FUSED):
    """The planner's and the sharders' parameters of a table whose weight has ``optimizer_class``
    applied in backward (TorchRec's ``apply_optimizer_in_backward``), beside one that has none."""
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    ebc = EmbeddingBagCollection(tables=[config(), config(name="item")], device=torch.device("meta"))
    apply_optimizer_in_backward(optimizer_class, [ebc.embedding_bags["user"].weight], kwargs)
    planner = KVZCHShardingPlanner(Topology(world_size=2, compute_device="cpu"), constraints=constraints)
    plan = planner.plan(ebc, kvzch_sharders(fused)).plan[""]
    from torchrec_kvzch.torchrec.in_backward import in_backward_params

    shards = store_plan(ebc.embedding_bag_configs(), plan, fused, in_backward=in_backward_params(ebc, "embedding_bags"))
    return plan, shards


def test_an_optimizer_applied_in_backward_trains_its_table_as_in_torchrec():
    """TorchRec takes the optimizer applied in backward to a table's weight as that table's fused
    params over the sharders' (its ``embeddingbag.py``): the planner and the sharders read it the
    same way; one with no kernel counterpart, a kwarg the kernels do not take, or one that
    contradicts the table's own KVZCHTableParams is refused by name."""
    from torchrec.optim import RowWiseAdagrad

    from torchrec_kvzch.torchrec.in_backward import in_backward_params

    plan, shards = _with_optimizer_in_backward(torch.optim.SGD, {"lr": 0.5})
    for got in (plan, shards):
        assert (got["user"].kvzch.optimizer.value, got["user"].kvzch.learning_rate) == ("exact_sgd", 0.5)
        assert (got["item"].kvzch.optimizer.value, got["item"].kvzch.learning_rate) == ("exact_sgd", 0.05)
    plan, _ = _with_optimizer_in_backward(RowWiseAdagrad, {"lr": 0.3, "eps": 1e-6})
    assert (plan["user"].kvzch.optimizer.value, plan["user"].kvzch.learning_rate, plan["user"].kvzch.eps) == (
        "exact_row_wise_adagrad", 0.3, 1e-6)
    with pytest.raises(ValueError, match="KV-ZCH table 'user': optimizer 'exact_adagrad' is not supported"):
        _with_optimizer_in_backward(torch.optim.Adagrad, {"lr": 0.1})
    with pytest.raises(ValueError, match=r"KV-ZCH table 'user': the optimizer applied in backward .* sets "
                                         r"\['momentum'\], which fbgemm's embedding kernels"):
        _with_optimizer_in_backward(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
    own = KVZCHTableParams("user", 16, num_embeddings=ROWS, total_num_buckets=BUCKETS, optimizer="exact_sgd",
                           learning_rate=0.2)
    with pytest.raises(ValueError, match="KV-ZCH table 'user': its constraints, sharding or optimizer in backward "
                                         "set learning_rate=0.5, its KVZCHTableParams 0.2; fix: declare it once"):
        _with_optimizer_in_backward(torch.optim.SGD, {"lr": 0.5}, {"user": KVZCHConstraints(kvzch=own)})

    class Lion(torch.optim.SGD):  # (an optimizer TorchRec has no embedding kernel for)
        pass

    ebc = EmbeddingBagCollection(tables=[config()], device=torch.device("meta"))
    ebc.embedding_bags["user"].weight._optimizer_classes, ebc.embedding_bags["user"].weight._optimizer_kwargs = [Lion], [{}]
    with pytest.raises(ValueError, match="KV-ZCH table 'user': the optimizer applied in backward to its weight, "
                                         ".*Lion, has no embedding-kernel counterpart"):
        in_backward_params(ebc, "embedding_bags")
