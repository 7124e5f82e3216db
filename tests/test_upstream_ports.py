"""TorchRec's own KV-ZCH tests, ported to CPU/gloo with our sharders and planner swapped in.

Question these answer: can a user who follows TorchRec's KV-ZCH API (tables declared with
``use_virtual_table=True`` / ``total_num_buckets``, planner constraints naming the
``dram_virtual_table`` / ``ssd_virtual_table`` kernels, the sharders' ``fused_params``) swap in
``kvzch_sharders`` and ``KVZCHShardingPlanner`` and change nothing else?

Source: meta-pytorch/torchrec, branch release/v1.8.0 at e2a8e5b8 (the 1.8.0 release; its
``torchrec/distributed/test_utils`` is byte-identical to the installed torchrec 1.8.0 wheel).
Upstream files (not in the wheel):
  torchrec/distributed/tests/test_model_parallel_nccl_ssd_single_gpu.py
  torchrec/distributed/tests/test_sequence_model.py          (TestSequenceSparseNN)
  torchrec/distributed/planner/tests/test_planners.py
  torchrec/distributed/planner/tests/test_enumerators.py

What every port changes, and nothing more:
* environment: device cuda:0 -> cpu, backend nccl -> gloo, one process -> WORLD gloo ranks
  (``tests/_dist.py``); upstream's ``@skipIf(not cuda)`` dropped;
* planner: ``EmbeddingShardingPlanner(...)`` -> ``KVZCHShardingPlanner(...)``, same arguments;
* sharders: upstream's test sharders (``create_test_sharder`` / ``TestEmbeddingCollectionSharder``
  / ``EmbeddingCollectionSharder()``) -> ``kvzch_sharders(fused_params=<the same dict>)``. The
  test sharders also restricted sharding type and kernel; where upstream's constraints did not
  already say so (the FUSED twin of the numerical-accuracy tests) that restriction is given as
  ``ParameterConstraints(sharding_types=[...], compute_kernels=[...])`` instead;
* hypothesis ``@given`` -> ``pytest.mark.parametrize`` over kernel and data type (and
  ``stochastic_rounding`` where fp16 then compares exactly), with ``is_training=True`` and
  otherwise ``stochastic_rounding=True`` (the draws that exercise the most: a training step, and
  fp16 compared within upstream's tolerances);
* upstream's ``TestSequenceSparseNN`` -> ``SequenceSparseNN`` from ``tests/_sequence_model.py``,
  our own stand-in with the same constructor, ``sparse.ec`` and forward contract (the wheel lacks
  upstream's test_sequence_model.py);
* upstream's copy helpers pick "the KV-ZCH emb modules" by ``type(m) in
  {ZeroCollisionKeyValueEmbeddingBag, ZeroCollisionKeyValueEmbedding}``; with other sharders
  that would silently copy nothing, so here they pick the emb modules whose tables are
  virtual tables and then call exactly upstream's methods on them.
The base-class helpers (``_train_models``, ``_eval_models``, ``_compare_models``,
``_set_table_weights_precision``) are TorchRec's own, from the installed wheel.
"""

from __future__ import annotations

import copy
import functools
import os
import sys
import threading
import types
from typing import Dict, List, Optional, cast
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import distributed as trec_dist
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.planner.proposers import EmbeddingOffloadScaleupProposer
from torchrec.distributed.planner.stats import EmbeddingStats
from torchrec.distributed.planner.types import Storage
from torchrec.distributed.test_utils import test_model as tm

# The wheel's test_utils/test_sharding.py (imported by test_model_parallel_base) imports
# torchrec.distributed.tests.test_sequence_model, which the wheel does not ship: register our
# stand-in under that name first (also in the spawned ranks, which import this file).
import _sequence_model  # noqa: E402

if "torchrec.distributed.tests.test_sequence_model" not in sys.modules:
    _tests_pkg = types.ModuleType("torchrec.distributed.tests")
    _tests_pkg.__path__ = []
    _tests_pkg.test_sequence_model = _sequence_model
    sys.modules.setdefault("torchrec.distributed.tests", _tests_pkg)
    sys.modules["torchrec.distributed.tests.test_sequence_model"] = _sequence_model

from torchrec.distributed.test_utils import test_model_parallel_base as tmpb  # noqa: E402
from torchrec.distributed.types import (
    CacheAlgorithm,
    CacheParams,
    EmbeddingModuleShardingPlan,
    KeyValueParams,
    ModuleSharder,
    ShardingEnv,
    ShardingType,
)
from torchrec.modules.embedding_configs import (
    DataType,
    EmbeddingBagConfig,
    EmbeddingConfig,
    NoEvictionPolicy,
)
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from _dist import RankPools
from torchrec_kvzch.torchrec import KVZCHShardingPlanner, kvzch_sharders

WORLD = 2
SSD = EmbeddingComputeKernel.SSD_VIRTUAL_TABLE.value
DRAM = EmbeddingComputeKernel.DRAM_VIRTUAL_TABLE.value
FUSED = EmbeddingComputeKernel.FUSED.value
ROW_WISE = ShardingType.ROW_WISE.value
DTYPES = [pytest.param(DataType.FP32, id="fp32"), pytest.param(DataType.FP16, id="fp16")]


# -- running on gloo ranks ------------------------------------------------------------------------
_POOLS = RankPools(timeout=300)


def _guarded(rank, world_size, fn, *args):
    """Runs a port on one rank. A failing rank leaves its peer waiting in a collective (e.g.
    the planner's broadcast from rank 0), so after reporting it exits: the peer's gloo call
    then fails at once instead of waiting out the pool's timeout (and the next port starts a
    fresh pool)."""
    try:
        return fn(rank, world_size, *args)
    except BaseException:
        threading.Timer(2.0, os._exit, (1,)).start()
        raise


def _run(fn, *args, world: int = WORLD) -> list:
    return _POOLS[world].run(_guarded, fn, *args)


@pytest.fixture(scope="module", autouse=True)
def _close_pools():
    yield
    _POOLS.close()


# -- the single-rank base, on the current gloo WORLD ---------------------------------------------
class _Base(tmpb.ModelParallelSingleRankBase):
    """TorchRec's ``ModelParallelSingleRankBase`` without its ``setUp`` (which creates a
    one-process NCCL group): the group is the pool's gloo WORLD, the device is cpu."""

    __test__ = False

    def __init__(self) -> None:
        super().__init__()  # unittest's "runTest" default: no test method needed
        self.backend = "gloo"
        self.device = torch.device("cpu")
        self.batch_size = 20
        self.num_float_features = 10
        self.tables = []
        self.weighted_tables = []
        self._create_tables()

    def _generate_dmps_and_batch(
        self,
        sharders: Optional[List[ModuleSharder[nn.Module]]] = None,
        constraints: Optional[Dict[str, ParameterConstraints]] = None,
    ):
        """Upstream's, with ``EmbeddingShardingPlanner`` -> ``KVZCHShardingPlanner`` and the
        default sharders -> ``kvzch_sharders()``."""
        if constraints is None:
            constraints = {}
        if sharders is None:
            sharders = kvzch_sharders()
        batch = self._generate_batch()
        dmps = []
        pg = dist.GroupMember.WORLD
        assert pg is not None, "Process group is not initialized"
        env = ShardingEnv.from_process_group(pg)
        planner = KVZCHShardingPlanner(
            topology=Topology(
                local_world_size=trec_dist.comm.get_local_size(env.world_size),
                world_size=env.world_size,
                compute_device=self.device.type,
                ssd_cap=2 * 1024**4,
            ),
            constraints=constraints,
        )
        for _ in range(2):
            m = self._create_model()
            plan = planner.collective_plan(m, sharders, pg)
            dmp = DistributedModelParallel(
                module=m, init_data_parallel=False, device=self.device, sharders=sharders, plan=plan)
            with torch.no_grad():
                dmp(batch)
                dmp.init_data_parallel()
            dmps.append(dmp)
        return dmps, batch


def _serves_virtual_tables(emb_module: nn.Module) -> bool:
    config = getattr(emb_module, "config", None)
    return config is not None and any(
        getattr(t, "use_virtual_table", False) for t in config.embedding_tables)


def _copy_kv_emb_modules(lookups1, lookups2, reset_split_weights: bool) -> None:
    """Upstream's ``_copy_ssd_emb_modules``: same plan on both models; every KV-ZCH row of m1
    (ids from its ``weight_id`` shard, values by ``get_weights_by_ids``) is written into m2
    with ``set_weights_and_ids``; then both modules are purged."""
    for lookup1, lookup2 in zip(lookups1, lookups2):
        for emb_module1, emb_module2 in zip(lookup1._emb_modules, lookup2._emb_modules):
            if not _serves_virtual_tables(emb_module1):
                continue
            assert type(emb_module1) is type(emb_module2)
            emb_module1.flush()
            emb_module2.flush()
            emb1_kv = {
                t: (sharded_t, sharded_w_id, bucket, metadata)
                for t, sharded_t, sharded_w_id, bucket, metadata
                in emb_module1.get_named_split_embedding_weights_snapshot()
            }
            for t, sharded_t2, _, _, _ in emb_module2.get_named_split_embedding_weights_snapshot():
                assert t in emb1_kv
                sharded_t1, sharded_w1_id = emb1_kv[t][0], emb1_kv[t][1]
                w1_id = sharded_w1_id.local_shards()[0].tensor
                pmt1 = sharded_t1.local_shards()[0].tensor
                w1 = pmt1.get_weights_by_ids(w1_id)
                pmt2 = sharded_t2.local_shards()[0].tensor
                pmt2.wrapped.set_weights_and_ids(w1, w1_id.view(-1))
            if reset_split_weights:  # the sequence test forces the next read from the backend
                emb_module1._split_weights_res = None
                emb_module2._split_weights_res = None
            emb_module1.purge()
            emb_module2.purge()


def _copy_fused_into_kv_emb_modules(fused_lookups, kv_lookups) -> None:
    """Upstream's ``_copy_fused_modules_into_ssd_emb_modules``: each KV-ZCH table's shard is
    filled from the FUSED twin's shard with ``pmt.wrapped.set_range(0, 0, rows, weight)``."""
    for fused_lookup, kv_lookup in zip(fused_lookups, kv_lookups):
        for fused_emb_module, kv_emb_module in zip(fused_lookup._emb_modules, kv_lookup._emb_modules):
            if not _serves_virtual_tables(kv_emb_module):
                continue
            fused_state_dict = fused_emb_module.state_dict()
            for t, sharded_t, _, _, _ in kv_emb_module.get_named_split_embedding_weights_snapshot():
                fused_weight = fused_state_dict[f"{t}.weight"].local_shards()[0].tensor.to("cpu")
                pmt = sharded_t.local_shards()[0].tensor
                pmt.wrapped.set_range(0, 0, fused_weight.size(0), fused_weight)
            fused_emb_module.purge()
            kv_emb_module.purge()


# -- ZeroCollisionModelParallelTest (EBC) ----------------------------------------------------------
def _virtual_table(cls, rows: int, dim: int, name: str, feature: str):
    """A table as upstream's ZCH tests declare theirs: a virtual table of 10 buckets, no eviction."""
    return cls(num_embeddings=rows, embedding_dim=dim, name=name, feature_names=[feature],
               total_num_buckets=10, use_virtual_table=True,
               virtual_table_eviction_policy=NoEvictionPolicy())


class _ZeroCollision(_Base):
    def _create_tables(self) -> None:
        num_features = 4
        self.tables += [_virtual_table(EmbeddingBagConfig, (i + 1) * 1000, 256, f"table_{i}", f"feature_{i}")
                        for i in range(num_features)]


def _ebc_lookups(m):
    return m.module.sparse.ebc._lookups


def _rank_kv_zch_load_state_dict(rank, world, kernel_type, dtype, is_training, stochastic_rounding):
    t = _ZeroCollision()
    t._set_table_weights_precision(dtype)
    fused_params = {"learning_rate": 0.1, "stochastic_rounding": stochastic_rounding}
    is_deterministic = dtype == DataType.FP32
    constraints = {
        table.name: ParameterConstraints(sharding_types=[ROW_WISE], compute_kernels=[kernel_type])
        for table in t.tables
    }
    sharders = kvzch_sharders(fused_params=fused_params)
    (m1, m2), batch = t._generate_dmps_and_batch(sharders, constraints=constraints)
    m2.load_state_dict(m1.state_dict())  # dense modules
    _copy_kv_emb_modules(_ebc_lookups(m1), _ebc_lookups(m2), reset_split_weights=False)
    if is_training:
        t._train_models(m1, m2, batch)
    t._eval_models(m1, m2, batch, is_deterministic=is_deterministic, tolerance=1e-2)
    compare = functools.partial(t._compare_models, m1, m2, is_deterministic=is_deterministic,
                                use_virtual_table=True, tolerance=1e-2)
    if kernel_type == DRAM and dtype == DataType.FP16:
        # Whole fp16 rows carry the header and the fp32 optimizer state as fp16 bit patterns,
        # some of which read as NaN; upstream's assert_close calls would fail on equal bits
        # (its hypothesis draws rarely pick this case). Compared with NaN == NaN here.
        with mock.patch.object(torch.testing, "assert_close",
                               functools.partial(torch.testing.assert_close, equal_nan=True)):
            compare()
    else:
        compare()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel_type", [SSD, DRAM])
def test_kv_zch_load_state_dict(kernel_type, dtype):
    """Port of test_model_parallel_nccl_ssd_single_gpu.py::ZeroCollisionModelParallelTest::
    test_kv_zch_load_state_dict. Two DMPs of TestSparseNN (4 EBC virtual tables, dim 256,
    10 buckets, NoEvictionPolicy), row-wise on the given kernel; m2 gets m1's dense state and
    m1's KV-ZCH rows (weight_id / get_weights_by_ids / set_weights_and_ids); one training step
    each; eval outputs equal; state dicts equal (KV rows compared by sorted weight_id).
    Swapped: cuda->cpu, nccl->gloo on 2 ranks, create_test_sharder(EBC, row_wise, tbe,
    fused_params) -> kvzch_sharders(fused_params), EmbeddingShardingPlanner -> ours."""
    _run(_rank_kv_zch_load_state_dict, kernel_type, dtype, True, True)


def _rank_kv_zch_numerical_accuracy(rank, world, kernel_type, dtype, is_training, stochastic_rounding,
                                    sequence):
    t = _ZeroCollisionSequence() if sequence else _ZeroCollision()
    lookups = _ec_lookups if sequence else _ebc_lookups
    t._set_table_weights_precision(dtype)
    fused_params = {
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        "learning_rate": 0.1,
        "stochastic_rounding": stochastic_rounding,
    }
    is_deterministic = dtype == DataType.FP32 or not stochastic_rounding
    fused_sharders = kvzch_sharders(fused_params=dict(fused_params))
    kv_sharders = kvzch_sharders(fused_params=dict(fused_params))
    kv_constraints = {
        table.name: ParameterConstraints(sharding_types=[ROW_WISE], compute_kernels=[kernel_type])
        for table in t.tables
    }
    # What upstream's create_test_sharder(..., FUSED) restricted, as constraints.
    fused_constraints = {
        table.name: ParameterConstraints(sharding_types=[ROW_WISE], compute_kernels=[FUSED])
        for table in t.tables
    }
    # The FUSED twin declares the same tables as ordinary ones.
    kv_tables = copy.deepcopy(t.tables)
    for table in t.tables:
        table.total_num_buckets = None
        table.use_virtual_table = False
    (fused_model, _), _ = t._generate_dmps_and_batch(fused_sharders, constraints=fused_constraints)
    t.tables = kv_tables
    (kv_model, _), batch = t._generate_dmps_and_batch(kv_sharders, constraints=kv_constraints)
    kv_model.load_state_dict(fused_model.state_dict())  # dense modules
    assert len(lookups(fused_model)) == len(lookups(kv_model)), "Expect same number of lookups"
    for fused_lookup, kv_lookup in zip(lookups(fused_model), lookups(kv_model)):
        assert len(fused_lookup._emb_modules) == len(kv_lookup._emb_modules), \
            "Expect same number of emb modules"
    _copy_fused_into_kv_emb_modules(lookups(fused_model), lookups(kv_model))
    if is_training:
        t._train_models(fused_model, kv_model, batch)
    t._eval_models(fused_model, kv_model, batch, is_deterministic=is_deterministic)


@pytest.mark.parametrize("stochastic_rounding", [True, False], ids=["sr", "no_sr"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_zch_numerical_accuracy(dtype, stochastic_rounding):
    """Port of test_model_parallel_nccl_ssd_single_gpu.py::ZeroCollisionModelParallelTest::
    test_kv_zch_numerical_accuracy (tbe ssd_virtual_table, the only one upstream draws). A
    FUSED row-wise twin (same tables as ordinary ones) and the KV-ZCH model, both with
    EXACT_ROWWISE_ADAGRAD lr 0.1; the KV shards are filled from the twin's with
    set_range(0, 0, rows, weight); one training step; eval outputs must match the twin's.
    Swapped: cuda->cpu, nccl->gloo on one rank (upstream's single-GPU world: fbgemm's
    ``set_range(0, 0, rows)`` names global ids, which are the twin shard's rows only when one
    rank holds the table), both create_test_sharder(...) -> kvzch_sharders(fused_params) (the
    FUSED twin's row_wise/fused restriction as constraints), EmbeddingShardingPlanner -> ours."""
    _run(_rank_kv_zch_numerical_accuracy, SSD, dtype, True, stochastic_rounding, False, world=1)


def _rank_kv_zch_fused_optimizer(rank, world, kernel_type, dtype, is_training, stochastic_rounding):
    t = _ZeroCollision()
    t._set_table_weights_precision(dtype)
    is_deterministic = dtype == DataType.FP32 or not stochastic_rounding
    constraints = {
        table.name: ParameterConstraints(sharding_types=[ROW_WISE], compute_kernels=[kernel_type])
        for table in t.tables
    }
    base_sharders = kvzch_sharders(
        fused_params={"learning_rate": 0.2, "stochastic_rounding": stochastic_rounding})
    (base_model, _), batch = t._generate_dmps_and_batch(base_sharders, constraints=constraints)
    test_sharders = kvzch_sharders(
        fused_params={"learning_rate": 0.1, "stochastic_rounding": stochastic_rounding})
    (test_model, _), _ = t._generate_dmps_and_batch(test_sharders, constraints=constraints)
    test_model.load_state_dict(base_model.state_dict())  # dense modules
    _copy_kv_emb_modules(_ebc_lookups(base_model), _ebc_lookups(test_model), reset_split_weights=False)
    t._eval_models(base_model, test_model, batch, is_deterministic=is_deterministic)
    # Raise the test model's learning rate to the base model's through the fused optimizer.
    fused_opt = test_model.fused_optimizer
    fused_opt.param_groups[0]["lr"] = 0.2
    fused_opt.zero_grad()
    if is_training:
        t._train_models(base_model, test_model, batch)
    t._eval_models(base_model, test_model, batch, is_deterministic=is_deterministic)
    t._compare_models(base_model, test_model, is_deterministic=is_deterministic)


@pytest.mark.parametrize("stochastic_rounding", [True, False], ids=["sr", "no_sr"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_zch_fused_optimizer(dtype, stochastic_rounding):
    """Port of test_model_parallel_nccl_ssd_single_gpu.py::ZeroCollisionModelParallelTest::
    test_kv_zch_fused_optimizer (tbe ssd_virtual_table). Base model lr 0.2, test model lr 0.1
    from the sharders' fused_params; rows copied base->test; then
    ``test_model.fused_optimizer.param_groups[0]["lr"] = 0.2``; one training step; outputs and
    state dicts (compared without use_virtual_table, as upstream does) must be equal.
    Swapped: cuda->cpu, nccl->gloo on 2 ranks, create_test_sharder -> kvzch_sharders,
    EmbeddingShardingPlanner -> ours."""
    _run(_rank_kv_zch_fused_optimizer, SSD, dtype, True, stochastic_rounding)


# -- ZeroCollisionSequenceModelParallelStateDictTest (EC) ------------------------------------------
class _ZeroCollisionSequence(_Base):
    def __init__(self) -> None:
        self.shared_features = []
        self.embedding_groups = {}
        super().__init__()

    def _create_tables(self) -> None:
        num_features, shared_features = 4, 2
        initial_tables = [_virtual_table(EmbeddingConfig, (i + 1) * 1000, 16, f"table_{i}", f"feature_{i}")
                          for i in range(num_features)]
        shared_features_tables = [  # tables 4 and 5 read features 0 and 1 too
            _virtual_table(EmbeddingConfig, (i + 1) * 20, 16, f"table_{i + num_features}", f"feature_{i}")
            for i in range(shared_features)]
        self.tables += initial_tables + shared_features_tables
        self.shared_features += [f"feature_{i}" for i in range(shared_features)]
        self.embedding_groups["group_0"] = [
            (f"{feature}@{table.name}" if feature in self.shared_features else feature)
            for table in self.tables
            for feature in table.feature_names
        ]

    def _create_model(self) -> nn.Module:
        return _sequence_model.SequenceSparseNN(
            tables=self.tables, num_float_features=self.num_float_features,
            embedding_groups=self.embedding_groups, dense_device=self.device,
            sparse_device=torch.device("meta"))


def _ec_lookups(m):
    return m.module.sparse.ec._lookups


def _rank_sequence_kv_zch_load_state_dict(rank, world, kernel_type, dtype, is_training,
                                          stochastic_rounding):
    t = _ZeroCollisionSequence()
    t._set_table_weights_precision(dtype)
    fused_params = {"learning_rate": 0.1, "stochastic_rounding": stochastic_rounding}
    is_deterministic = dtype == DataType.FP32 or not stochastic_rounding
    sharders = kvzch_sharders(fused_params=fused_params)
    constraints = {
        table.name: ParameterConstraints(sharding_types=[ROW_WISE], compute_kernels=[kernel_type])
        for table in t.tables
    }
    (m1, m2), batch = t._generate_dmps_and_batch(sharders, constraints=constraints)
    m2.load_state_dict(m1.state_dict())  # dense modules
    _copy_kv_emb_modules(_ec_lookups(m1), _ec_lookups(m2), reset_split_weights=True)
    if is_training:
        t._train_models(m1, m2, batch)
    t._eval_models(m1, m2, batch, is_deterministic=is_deterministic)
    t._compare_models(m1, m2, is_deterministic=is_deterministic, use_virtual_table=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sequence_kv_zch_load_state_dict(dtype):
    """Port of test_model_parallel_nccl_ssd_single_gpu.py::
    ZeroCollisionSequenceModelParallelStateDictTest::test_kv_zch_load_state_dict (tbe
    ssd_virtual_table). TestSequenceSparseNN: 6 EC virtual tables (dim 16, 10 buckets; tables
    4 and 5 of 20/40 rows share features feature_0/feature_1 as "feature@table"), need_indices;
    as the EBC test: copy rows m1->m2, train one step, equal outputs and state dicts.
    Swapped: cuda->cpu, nccl->gloo on 2 ranks, TestEmbeddingCollectionSharder(row_wise, tbe,
    fused_params) -> kvzch_sharders(fused_params), EmbeddingShardingPlanner -> ours."""
    _run(_rank_sequence_kv_zch_load_state_dict, SSD, dtype, True, True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sequence_kv_zch_numerical_accuracy(dtype):
    """Port of test_model_parallel_nccl_ssd_single_gpu.py::
    ZeroCollisionSequenceModelParallelStateDictTest::test_kv_zch_numerical_accuracy (tbe
    ssd_virtual_table): the EC version of the FUSED-twin comparison above.
    Swapped: as test_kv_zch_numerical_accuracy."""
    _run(_rank_kv_zch_numerical_accuracy, SSD, dtype, True, True, True, world=1)


# -- planner: test_planners.py::TestAutoPlannerWithScaleupProposer::test_planner_with_virtual_table --
def _ec_sharders(fused_params=None):
    return [s for s in kvzch_sharders(fused_params=fused_params) if isinstance(s, EmbeddingCollectionSharder)]


def _assert_shards(plan, table_count, virtual_rows, plain_rows=50_000):
    for table_index in range(table_count):
        shards = plan.plan["sparse.ec"][f"table_{table_index}"].sharding_spec.shards
        rows = virtual_rows if table_index < table_count // 2 else plain_rows
        assert len(shards) == 2
        assert shards[0].shard_offsets == [0, 0]
        assert shards[0].shard_sizes == [rows, 64]
        assert shards[1].shard_offsets == [rows, 0]
        assert shards[1].shard_sizes == [rows, 64]


def _assert_stats(planner, *expected):
    stats: List[str] = cast(EmbeddingStats, planner._stats[0])._stats_table
    for text in expected:
        assert any(text in line for line in stats), f"{text!r} not in the planner's stats:\n" + "\n".join(stats)


def _assert_ranks_and_kernels(plan, kernels):
    module_plan = cast(EmbeddingModuleShardingPlan, plan.plan["sparse.ec"])
    assert sorted(p.ranks for p in module_plan.values()) == [[0, 1]] * 4
    assert {p.compute_kernel for p in module_plan.values()} == kernels


def test_planner_with_virtual_table():
    """Port of torchrec/distributed/planner/tests/test_planners.py::
    TestAutoPlannerWithScaleupProposer::test_planner_with_virtual_table. TestSparseNN with two EC
    virtual tables (2^50-ish rows, 3,991,680 buckets, then 10,000 rows / 10 buckets) constrained
    to row_wise + dram_virtual_table (then with KeyValueParams(l2_cache_size=64,
    max_l1_cache_size=128)) and two ordinary ones with LRU cache params; the scale-up proposer;
    asserts shard offsets/sizes, ranks, kernels {dram_virtual_table, fused_uvm_caching} and the
    planner's storage stats lines. Swapped: EmbeddingShardingPlanner -> KVZCHShardingPlanner
    (same arguments), [EmbeddingCollectionSharder(fused_params)] -> the EC sharder of
    kvzch_sharders(fused_params). Planning needs no device, so upstream's cuda topology
    (hbm_cap/ddr_cap) stays: on a cpu topology fused_uvm_caching, which upstream asserts, is
    never offered."""
    table_count = 4

    def model_of(virtual_rows, buckets):
        """Upstream's model: half virtual tables, half ordinary ones of 100,000 rows."""
        tables = [
            EmbeddingConfig(num_embeddings=virtual_rows, embedding_dim=64, name="table_" + str(i),
                            feature_names=["feature_" + str(i)], use_virtual_table=True,
                            total_num_buckets=buckets)
            for i in range(table_count // 2)
        ] + [
            EmbeddingConfig(num_embeddings=100_000, embedding_dim=64, name="table_" + str(i),
                            feature_names=["feature_" + str(i)])
            for i in range(table_count // 2, table_count)
        ]
        return tm.TestSparseNN(tables=tables, sparse_device=torch.device("meta"))

    model = model_of(1_125_899_902_955_520, 3_991_680)
    topology = Topology(world_size=2, hbm_cap=1024 * 1024 * 1024 * 2, ddr_cap=1024 * 1024 * 1024 * 256,
                        compute_device="cuda")

    def constraints(key_value_params):
        return {
            **{f"table_{i}": ParameterConstraints(sharding_types=["row_wise"],
                                                  compute_kernels=["dram_virtual_table"],
                                                  **({"key_value_params": key_value_params}
                                                     if key_value_params else {}))
               for i in range(table_count // 2)},
            **{f"table_{i}": ParameterConstraints(cache_params=CacheParams(algorithm=CacheAlgorithm.LRU))
               for i in range(table_count // 2, table_count)},
        }

    def plan_with(model, key_value_params, fused_params=None):
        """Upstream's planner call, with our planner: (planner, plan)."""
        planner = KVZCHShardingPlanner(topology=topology, proposer=EmbeddingOffloadScaleupProposer(),
                                       constraints=constraints(key_value_params))
        return planner, planner.plan(module=model, sharders=_ec_sharders(fused_params))

    # 1. No KeyValueParams.
    planner, plan = plan_with(model, None)
    _assert_shards(plan, table_count, 562949951477760)
    _assert_stats(planner, "dram_virtual_table: HBM: 0.001 GB, DDR: 0.0 GB",
                  "fused_uvm_caching: HBM: 0.011 GB, DDR: 0.048 GB", "Max HBM: 0.006 GB on ranks [0, 1]")

    # 2. KeyValueParams(l2_cache_size=64, max_l1_cache_size=128).
    kv = KeyValueParams(l2_cache_size=64, max_l1_cache_size=128)
    planner, plan = plan_with(model, kv)
    _assert_ranks_and_kernels(plan, {DRAM, EmbeddingComputeKernel.FUSED_UVM_CACHING.value})
    _assert_shards(plan, table_count, 562949951477760)
    _assert_stats(planner, "dram_virtual_table: HBM: 0.501 GB, DDR: 0.0 GB",
                  "fused_uvm_caching: HBM: 0.011 GB, DDR: 0.048 GB",
                  "Max HBM: 0.256 GB on ranks [0, 1]", "Min HBM: 0.256 GB on ranks [0, 1]")

    # 3. Same constraints again (upstream repeats the plan and checks ranks and kernels).
    planner, plan = plan_with(model, kv)
    _assert_ranks_and_kernels(plan, {DRAM, EmbeddingComputeKernel.FUSED_UVM_CACHING.value})

    # 4. Small virtual tables: L1 cache > table size * cache load factor, the smaller is used.
    model = model_of(10_000, 10)
    planner, plan = plan_with(model, kv)
    _assert_shards(plan, table_count, 5000)
    _assert_stats(planner, "dram_virtual_table: HBM: 0.002 GB, DDR: 0.0 GB",
                  "fused_uvm_caching: HBM: 0.011 GB, DDR: 0.048 GB",
                  "Max HBM: 0.007 GB on ranks [0, 1]", "Min HBM: 0.007 GB on ranks [0, 1]")

    # 5. The sharders' fused_params override the cache load factor.
    planner, plan = plan_with(model, kv, {"cache_load_factor": 0.5})
    _assert_shards(plan, table_count, 5000)
    _assert_stats(planner, "dram_virtual_table: HBM: 0.005 GB, DDR: 0.0 GB",
                  "fused_uvm_caching: HBM: 0.027 GB, DDR: 0.048 GB",
                  "Max HBM: 0.016 GB on ranks [0, 1]", "Min HBM: 0.016 GB on ranks [0, 1]")


# -- enumerator: test_enumerators.py::TestEnumerators::test_virtual_table_rw_sharding_with_buckets --
_EXPECTED_SIZES = [
    [[20, 20], [20, 20], [10, 20], [10, 20], [10, 20], [10, 20], [10, 20], [10, 20]],
    [[22, 40], [22, 40], [11, 40], [11, 40], [11, 40], [11, 40], [11, 40], [11, 40]],
    [[24, 60], [24, 60], [12, 60], [12, 60], [12, 60], [12, 60], [12, 60], [12, 60]],
    [[26, 80], [26, 80], [13, 80], [13, 80], [13, 80], [13, 80], [13, 80], [13, 80]],
]
_EXPECTED_OFFSETS = [
    [[0, 0], [20, 0], [40, 0], [50, 0], [60, 0], [70, 0], [80, 0], [90, 0]],
    [[0, 0], [22, 0], [44, 0], [55, 0], [66, 0], [77, 0], [88, 0], [99, 0]],
    [[0, 0], [24, 0], [48, 0], [60, 0], [72, 0], [84, 0], [96, 0], [108, 0]],
    [[0, 0], [26, 0], [52, 0], [65, 0], [78, 0], [91, 0], [104, 0], [117, 0]],
]
_EXPECTED_STORAGE = [[Storage(hbm=h, ddr=0)] * 8 for h in (165888, 1001472, 1003520, 2648064)]


def test_virtual_table_rw_sharding_with_buckets():
    """Port of torchrec/distributed/planner/tests/test_enumerators.py::TestEnumerators::
    test_virtual_table_rw_sharding_with_buckets. EBC of 4 tables (100 + 10i rows, dim 20 + 20i,
    10 buckets, use_virtual_table) with constraints compute_kernels=[dram_virtual_table]
    (min_partition, pooling_factors as upstream), world 8 / local 4, batch 256, cuda topology,
    optimizer multiplier patched to 0; asserts row_wise, bucket-aligned shard sizes/offsets and
    per-shard storage. Swapped: the enumerator is the one KVZCHShardingPlanner builds (same
    topology, batch size, constraints) instead of a bare EmbeddingEnumerator, and upstream's
    VirtualTableRWSharder (EBC sharder restricted to row_wise + dram_virtual_table) subclasses
    our EBC sharder instead of TorchRec's."""
    ebc_sharder_cls = type(kvzch_sharders()[0])

    class VirtualTableRWSharder(ebc_sharder_cls):
        def sharding_types(self, compute_device_type: str) -> List[str]:
            return [ShardingType.ROW_WISE.value]

        def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
            return [EmbeddingComputeKernel.DRAM_VIRTUAL_TABLE.value]

    constraints = {
        "table_0": ParameterConstraints(min_partition=20, compute_kernels=[DRAM]),
        "table_1": ParameterConstraints(min_partition=20, pooling_factors=[1, 3, 5], compute_kernels=[DRAM]),
        "table_2": ParameterConstraints(min_partition=20, pooling_factors=[8, 2], compute_kernels=[DRAM]),
        "table_3": ParameterConstraints(min_partition=40, pooling_factors=[2, 1, 3, 7], compute_kernels=[DRAM]),
    }
    tables_with_buckets = [
        EmbeddingBagConfig(num_embeddings=100 + i * 10, embedding_dim=20 + i * 20, name="table_" + str(i),
                           feature_names=["feature_" + str(i)], total_num_buckets=10, use_virtual_table=True)
        for i in range(4)
    ]
    model_with_buckets = EmbeddingBagCollection(tables=tables_with_buckets)
    with mock.patch("torchrec.distributed.planner.shard_estimators._get_optimizer_multipler", return_value=0):
        planner = KVZCHShardingPlanner(
            topology=Topology(world_size=8, compute_device="cuda", local_world_size=4),
            batch_size=256, constraints=constraints)
        sharding_options = planner._enumerator.enumerate(
            model_with_buckets, [cast(ModuleSharder[nn.Module], VirtualTableRWSharder())])
    assert len(sharding_options) == 4
    for i, sharding_option in enumerate(sharding_options):
        assert sharding_option.sharding_type == ShardingType.ROW_WISE.value
        assert [shard.size for shard in sharding_option.shards] == _EXPECTED_SIZES[i]
        assert [shard.offset for shard in sharding_option.shards] == _EXPECTED_OFFSETS[i]
        assert [shard.storage for shard in sharding_option.shards] == _EXPECTED_STORAGE[i]
