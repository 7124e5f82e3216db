"""TorchRec's planner with KV-ZCH tables: constraints, bucket-aligned shards, DRAM accounting."""

import logging
import re

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, strategies as st
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.planner.types import PlannerError
from torchrec.distributed.sharding_plan import calculate_shard_sizes_and_offsets
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvzch import AdmissionPolicy, KVZCHTableParams
from torchrec_kvzch.torchrec import KVZCH_KERNEL, KVZCHEmbeddingKernel, KVZCHParameterSharding, kvzch_embedding_bag_config, kvzch_sharders
from torchrec_kvzch.torchrec.planner import KVZCHConstraints, KVZCHShardingPlanner
from torchrec_kvzch.table.layout import RowLayout
from torchrec_kvzch.table.row_store import RowStore


def tables(expected_rows=10_000, buckets=(12, 7), **kw):
    return [KVZCHTableParams("user", 16, num_embeddings=buckets[0] * 2**36, total_num_buckets=buckets[0],
                             expected_rows=expected_rows, **kw),
            KVZCHTableParams("item", 32, num_embeddings=buckets[1] * 2**36, total_num_buckets=buckets[1],
                             expected_rows=expected_rows, **kw)]


def model(kv):
    plain = EmbeddingBagConfig(name="plain", embedding_dim=8, num_embeddings=1000, feature_names=["f_plain"])
    configs = [kvzch_embedding_bag_config(t, [f"f_{t.name}"]) for t in kv] + [plain]
    return EmbeddingBagCollection(tables=configs, device=torch.device("meta"))


def plan_for(kv, world_size=3, ddr_cap=None, constraints=None):
    topology = Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size,
                        **({"ddr_cap": ddr_cap} if ddr_cap else {}))
    planner = KVZCHShardingPlanner(topology, batch_size=512, constraints={**opt_in(kv), **(constraints or {})})
    return planner.plan(model(kv), kvzch_sharders())


def opt_in(kv):
    return {t.name: KVZCHConstraints(kvzch=t) for t in kv}


def test_plan_pins_kvzch_tables_to_row_wise_on_our_kernel():
    kv = tables()
    module_plan = plan_for(kv).plan[""]
    for t in kv:
        sharding = module_plan[t.name]
        assert isinstance(sharding, KVZCHParameterSharding) and sharding.kvzch == t
        assert (sharding.sharding_type, sharding.compute_kernel) == ("row_wise", KVZCH_KERNEL)
        # One shard per rank, exactly the buckets of our split.
        for rank, shard in enumerate(sharding.sharding_spec.shards):
            r = t.bucket_range(rank, 3)
            assert (shard.shard_offsets[0], shard.shard_sizes[0]) == (r.id_start, r.id_end - r.id_start)
            assert shard.placement.rank() == rank
    assert module_plan["plain"].compute_kernel != KVZCH_KERNEL
    assert not isinstance(module_plan["plain"], KVZCHParameterSharding)


@given(buckets=st.integers(1, 200), world=st.integers(1, 24), per_bucket=st.integers(1, 2**20))
def test_planner_shard_sizes_equal_our_bucket_split(buckets, world, per_bucket):
    if buckets < world:
        return
    p = KVZCHTableParams("t", 4, num_embeddings=buckets * per_bucket, total_num_buckets=buckets)
    virtual = torch.empty(p.num_embeddings, 4, device="meta")  # only its shape is read
    sizes, offsets = calculate_shard_sizes_and_offsets(virtual, world, world, "row_wise",
                                                       num_buckets=buckets)
    for rank in range(world):
        r = p.bucket_range(rank, world)
        assert (offsets[rank][0], sizes[rank][0]) == (r.id_start, r.id_end - r.id_start)


def test_storage_counts_the_dram_of_expected_rows():
    kv = tables(expected_rows=120_000)
    planner = KVZCHShardingPlanner(Topology(world_size=3, compute_device="cpu", local_world_size=3),
                                   batch_size=512, constraints=opt_in(kv))
    planner.plan(model(kv), kvzch_sharders())
    options = [o for o in planner._enumerator.last_stored_search_space
               if o.name == "user" and o.compute_kernel == KVZCH_KERNEL]
    assert options
    user = kv[0]
    for shard, rank in zip(options[0].shards, range(3)):
        want = RowStore.estimated_bytes(RowLayout.for_table(user), user.expected_shard_rows(user.bucket_range(rank, 3)))
        assert (shard.storage.ddr, shard.storage.hbm) == (want, 0)
        # 12 buckets on 3 ranks: 40,000 expected rows each; 16 fp32 + 1 fp32 Adagrad + 8 meta +
        # 8 slot->id bytes a row, plus growth slack and the hash table (not 0, not 2^40 rows).
        raw = 40_000 * (16 * 4 + 4 + 8 + 8)
        assert raw <= want <= 2.5 * raw


def test_storage_counts_a_shards_eviction_budget_which_its_store_reserves():
    """A budget is the most a shard holds, reserved up front by its store: charged in place of
    the expected rows, above them or below; a table budget by each shard's share."""
    from torchrec_kvzch import EvictionPolicy
    for eviction, per_rank in ((EvictionPolicy(kind="lru", max_rows=400_000), [400_000] * 3),
                               (EvictionPolicy(kind="lru", max_rows=500), [500] * 3),
                               (EvictionPolicy(kind="lru", table_max_rows=3_000), [1_000] * 3)):
        kv = tables(expected_rows=12_000, eviction=eviction)
        planner = KVZCHShardingPlanner(Topology(world_size=3, compute_device="cpu", local_world_size=3),
                                       batch_size=512, constraints=opt_in(kv))
        planner.plan(model(kv), kvzch_sharders())
        [option] = [o for o in planner._enumerator.last_stored_search_space
                    if o.name == "user" and o.compute_kernel == KVZCH_KERNEL]
        layout = RowLayout.for_table(kv[0])
        assert [s.storage.ddr for s in option.shards] == [RowStore.estimated_bytes(layout, n, reserved=True)
                                                          for n in per_rank]


def test_storage_counts_a_disk_tiers_cache_and_index_in_dram_and_its_rows_on_disk(tmp_path):
    """A table over a disk tier: its shards' cache (with the tier's index) is host memory, the
    rows past the cache are disk (where TorchRec's Storage has a field for it)."""
    from dataclasses import fields

    from torchrec.distributed.planner.types import Storage
    from torchrec_kvzch.params import DiskStorage
    from torchrec_kvzch.table.disk_tier import estimated_tier_bytes

    layout_user = RowLayout.for_table(tables()[0])
    storage = DiskStorage(tmp_path, shard_cache_bytes=layout_user.stored_bytes * 5_000)
    kv = tables(expected_rows=120_000, storage=storage)
    planner = KVZCHShardingPlanner(Topology(world_size=3, compute_device="cpu", local_world_size=3),
                                   batch_size=512, constraints=opt_in(kv))
    planner.plan(model(kv), kvzch_sharders())
    options = [o for o in planner._enumerator.last_stored_search_space
               if o.name == "user" and o.compute_kernel == KVZCH_KERNEL]
    for shard in options[0].shards:  # 40,000 expected rows a shard: 5,000 cached, 35,000 on disk
        index, disk = estimated_tier_bytes(35_000, layout_user.row_width * layout_user.itemsize)
        assert shard.storage.ddr == RowStore.estimated_bytes(layout_user, 5_000) + index
        if "ssd" in {f.name for f in fields(Storage)}:  # (TorchRec 1.8 on)
            assert shard.storage.ssd == disk
        assert 35_000 * 100 <= disk <= 35_000 * 100 * 1.3  # rows of 16 fp32, Adagrad, header: 100 bytes


def test_plan_that_cannot_fit_is_rejected_by_the_planner():
    kv = tables(expected_rows=3_000_000_000)  # ~3B rows x ~100 bytes per rank >> 64 GiB
    with pytest.raises(PlannerError):
        plan_for(kv, ddr_cap=64 * 2**30)


def test_the_planner_takes_torchrecs_arguments_in_torchrecs_order(pools):
    """A drop-in for EmbeddingShardingPlanner: its positional order, no topology (TorchRec's
    default, from the process group), and an enumerator refused rather than left without the
    estimators that price KV-ZCH tables."""
    kv = tables()
    topology = Topology(world_size=3, compute_device="cpu", local_world_size=3)
    plan = KVZCHShardingPlanner(topology, 512, None, None, None, None, None, None, opt_in(kv)).plan(
        model(kv), kvzch_sharders())
    assert plan.plan[""]["user"].compute_kernel == KVZCH_KERNEL
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    with pytest.raises(ValueError, match="builds its own enumerator .*fix: leave enumerator out"):
        KVZCHShardingPlanner(topology, 512, EmbeddingEnumerator(topology, 512))
    assert pools[2].run(_default_topology) == [(2, "cpu")] * 2


def _default_topology(rank, world):
    planner = KVZCHShardingPlanner(constraints=opt_in(tables()))
    return planner._topology.world_size, planner._topology.compute_device


def test_printed_plan_shows_our_kernel(caplog):
    with caplog.at_level(logging.INFO):
        plan_for(tables())
    for table in ("user", "item"):  # e.g. "#  .user  RW  dram_virtual_table  0.036 (...)"
        assert re.search(rf"\.{table}\s+RW\s+dram_virtual_table\s", caplog.text)


def test_misdeclared_tables_are_reported():
    kv = tables()
    plain_model = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name="user", embedding_dim=16, num_embeddings=kv[0].num_embeddings, feature_names=["f"])],
        device=torch.device("meta"))
    topology = Topology(world_size=2, compute_device="cpu")
    planner = KVZCHShardingPlanner(topology, batch_size=64, constraints=opt_in(kv[:1]))
    with pytest.raises(ValueError, match="must be declared with use_virtual_table=True"):
        planner.plan(plain_model, kvzch_sharders())
    with pytest.raises(ValueError, match="KV-ZCH table 'user': constraint sharding_types"):
        KVZCHShardingPlanner(topology, constraints={"user": KVZCHConstraints(sharding_types=["table_wise"], kvzch=kv[0])}).plan(
            model(kv), kvzch_sharders())
    with pytest.raises(ValueError, match="its KVZCHConstraints carry the parameters of table 'item'"):
        KVZCHShardingPlanner(topology, constraints={"user": KVZCHConstraints(kvzch=kv[1])}).plan(
            model(kv), kvzch_sharders())
    with pytest.raises(ValueError, match="'item'.* not in the model"):
        KVZCHShardingPlanner(topology, constraints=opt_in(kv)).plan(model(kv[:1]), kvzch_sharders())
    with pytest.raises(ValueError, match="KV-ZCH table 'plain'.*must be declared with use_virtual_table=True"):
        KVZCHShardingPlanner(topology, constraints={**opt_in(kv), "plain": ParameterConstraints(compute_kernels=[KVZCH_KERNEL])}).plan(
            model(kv), kvzch_sharders())


def plan_and_train(rank, world_size):
    kv = tables()
    planner = KVZCHShardingPlanner(Topology(world_size=world_size, compute_device="cpu",
                                            local_world_size=world_size), batch_size=64, constraints=opt_in(kv))
    m = model(kv)
    plan = planner.collective_plan(m, kvzch_sharders(), dist.group.WORLD)
    dmp = DistributedModelParallel(m, device=torch.device("cpu"), plan=plan, sharders=kvzch_sharders(),
                                   env=ShardingEnv.from_process_group(dist.group.WORLD))
    gen = torch.Generator().manual_seed(rank)
    ids_user = torch.randint(0, kv[0].num_embeddings, (8,), generator=gen)
    ids_item = torch.randint(0, kv[1].num_embeddings, (8,), generator=gen)
    features = KeyedJaggedTensor(keys=["f_user", "f_item", "f_plain"],
                                 values=torch.cat([ids_user, ids_item, torch.randint(0, 1000, (8,), generator=gen)]),
                                 lengths=torch.full((12,), 2))
    out = dmp(features).wait().values()
    out.sum().backward()
    assert out.shape == (4, 16 + 32 + 8)
    kernels = [sorted(emb.tables) for m in dmp.modules() for lookup in getattr(m, "_lookups", ())
               for emb in lookup._emb_modules if isinstance(emb, KVZCHEmbeddingKernel)]
    return type(plan.plan[""]["user"]).__name__, kernels


def test_collective_plan_then_dmp_on_two_ranks(pools):
    # Both KV-ZCH tables (dims 16 and 32) are served by one kernel on each rank.
    assert pools[2].run(plan_and_train) == [("KVZCHParameterSharding", [["item", "user"]])] * 2


def test_plans_for_a_cuda_topology_charge_device_memory():
    # Planning needs no GPU: a CUDA topology plans here, with the rows charged to HBM.
    kv = tables(expected_rows=120_000)
    planner = KVZCHShardingPlanner(Topology(world_size=2, compute_device="cuda", local_world_size=2),
                                   batch_size=512, constraints=opt_in(kv))
    plan = planner.plan(model(kv), kvzch_sharders()).plan[""]
    assert all(isinstance(plan[t.name], KVZCHParameterSharding) for t in kv)
    option = next(o for o in planner._enumerator.last_stored_search_space
                  if o.name == "user" and o.compute_kernel == KVZCH_KERNEL)
    assert all(s.storage.hbm > 0 and s.storage.ddr == 0 for s in option.shards)


def test_a_cuda_plan_charges_a_device_caches_rows_to_host_memory():
    """Rows in host memory under a GPU cache (issue 34): the weights (and optimizer state wider
    than a value per row) are DDR; the cache, the id map, headers and row-wise state are HBM."""
    from torchrec_kvzch.params import DeviceCache
    from torchrec_kvzch.table.row_cache import estimated_split

    from torchrec.distributed.types import CacheParams

    plain, cached = tables(expected_rows=120_000), tables(expected_rows=120_000, device_cache=DeviceCache(load_factor=0.1))
    declared = {t.name: KVZCHConstraints(kvzch=t, cache_params=CacheParams(load_factor=0.1)) for t in plain}
    storage = []
    for kv, constraints in ((plain, opt_in(plain)), (cached, opt_in(cached)), (plain, declared)):
        planner = KVZCHShardingPlanner(Topology(world_size=2, compute_device="cuda", local_world_size=2),
                                       batch_size=512, constraints=constraints)
        planned = planner.plan(model(kv), kvzch_sharders()).plan[""]["user"]
        option = next(o for o in planner._enumerator.last_stored_search_space
                      if o.name == "user" and o.compute_kernel == KVZCH_KERNEL)
        storage.append(option.shards[0].storage)
    layout = RowLayout.for_table(cached[0])
    assert (storage[1].hbm, storage[1].ddr) == estimated_split(layout, 60_000, 6_000)  # 12 buckets on 2 ranks
    assert storage[0].ddr == 0 and storage[1].hbm < storage[0].hbm and storage[1].ddr >= 60_000 * 16 * 4
    # TorchRec's CacheParams are planned as the sharders will apply them: as the table's own cache
    assert storage[2] == storage[1] and planned.kvzch.device_cache == DeviceCache(load_factor=0.1)


def test_storage_counts_the_admission_sketch_of_each_shard():
    admission = AdmissionPolicy("count", min_count=2, sketch_width=2**18, sketch_depth=4)
    plain, kv = tables(expected_rows=120_000), tables(expected_rows=120_000, admission=admission)
    storage = []
    for tbls in (plain, kv):
        planner = KVZCHShardingPlanner(Topology(world_size=3, compute_device="cpu", local_world_size=3),
                                       batch_size=512, constraints=opt_in(tbls))
        planner.plan(model(tbls), kvzch_sharders())
        [option] = [o for o in planner._enumerator.last_stored_search_space
                    if o.name == "user" and o.compute_kernel == KVZCH_KERNEL][:1]
        storage.append([s.storage.ddr for s in option.shards])
    assert [b - a for a, b in zip(*storage)] == [2**18 * 4] * 3  # one byte a counter, per shard


def plan_failures(rank, world_size):
    """What each rank raises when planning fails: too few buckets (declared the TorchRec way
    and with KVZCHConstraints), then a plan that does not fit. The ranks stay usable after
    each: no rank is left waiting in a collective."""
    one_bucket = EmbeddingBagConfig(name="user", embedding_dim=8, num_embeddings=2**20, feature_names=["f"],
                                    use_virtual_table=True, total_num_buckets=1)
    kv = KVZCHTableParams("user", 8, num_embeddings=2**20, total_num_buckets=1)
    too_big = tables(expected_rows=3_000_000_000)
    cases = [
        (EmbeddingBagCollection(tables=[one_bucket], device=torch.device("meta")), None, {}),
        (model([kv]), opt_in([kv]), {}),
        (model(too_big), opt_in(too_big), {"ddr_cap": 64 * 2**30}),
    ]
    errors = []
    for module, constraints, caps in cases:
        topology = Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size, **caps)
        planner = KVZCHShardingPlanner(topology, batch_size=64, constraints=constraints)
        try:
            planner.collective_plan(module, kvzch_sharders(), dist.group.WORLD)
            errors.append(None)
        except Exception as error:  # noqa: BLE001 - the test compares them
            errors.append((type(error).__name__, str(error).splitlines()[0]))
    dist.barrier()  # still connected
    return errors


def test_every_rank_raises_the_same_planning_error(pools):
    # Before: rank 0 raised TorchRec's "Number of buckets (1) must be >= the number of ranks (2)"
    # (no table name) and rank 1 died on gloo's "Connection closed by peer".
    by_rank = pools[2].run(plan_failures)
    assert by_rank[0] == by_rank[1]
    few_buckets = ("ValueError", "KV-ZCH table 'user': total_num_buckets (1) is smaller than the world size (2), "
                   "so some ranks would own no bucket; fix: use at least 2 buckets (a multiple of the world "
                   "size is best)")
    assert by_rank[0][:2] == [few_buckets, few_buckets]
    assert by_rank[0][2][0] == "PlannerError"


def test_a_plan_on_one_process_checks_the_buckets_too():
    kv = KVZCHTableParams("user", 8, num_embeddings=2**20, total_num_buckets=2)
    with pytest.raises(ValueError, match=r"KV-ZCH table 'user': total_num_buckets \(2\) is smaller than the world size \(3\)"):
        plan_for([kv])
