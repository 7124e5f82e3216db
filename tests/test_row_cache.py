"""The device cache's rules on the CPU, with the GPU replaced (issue 34; ``table/row_cache.py``).

fbgemm's CUDA cache ops are replaced by ``FakeCacheOps`` below, which keeps their semantics
(set-associative entries of 32 ways keyed by slot, -1 for none; LRU insertion that writes the
rows it drops back; a flush that writes every entry back) in torch, and a fused update lands in
the cached copy of a row when it has one, else in its host row, as fbgemm's kernels do. A store
under such a cache must then hold and read, after any mix of training steps, evictions (slots
reused), writes, evaluation reads, growth, frozen snapshots and loads, exactly what a store
without one holds: a stale copy served or written back anywhere would show as a difference.
The CUDA side (fbgemm's real ops and TBE) is ``tests/test_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from torchrec_kvzch.params import DeviceCache, EvictionPolicy, KVZCHTableParams
from torchrec_kvzch.table import row_cache
from torchrec_kvzch.table.layout import RowPart
from torchrec_kvzch.table.row_store import RowStore
from torchrec_kvzch.table.snapshot import RowSnapshot

ASSOC = row_cache.ASSOC


class FakeCacheOps:
    """fbgemm's cache ops in torch (``lxu_cache_lookup``, ``lxu_cache_flush``, and the LRU
    populate its TBE runs before a lookup), on the CPU; sets chosen by a hash of the slot."""

    @staticmethod
    def sets_of(slots: torch.Tensor, sets: int) -> torch.Tensor:
        return (slots * 0x9E3779B1 % (1 << 31)) % sets

    def lookup(self, slots, state, invalid):
        at = self.sets_of(slots, state.shape[0])
        match = state[at] == slots.unsqueeze(1)
        return torch.where(match.any(1) & (slots != invalid), at * ASSOC + match.int().argmax(1), -1)

    def flush(self, weights, cache):
        entries = cache.state.reshape(-1)
        live = entries >= 0
        weights[entries[live]] = cache.weights[live]

    def populate(self, cache, slots: torch.Tensor, time: int) -> None:
        """Bring ``slots`` (distinct) into the cache, least recently used entries out first (their
        rows written back); entries used at ``time`` stay, so a set full of them leaves a row out."""
        weights, state, lru = cache.store.weights, cache.state, cache.lru
        at = self.locations_of(cache, slots)
        lru.view(-1)[at[at >= 0]] = time
        for slot in slots[at < 0].tolist():
            s = int(self.sets_of(torch.tensor([slot]), state.shape[0]))
            way = int(torch.argmin(lru[s]))
            if int(lru[s, way]) == time:
                continue  # (fbgemm too leaves the row in host memory)
            if int(state[s, way]) >= 0:
                weights[state[s, way]] = cache.weights[s * ASSOC + way]
            state[s, way] = slot
            cache.weights[s * ASSOC + way] = weights[slot]
            lru[s, way] = time

    def locations_of(self, cache, slots):
        return self.lookup(slots, cache.state, cache.capacity)


@pytest.fixture
def fake(monkeypatch):
    ops = FakeCacheOps()
    monkeypatch.setattr(row_cache, "default_ops", lambda device, table: ops)
    return ops


def params(cache_rows: int | None, **kw) -> KVZCHTableParams:
    cache = DeviceCache(rows=cache_rows) if cache_rows else DeviceCache()
    return KVZCHTableParams("t", 8, num_embeddings=2**30, total_num_buckets=16, optimizer="adam",
                            device_cache=cache, **kw)


def train(store: RowStore, ids: torch.Tensor, fake: FakeCacheOps | None) -> None:
    """A training step with the GPU replaced: the lookup, the cache's populate (with a cache),
    then a fused update (each row + a function of its id and the step) landing where fbgemm's
    lands: the cached copy, else the host row; the optimizer state as the table's own update."""
    slots = torch.unique(store.lookup_for_update(ids))
    keys = store.keys()[slots]
    step = (keys % 7 + 1).float().unsqueeze(1) * store.clock / 100
    cache = store.row_cache
    if cache is None:
        store.weights[slots] += step
    else:
        fake.populate(cache, slots, store.clock)
        at = cache.locations(slots)
        hit = at >= 0
        cache.weights[at[hit]] += step[hit]
        store.weights[slots[~hit]] += step[~hit]
    store.optimizer[slots] += step.mean(1, keepdim=True)


def same(a: RowStore, b: RowStore, ids: torch.Tensor) -> None:
    for part in (RowPart.WEIGHT, RowPart.OPTIMIZER, RowPart.META):
        assert torch.equal(a.read_ids(ids, part), b.read_ids(ids, part)), part
    assert torch.equal(a.peek(ids), b.peek(ids))


OPS = st.lists(st.tuples(st.sampled_from(["train", "train", "train", "evict", "write", "peek", "freeze", "load"]),
                         st.integers(0, 2**31 - 1)), min_size=4, max_size=14)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])  # (stateless)
@given(ops=OPS, cache_rows=st.sampled_from([32, 64, 256]), universe=st.sampled_from([300, 3000]))
def test_a_store_under_a_device_cache_holds_what_a_store_without_one_holds(fake, ops, cache_rows, universe):
    ours, ref = RowStore(params(cache_rows)), RowStore(params(None))
    assert ours.row_cache is not None and ref.row_cache is None
    ids_all = torch.arange(universe) * 7919 + 3
    frozen = None
    for op, seed in ops:
        gen = torch.Generator().manual_seed(seed)
        ids = ids_all[torch.randint(0, universe, (int(torch.randint(1, 400, (1,), generator=gen)),), generator=gen)]
        if op == "train":
            train(ours, ids, fake)
            train(ref, ids, None)
        elif op == "evict" and len(ref):
            victims = ref.keys()[torch.randperm(len(ref), generator=gen)[: len(ref) // 2]].clone()
            ours.evict(victims)
            ref.evict(victims)
        elif op == "write":  # rows that exist (cached or not) and new ones
            values = torch.randn(ids.numel(), 8, generator=gen)
            unique, first = torch.unique(ids, return_inverse=True)
            rows = values[torch.zeros_like(unique).scatter_(0, first, torch.arange(ids.numel()))]
            ours.write_ids(unique, rows)
            ref.write_ids(unique, rows)
        elif op == "peek":  # evaluation reads change nothing, the cache included
            before = (ours.row_cache.state.clone(), ours.row_cache.weights.clone(), ours.weights.clone())
            assert torch.equal(ours.peek(ids), ref.peek(ids))
            after = (ours.row_cache.state, ours.row_cache.weights, ours.weights)
            assert all(torch.equal(x, y) for x, y in zip(before, after))
        elif op == "freeze" and frozen is None:
            frozen = [RowSnapshot(s) for s in (ours, ref)]
            for snap in frozen:
                snap.freeze()
        elif op == "load":  # a checkpoint's whole rows (of fewer rows) into a store holding rows of its own
            rows = ref.read_ids(torch.sort(ref.keys()).values[::2], RowPart.ROW)
            for store in (ours, ref):
                store.clear()
                store.write_rows(rows)
    same(ours, ref, ids_all)
    assert torch.equal(*(s.read_ids(ids_all, RowPart.ROW).view(torch.int32) for s in (ours, ref)))
    if frozen is not None and frozen[0].frozen and frozen[1].frozen:
        for part in (RowPart.WEIGHT, RowPart.META):
            assert torch.equal(frozen[0].read(0, len(frozen[0]), part), frozen[1].read(0, len(frozen[1]), part))


def test_reused_slots_never_serve_the_rows_that_were_there(fake):
    """Rows cached, then evicted (compaction moves the tail into the freed slots); new ids take
    the slots past the end: neither the moved rows nor the new ones read an old cached copy."""
    ours, ref = RowStore(params(64)), RowStore(params(None))
    first, second = torch.arange(200) + 10, torch.arange(200) + 5000
    for store, ops in ((ours, fake), (ref, None)):
        for _ in range(3):
            train(store, first, ops)
    cached = ours.row_cache.state.reshape(-1)
    assert int((cached >= 0).sum()) > 32  # the cache holds rows of the first ids
    for store, ops in ((ours, fake), (ref, None)):
        store.evict(first[::2])
        train(store, second, ops)
    same(ours, ref, torch.cat([first, second]))


def test_an_l2_pass_reads_the_cached_weights(fake):
    """The l2 rule ranks rows by their weights' norm: the fresh (cached) ones."""
    kw = dict(init_range=(-0.001, 0.001), eviction=EvictionPolicy("l2", l2_threshold=0.1, interval_steps=1_000_000))
    ours, ref = RowStore(params(64, **kw)), RowStore(params(None, **kw))
    ids = torch.arange(100)
    for store, ops in ((ours, fake), (ref, None)):
        train(store, ids[:50], ops)  # half the rows grow past the threshold, in the cache only
        train(store, ids, ops)
        store.evictor.run_pass()
    assert ref.history.evicted > 0
    assert torch.equal(torch.sort(ours.keys()).values, torch.sort(ref.keys()).values)
    same(ours, ref, ids)


def test_a_device_cache_is_refused_where_it_cannot_serve():
    from torchrec.distributed.planner import Topology
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from torchrec_kvzch.torchrec import KVZCHShardingPlanner, kvzch_embedding_bag_config, kvzch_sharders
    from torchrec_kvzch.torchrec.planner import KVZCHConstraints

    with pytest.raises(ValueError, match="device cache serves a CUDA store"):
        RowStore(params(64))
    # Planning for CPU ranks refuses it already (a dry run says so), naming the table and the fix.
    table = params(64)
    ebc = EmbeddingBagCollection(tables=[kvzch_embedding_bag_config(table, ["f"])], device=torch.device("meta"))
    planner = KVZCHShardingPlanner(Topology(world_size=2, compute_device="cpu", local_world_size=2),
                                   constraints={table.name: KVZCHConstraints(kvzch=table)})
    with pytest.raises(ValueError, match=f"KV-ZCH table '{table.name}': a device cache .* on CPU ranks .* drop "
                                         "device_cache"):
        planner.plan(ebc, kvzch_sharders())
    with pytest.raises(ValueError, match="load_factor must be a number in"):
        KVZCHTableParams("t", 8, device_cache=DeviceCache(load_factor=1.5))
    with pytest.raises(ValueError, match="device_cache and storage"):
        from torchrec_kvzch.params import DiskStorage
        KVZCHTableParams("t", 8, device_cache=DeviceCache(rows=10), storage=DiskStorage("/tmp/x", cache_bytes=1 << 20))
    with pytest.raises(ValueError, match="policy"):
        KVZCHTableParams("t", 8, device_cache=DeviceCache(rows=10, policy="fifo"))
    with pytest.raises(ValueError, match="prefetch_pipeline needs policy 'lru'"):
        KVZCHTableParams("t", 8, device_cache=DeviceCache(rows=10, policy="lfu", prefetch_pipeline=True))
    with pytest.raises(ValueError, match="prefetch_pipeline is set without a cache"):
        KVZCHTableParams("t", 8, device_cache=DeviceCache(prefetch_pipeline=True))


def test_a_prefetch_pipeline_is_refused_with_what_it_cannot_serve_when_the_table_is_declared():
    """fbgemm's prefetch pipeline locks cache lines until fbgemm's own update (not an update the
    table runs itself), and a prefetch looks a batch up before the previous backward, when no
    row may move (no eviction in lookups): both refused by the parameters, not in the workers."""
    cache = DeviceCache(rows=64, prefetch_pipeline=True)
    kw = dict(num_embeddings=2**30, total_num_buckets=16, device_cache=cache)
    for own in (dict(optimizer="adam"), dict(weight_decay=0.01, weight_decay_mode="l2"),
                dict(weight_decay=0.01, weight_decay_mode="decouple", weight_dtype="fp16")):
        with pytest.raises(ValueError, match="'t': device_cache prefetch_pipeline with an update the table runs itself"):
            KVZCHTableParams("t", 8, **kw, **own)
    for eviction in (EvictionPolicy("lru", max_rows=1000), EvictionPolicy("ttl", ttl_steps=5),
                     EvictionPolicy("lfu", count_threshold=2, trigger="rows", trigger_rows=100),
                     EvictionPolicy("ttl", ttl_steps=5, table_max_rows=10_000)):
        with pytest.raises(ValueError, match="'t': device_cache prefetch_pipeline with eviction in the lookups"):
            KVZCHTableParams("t", 8, eviction=eviction, **kw)
    manual = KVZCHTableParams("t", 8, eviction=EvictionPolicy("ttl", ttl_steps=5, trigger="manual"), **kw)
    assert manual.device_cache.prefetch_pipeline and not manual.own_update  # (passes run between steps)
    with pytest.raises(ValueError, match="'t': device_cache policy 'lfu' is set without a cache size"):
        KVZCHTableParams("t", 8, device_cache=DeviceCache(policy="lfu"))


def test_a_freeze_under_a_pending_update_copies_the_cached_rows(fake):
    """An async save frozen between a forward and its backward: the rows the pending update will
    write are copied aside from their cached copies (fresher than the host's), not the host rows."""
    ids = torch.arange(40) * 7919 + 3
    frozen = {}
    for cache_rows, ops in ((64, fake), (None, None)):
        store = RowStore(params(cache_rows))
        train(store, ids, ops)
        train(store, ids, ops)  # the rows' fresh values: in the cache only
        slots = torch.unique(store.lookup_for_update(ids))  # a forward (its cache fill), its update pending
        if ops is not None:
            ops.populate(store.row_cache, slots, store.clock)
        update = store.expect_update(slots)
        at_freeze = store.peek(torch.sort(ids).values)
        snap = RowSnapshot(store)
        snap.freeze()
        frozen[cache_rows] = snap.read(0, len(snap), RowPart.WEIGHT)
        assert torch.equal(frozen[cache_rows], at_freeze)
        store.update_started(update)  # the backward: the cached copies change
        if store.row_cache is not None:
            store.row_cache.weights.add_(1.0)
        store.weights[slots] += 1.0
        assert torch.equal(snap.read(0, len(snap), RowPart.WEIGHT), at_freeze)
    assert torch.equal(frozen[64], frozen[None])


def test_the_cache_size_follows_the_shard(fake):
    p = KVZCHTableParams("t", 8, num_embeddings=2**30, total_num_buckets=16, expected_rows=64_000,
                         device_cache=DeviceCache(load_factor=0.5))
    store = RowStore(p, p.bucket_range(0, 4))  # 4 of 16 buckets: 16,000 rows expected, half cached
    assert store.row_cache.rows == 8_000 and store.row_cache.sets == 250
    for rows, want in ((5_000, 5_000), (20_000, 8_000)):  # both sizes: the smaller
        cache = DeviceCache(rows=rows, load_factor=0.5)
        assert cache.shard_rows(p.expected_rows, 4, p.total_num_buckets) == want


def test_torchrecs_cache_declarations_size_a_cuda_shards_device_cache():
    """TorchRec's CacheParams (or the fused params they become) and KeyValueParams'
    max_l1_cache_size make a CUDA shard's device cache (a table's own DeviceCache wins); the
    sharders apply this on CUDA devices only."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm
    from torchrec.distributed.types import CacheParams, KeyValueParams

    from torchrec_kvzch.torchrec.device_cache import with_device_cache

    table = KVZCHTableParams("t", 8)  # fp32 rows of 32 bytes
    assert with_device_cache(table, {"learning_rate": 0.1}) is table
    got = with_device_cache(table, {"cache_load_factor": 0.3, "cache_algorithm": CacheAlgorithm.LFU}).device_cache
    assert (got.load_factor, got.rows, got.policy.value) == (0.3, None, "lfu")
    assert with_device_cache(table, {"cache_load_factor": 0.3}).device_cache.policy.value == "lru"
    assert with_device_cache(table, {"cache_load_factor": 0.3, "prefetch_pipeline": True}).device_cache.prefetch_pipeline
    assert with_device_cache(table, {"prefetch_pipeline": True}, CacheParams(load_factor=0.1, prefetch_pipeline=False)
                             ).device_cache.prefetch_pipeline is False
    got = with_device_cache(table, {"cache_load_factor": 0.3}, CacheParams(load_factor=0.1),
                            KeyValueParams(max_l1_cache_size=2)).device_cache  # (the constraint's factor wins)
    assert (got.load_factor, got.rows) == (0.1, (2 << 20) // 32)
    own = KVZCHTableParams("t", 8, device_cache=DeviceCache(rows=5))
    assert with_device_cache(own, {"cache_load_factor": 0.3}) is own
    # A table's CacheParams ask for a cache (upstream's load factor, 0.2, when they give none); the
    # sharders' fused params, which ordinary tables share, only with a size.
    got = with_device_cache(table, {}, CacheParams(algorithm=CacheAlgorithm.LFU)).device_cache
    assert (got.load_factor, got.rows, got.policy.value) == (0.2, None, "lfu")
    assert with_device_cache(table, {"cache_algorithm": CacheAlgorithm.LFU}) is table


def test_cache_declarations_a_kvzch_table_cannot_honour_are_refused_by_name(caplog):
    """On CUDA ranks a table's CacheParams fields its GPU cache cannot honour (a precision other
    than the rows', reserved memory, multipass prefetch, statistics) and malformed sizes are
    refused, naming the field; on CPU ranks the CacheParams have no use and are logged."""
    import logging

    from torchrec.distributed.types import CacheParams, CacheStatistics, KeyValueParams
    from torchrec.modules.embedding_configs import DataType

    from torchrec_kvzch.torchrec.device_cache import with_device_cache

    class Stats(CacheStatistics):  # (an abstract interface: any statistics object)
        expected_lookups = expected_miss_rate = cacheability = 0.0

    table = KVZCHTableParams("t", 8)
    for field, value in (("precision", DataType.FP16), ("reserved_memory", 1.0), ("stats", Stats())):
        with pytest.raises(ValueError, match=f"'t': CacheParams.{field} .*cannot be honoured.*fix: drop it"):
            with_device_cache(table, {}, CacheParams(load_factor=0.2, **{field: value}))
    assert with_device_cache(table, {}, CacheParams(load_factor=0.2, precision=DataType.FP32)).device_cache.enabled
    for cache, kv, field in ((CacheParams(load_factor=0), None, "CacheParams.load_factor"),
                             (CacheParams(load_factor=True), None, "CacheParams.load_factor"),
                             (None, KeyValueParams(max_l1_cache_size=0), "KeyValueParams.max_l1_cache_size"),
                             (None, KeyValueParams(max_l1_cache_size=0.5), "KeyValueParams.max_l1_cache_size"),
                             (CacheParams(load_factor=0.2, prefetch_pipeline="False"), None,
                              "CacheParams.prefetch_pipeline")):
        with pytest.raises(ValueError, match=f"'t': {field} must be"):
            with_device_cache(table, {}, cache, kv)
    with pytest.raises(ValueError, match="'t': the fused param cache_load_factor must be"):
        with_device_cache(table, {"cache_load_factor": "abc"})
    with caplog.at_level(logging.WARNING):
        cpu = with_device_cache(KVZCHTableParams("on_cpu", 8), {}, CacheParams(load_factor=0.2), cuda=False)
    assert not cpu.device_cache.enabled
    assert "KV-ZCH table 'on_cpu': CacheParams size the GPU cache" in caplog.text


def test_the_sharders_give_cuda_shards_torchrecs_cache_and_cpu_shards_none():
    from torchrec.distributed.types import CacheParams, ParameterSharding
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    from torchrec_kvzch.torchrec.declarations import KVZCH_KERNEL
    from torchrec_kvzch.torchrec.modules import store_plan

    config = EmbeddingBagConfig(name="user", embedding_dim=8, num_embeddings=1 << 20, feature_names=["f"],
                                use_virtual_table=True, total_num_buckets=16)
    sharding = ParameterSharding(sharding_type="row_wise", compute_kernel=KVZCH_KERNEL, ranks=[0],
                                 cache_params=CacheParams(load_factor=0.25))
    for device, enabled in (("cpu", False), ("cuda", True)):
        planned = store_plan([config], {"user": sharding}, {}, device=torch.device(device))["user"]
        assert planned.kvzch.device_cache.enabled is enabled
