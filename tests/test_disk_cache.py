"""A table shard over a disk tier (issue 32): training with a DRAM cache far smaller than the
table is training in DRAM - the same outputs, and the same rows (headers, weights, optimizer
state) bit for bit, wherever they are - and evaluation moves no row."""

import dataclasses

import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from hypothesis import given, settings, strategies as st

from torchrec_kvzch import EvictionPolicy, KVZCHTableParams, TableTBE
from torchrec_kvzch.params import AdmissionPolicy, CachePolicy, DiskStorage
from torchrec_kvzch.table import disk_cache
from torchrec_kvzch.table.disk_cache import lowest
from torchrec_kvzch.table.kv_tensor import KVTensor
from torchrec_kvzch.table.layout import RowPart, make_meta
from torchrec_kvzch.table.snapshot import RowSnapshot


def step(tbes, gen, universe, bags=64):
    """One training step of each of ``tbes`` on the same batch and gradient."""
    lengths = torch.randint(0, 3, (2 * bags,), generator=gen)
    ids = universe[torch.randint(0, universe.numel(), (int(lengths.sum()),), generator=gen)]
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    outs = [t(ids, offsets) for t in tbes]
    grad = torch.randn(outs[0].shape, generator=gen)
    for out in outs:
        assert torch.equal(out, outs[0])
        out.backward(grad)
    return ids, offsets


def bits(rows: torch.Tensor) -> torch.Tensor:
    return rows.contiguous().view(torch.int32)  # (whole rows hold int64 headers: no float compare)


def tables(tmp_path, cache_rows: int, **kw):
    p = KVZCHTableParams("t", 16, num_embeddings=2**40, total_num_buckets=8, learning_rate=0.05,
                         stochastic_rounding=False, init_range=(-0.5, 0.5), **kw)
    from torchrec_kvzch.table.layout import RowLayout
    disk = dataclasses.replace(p, storage=DiskStorage(tmp_path, RowLayout.for_table(p).stored_bytes * cache_rows))
    return disk, p


@pytest.mark.parametrize("optimizer,pooling,piece", [("exact_rowwise_adagrad", PoolingMode.SUM, None),
                                                     ("exact_sgd", PoolingMode.MEAN, None),
                                                     ("exact_rowwise_adagrad", PoolingMode.MEAN, 7)])
def test_training_over_a_small_dram_cache_is_training_in_dram(tmp_path, monkeypatch, optimizer, pooling, piece):
    """``piece``: rows moved at a time (default: the batch's misses at once)."""
    disk, dram = tables(tmp_path, 300, optimizer=optimizer)
    ours = TableTBE(disk, disk.bucket_range(0, 1), num_features=2, pooling=pooling)
    ref = TableTBE(dram, dram.bucket_range(0, 1), num_features=2, pooling=pooling)
    if piece:
        monkeypatch.setattr(disk_cache, "PIECE", piece)
        write_rows, limit = ours.store.write_rows, ours.store.cache.max_rows

        def bounded(*args, **kw):  # DRAM stays within the cache after every piece
            written = write_rows(*args, **kw)
            assert len(ours.store) <= limit
            return written
        monkeypatch.setattr(ours.store, "write_rows", bounded)
    gen = torch.Generator().manual_seed(0)
    universe = torch.randint(0, 2**40, (2000,), generator=gen).unique()
    for _ in range(10):
        lengths = torch.randint(0, 3, (2 * 64,), generator=gen)
        ids = universe[torch.randint(0, universe.numel(), (int(lengths.sum()),), generator=gen)]
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        out, want = ours(ids, offsets), ref(ids, offsets)
        assert torch.equal(out, want)
        grad = torch.randn(want.shape, generator=gen)
        out.backward(grad)
        want.backward(grad)
    store, cache = ours.store, ours.store.cache
    assert len(store) <= cache.max_rows and cache.moved_out > 0 and cache.moved_in > 0
    assert len(store) + len(cache) == len(ref.store)
    seen = torch.sort(ref.store.keys()).values
    bits = [s.read_ids(seen, RowPart.ROW).view(torch.int32) for s in (store, ref.store)]  # (headers: no float compare)
    assert torch.equal(*bits)
    moved = (cache.moved_out, cache.moved_in, len(store))
    with torch.no_grad():  # evaluation reads rows where they are: the same outputs, nothing moves
        assert torch.equal(ours.eval()(ids, offsets), ref.eval()(ids, offsets))
    assert (cache.moved_out, cache.moved_in, len(store)) == moved
    assert store.counters["disk_rows"] == len(cache) and store.counters["disk_bytes_written"] > 0
    store.clear()  # (what a load starts with): the rows on disk go too
    assert len(store) == len(cache) == 0


def test_admission_knows_the_ids_on_disk(tmp_path):
    """An id whose row went to disk is a known id: admission never counts it again."""
    disk, dram = tables(tmp_path, 40, admission=AdmissionPolicy("count", min_count=2))
    ours = TableTBE(disk, disk.bucket_range(0, 1), num_features=1, pooling=PoolingMode.SUM)
    ref = TableTBE(dram, dram.bucket_range(0, 1), num_features=1, pooling=PoolingMode.SUM)
    gen = torch.Generator().manual_seed(1)
    for _ in range(12):
        ids = torch.randint(0, 120, (30,), generator=gen) * 2**20
        offsets = torch.arange(31)
        out, want = ours(ids, offsets), ref(ids, offsets)
        assert torch.equal(out, want)
        out.sum().backward()
        want.sum().backward()
    assert len(ours.store.cache) > 0 and ours.store.counters["admitted"] == ref.store.counters["admitted"]


def test_what_a_disk_tier_cannot_do_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="storage cache_bytes set without a path"):
        KVZCHTableParams("t", 16, storage=DiskStorage(cache_bytes=1 << 20))
    with pytest.raises(ValueError, match="storage needs one of cache_bytes .* got neither"):
        KVZCHTableParams("t", 16, storage=DiskStorage(tmp_path))
    for name in ("a/b", "/abs", "../up", ".."):  # (the tier's folder is storage.path / name)
        message = "contains '.'" if "." in name else "name names the disk tier's folder .* one path component"
        with pytest.raises(ValueError, match=message):  # (a '.' no TorchRec collection takes, first)
            KVZCHTableParams(name, 16, storage=DiskStorage(tmp_path, cache_bytes=1 << 20))
    disk, _ = tables(tmp_path, 20)
    tbe = TableTBE(disk, disk.bucket_range(0, 1), num_features=1, pooling=PoolingMode.SUM)
    with pytest.raises(ValueError, match="a batch of 30 distinct ids .* does not fit its DRAM cache of 20 rows"):
        tbe(torch.arange(30) * 2**20, torch.arange(31))


def test_refused_batches_and_writes_change_nothing_over_a_disk_tier(tmp_path):
    """A batch too large for the cache is refused before admission and eviction run (a budget and
    a TTL would otherwise have dropped rows, admission counted ids); a write with one id of
    another shard is refused before its first piece is written."""
    disk, _ = tables(tmp_path, 20, eviction=EvictionPolicy("lru", max_rows=25),
                     admission=AdmissionPolicy("count", min_count=2))
    tbe = TableTBE(disk, disk.bucket_range(0, 2), num_features=1, pooling=PoolingMode.SUM)
    store = tbe.store
    for step in range(6):  # (each id twice: admitted on its second sighting)
        tbe(torch.arange(10) + 10 * (step // 2), torch.arange(11)).sum().backward()

    def state():
        ids = torch.sort(torch.cat([store.keys(), store.cache.tier.keys()])).values
        return ids.tolist(), store.clock, dict(store.counters)
    before = state()
    with pytest.raises(ValueError, match="a batch of 30 distinct ids .* does not fit"):
        tbe(torch.arange(100, 130), torch.arange(31))
    assert state() == before
    r = store.bucket_range
    with pytest.raises(ValueError, match="outside this shard's ids"):
        tbe.write(torch.cat([torch.arange(200, 240), torch.tensor([r.id_end + 5])]), torch.randn(41, 16))
    assert state() == before


def test_a_tier_file_changed_under_the_table_is_refused_on_every_read(tmp_path):
    """Every row on disk begins with its id: a file another writer changed (or a damaged disk)
    is refused by the reads that would have returned its rows, naming the table and the file,
    instead of handing back another id's row."""
    disk, _ = tables(tmp_path, 200)
    tbe = TableTBE(disk, disk.bucket_range(0, 1), num_features=2, pooling=PoolingMode.SUM)
    gen = torch.Generator().manual_seed(3)
    universe = torch.randint(0, 2**40, (600,), generator=gen).unique()
    for _ in range(4):
        step([tbe], gen, universe)
    tier = tbe.store.cache.tier
    on_disk = tier.keys()
    assert on_disk.numel() > 0
    with open(tier.path, "r+b") as f:  # another writer: the file's rows shifted by one row
        data = f.read()
        f.seek(0)
        f.write(data[tier.row_bytes:] + data[:tier.row_bytes])
    reads = {"evaluation": lambda: tbe.eval()(on_disk[:5], torch.tensor([0, 5])),
             "snapshot": lambda: RowSnapshot(tbe.store).read(0, len(RowSnapshot(tbe.store)), RowPart.WEIGHT),
             "training": lambda: tbe.train()(on_disk[:5], torch.tensor([0, 5]))}
    for name, read in reads.items():
        with pytest.raises(RuntimeError, match=f"table 't': the disk tier's file {tier.path} holds id"):
            read()


def test_a_snapshot_reads_both_tiers_as_one_table_plain_frozen_and_changed(tmp_path):
    """Every row in id order whichever tier holds it; frozen, as at the freeze while training
    moves rows between the tiers; the rows changed since a mark, told by the headers the tier
    keeps; and loaded back into another disk-tier table through the KV tensor, bit for bit."""
    disk, dram = tables(tmp_path / "a", 200)
    ours = TableTBE(disk, disk.bucket_range(0, 1), num_features=2, pooling=PoolingMode.SUM)
    ref = TableTBE(dram, dram.bucket_range(0, 1), num_features=2, pooling=PoolingMode.SUM)
    gen = torch.Generator().manual_seed(2)
    universe = torch.randint(0, 2**40, (1500,), generator=gen).unique()
    for _ in range(6):
        step([ours, ref], gen, universe)
    assert len(ours.store.cache) > 0
    snaps = [RowSnapshot(t.store) for t in (ours, ref)]
    assert torch.equal(snaps[0].ids, snaps[1].ids)
    n = len(snaps[1])
    for part in (RowPart.ROW, RowPart.WEIGHT, RowPart.OPTIMIZER, RowPart.META):
        assert torch.equal(bits(snaps[0].read(0, n, part)), bits(snaps[1].read(0, n, part)))
    before = bits(snaps[1].read(0, n, RowPart.ROW)).clone()
    for s in snaps:
        s.freeze()
    moved = ours.store.cache.moved_out
    for _ in range(4):
        step([ours, ref], gen, universe)
    assert ours.store.cache.moved_out > moved  # rows moved while frozen
    for s in snaps:
        assert torch.equal(bits(s.read(0, n, RowPart.ROW)), before)  # as at the freeze
        assert torch.equal(bits(s.read(7, 50, RowPart.ROW)), before[7:57])
        s.release()
    mark = [RowSnapshot(t.store).mark for t in (ours, ref)]
    for _ in range(2):
        step([ours, ref], gen, universe)
    now = [RowSnapshot(t.store) for t in (ours, ref)]
    changed = [s.changed_since(m) for s, m in zip(now, mark)]
    assert torch.equal(changed[0].ids, changed[1].ids) and 0 < len(changed[1]) < len(now[1])
    assert torch.equal(bits(changed[0].read(0, len(changed[0]), RowPart.ROW)),
                       bits(changed[1].read(0, len(changed[1]), RowPart.ROW)))
    # Loaded back into another disk-tier table (a cache far smaller than the rows): both tiers filled.
    copy, _ = tables(tmp_path / "b", 150)
    other = TableTBE(copy, copy.bucket_range(0, 1), num_features=2, pooling=PoolingMode.SUM)
    rows = KVTensor(ours.store, RowPart.ROW).full_tensor()
    assert KVTensor(other.store, RowPart.ROW, ids=torch.empty(0, dtype=torch.long)).load(rows) == len(now[1])
    assert len(other.store) <= other.store.cache.max_rows and len(other.store.cache) > 0
    assert torch.equal(bits(RowSnapshot(other.store).read(0, len(now[1]), RowPart.ROW)),
                       bits(now[1].read(0, len(now[1]), RowPart.ROW)))
    ids, offsets = step([other, ref], gen, universe)  # and it trains on as the DRAM table does
    with torch.no_grad():
        assert torch.equal(other.eval()(ids, offsets), ref.eval()(ids, offsets))


def test_tables_over_disk_tiers_save_async_and_resume_at_other_world_sizes_exactly(pools, tmp_path):
    """test_resume's model with both KV-ZCH tables over disk tiers whose caches hold a fraction
    of their rows, one of them under lfu eviction (counts decayed, rows evicted from both
    tiers): trained on 2 ranks and saved asynchronously while training goes on (rows moving
    between the tiers), then resumed on 1 rank over a disk tier and on 3 ranks in DRAM: every
    row with its header and every history as a run in DRAM that never saved."""
    import test_resume as r
    from torchrec_kvzch.table.layout import RowLayout

    # 24 rows a table over its shards: every batch's ids fit a shard's share (12 a step at most)
    cache = RowLayout.for_table(r.table_params()[0]).stored_bytes * 24
    ckpt = str(tmp_path / "ckpt")
    pools[2].run(r.save_run, "lfu", 10, 3, ckpt, True, 0.0, {"storage": (str(tmp_path / "tier2"), cache)})
    for world, table_kw in ((1, {"storage": (str(tmp_path / "tier1"), cache)}), (3, None)):
        expected = pools[world].run(r.reference_run, "lfu", 10, 3, 0.0)
        got = pools[world].run(r.resume_run, "lfu", 10, 3, ckpt, 0.0, table_kw)
        # (Outputs differ across world sizes by design: TorchRec seeds the ordinary table per shard.)
        assert r.same(expected[0][0], got[0][0], across_worlds=True) == []
        history = got[0][0]["history"][0]
        assert history["u"][3] > 24 and history["t"][2] > 0  # past the cache; evictions


def test_the_job_over_disk_tiers_computes_what_it_computes_in_dram_and_reports_the_tier(tmp_path):
    """The shipped ``disk`` config is the quickstart with its KV-ZCH tables over disk tiers
    (here with caches of a fraction of the rows the run creates, under the run directory): 2
    ranks train and save with the quickstart's losses and predictions, bit for bit, and resume
    on 1 rank; the metrics report the caches' hit rates and the disks' bytes."""
    import json

    from test_train import train
    from torchrec_kvzch.job import config_path

    config = tmp_path / "disk.yaml"  # the shipped one, with caches of 234 rows (2^15 bytes) a table
    config.write_text(config_path("disk").read_text().replace("cache_bytes: 2^21", "cache_bytes: 2^15")
                      .replace("cache_bytes: 2^22", "cache_bytes: 2^15"))
    small = ["--global-batch-size", "64", "--population", "20000", "--checkpoint-every", "4", "--log-every", "2"]
    _, dram = train(tmp_path / "dram", "--steps", 8, *small, "--config", "quickstart")
    _, disk = train(tmp_path / "disk", "--steps", 8, *small, "--config", config)
    assert disk["loss_curve"] == dram["loss_curve"] and disk["probe_final"] == dram["probe_final"]
    assert (tmp_path / "disk" / "tier" / "user").is_dir()
    lines = [json.loads(line) for line in (tmp_path / "disk" / "metrics.jsonl").read_text().splitlines()]
    last = [m for m in lines if m["kind"] == "train"][-1]
    assert sum(last["disk_rows"].values()) > 0 and sum(last["disk_bytes_written"].values()) > 0
    assert all(0 < rate < 1 for rate in last["cache_hit_rate"].values())
    _, resumed = train(tmp_path / "disk", "--steps", 12, *small, "--config", config, nproc=1, summary="resumed.json")
    assert resumed["resumed_from"] == 8 and resumed["probe_after_resume"] == disk["probe_final"]


def test_room_reserved_up_front_splits_between_the_cache_and_the_tier(tmp_path):
    """``initial_rows`` (the planner's expected rows) reserves DRAM for the cache's rows only
    and the tier's index for the rest, so filling the table grows neither; a clear (a load)
    keeps both."""
    disk, _ = tables(tmp_path, 2000)
    tbe = TableTBE(disk, disk.bucket_range(0, 1), initial_rows=10_000)
    store, tier = tbe.store, tbe.store.cache.tier
    assert store.capacity == 2000 and tier.index.capacity >= 8000 and tier.position.numel() == 0
    reserved = (store.id_map.capacity, tier.index.capacity, tier._position.numel(), tier._used.numel())
    ids = torch.randint(0, 2**40, (9100,), generator=torch.Generator().manual_seed(3)).unique()[:9000]
    layout = store.layout
    rows = layout.pack(ids, torch.full_like(ids, make_meta(0, 1, used=True)), torch.rand(ids.numel(), 16),
                       torch.zeros(ids.numel(), layout.optimizer_floats))
    assert store.write_rows(rows) == ids.numel() and len(tier) == ids.numel() - len(store)
    assert (store.capacity, store.id_map.capacity, tier.index.capacity, tier._position.numel(),
            tier._used.numel()) == (2000, *reserved)
    store.clear()
    assert (tier.index.capacity, tier._position.numel()) == reserved[1:3]


def test_rows_go_to_disk_in_id_order(tmp_path):
    """Rows moved out together sit in the file in id order (a checkpoint, reading in id order,
    then reads runs of units rather than a unit a row)."""
    disk, _ = tables(tmp_path, 200)
    tbe = TableTBE(disk, disk.bucket_range(0, 1), num_features=1, pooling=PoolingMode.SUM)
    gen = torch.Generator().manual_seed(4)
    for _ in range(2):  # the second batch moves 100 rows out, to fresh units at the file's end
        ids = torch.randint(0, 2**40, (150,), generator=gen)
        tbe(ids, torch.arange(151)).sum().backward()
    tier = tbe.store.cache.tier
    keys = tier.keys().clone()
    assert len(tier) == 100 and torch.equal(keys[torch.argsort(tier.position)], torch.sort(keys).values)


def test_an_lfu_cache_keeps_rows_looked_up_often_where_lru_lets_them_go(tmp_path):
    """Ids looked up every third step among a stream of new ones: an ``lru`` cache moves them
    out on the steps between (the new rows are more recent), an ``lfu`` one keeps them (their
    counts are higher). Either way training is training in DRAM, bit for bit."""
    hot = torch.arange(40) * 2**30
    hits = {}
    for policy in ("lru", "lfu"):
        disk, dram = tables(tmp_path / policy, 150)
        disk = dataclasses.replace(disk, storage=dataclasses.replace(disk.storage, policy=policy))
        ours = TableTBE(disk, disk.bucket_range(0, 1), num_features=1, pooling=PoolingMode.SUM)
        ref = TableTBE(dram, dram.bucket_range(0, 1), num_features=1, pooling=PoolingMode.SUM)
        for i in range(12):
            new = torch.arange(100 * i, 100 * i + 90) * 2**20 + 1
            ids = torch.cat([hot, new[:50]]) if i % 3 == 0 else new
            out, want = ours(ids, torch.arange(ids.numel() + 1)), ref(ids, torch.arange(ids.numel() + 1))
            assert torch.equal(out, want)
            out.sum().backward()
            want.sum().backward()
        hits[policy] = ours.store.cache.hits
        assert ours.store.cache.policy.value == policy
    assert hits["lfu"] >= hits["lru"] + 2 * 40  # from the second return on, every hot row is a hit
    with pytest.raises(ValueError, match="storage policy 'lfru' is unknown; did you mean 'lru'"):
        KVZCHTableParams("t", 16, storage=DiskStorage(tmp_path, cache_bytes=1 << 20, policy="lfru"))
    from torchrec_kvzch.job import config_path
    from torchrec_kvzch.torchrec.config import load_config
    config = tmp_path / "lfu.yaml"  # and in a YAML config's storage block
    config.write_text(config_path("disk").read_text().replace("cache_bytes: 2^21}", "cache_bytes: 2^21, policy: LFU}"))
    assert load_config(config).tables[0].kvzch.storage.policy is CachePolicy.LFU


@settings(max_examples=30, deadline=None)
@given(size=st.sampled_from([1, 1000, 300_000, 1_000_000]), span=st.sampled_from([1, 3, 300, 2**62]),
       share=st.floats(0, 1), seed=st.integers(0, 2**16))
def test_the_cache_moves_out_exactly_its_lowest_ranked_rows(size, span, share, seed):
    """``lowest`` (a sampled guess, then an exact top-k of the few under it) picks what a top-k
    over every key picks: timestamps tied by the step, random keys, all keys equal."""
    keys = torch.randint(0, span, (size,), generator=torch.Generator().manual_seed(seed))
    n = max(1, int(share * size))
    picked = lowest(keys, n)
    assert picked.unique().numel() == n
    assert torch.equal(keys[picked].sort().values, torch.topk(keys, n, largest=False).values.sort().values)
