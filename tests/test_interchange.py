"""Interchange with plain torch and upstream TorchRec: checkpoint metadata readable without the
plugin, upstream-layout checkpoints loaded at other world sizes, ``load_state_dict`` across models
and from upstream state dicts, plain ``weight_id`` shards, and fbgemm's ``set_range`` semantics.

Ranks for world sizes 1-3 are started once for the module (``RankPool``)."""

import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from _dist import sharded
from torchrec_kvzch import KVTensor, KVZCHTableParams, RowPart, RowStore
from torchrec_kvzch import KVZCHLoadPlanner, KVZCHSavePlanner
from torchrec_kvzch.checkpoint.record import PLANNER_DATA_KEY, CheckpointMappings, SavedTable, saved_record
from torchrec_kvzch.torchrec.state_dict import kv_view
from torchrec_kvzch.torchrec import KVZCHConstraints, kvzch_embedding_bag_config, kvzch_tables
from torchrec_kvzch.torchrec.tables import kvzch_kernels
from torchrec_kvzch.table.snapshot import RowSnapshot
from torchrec_kvzch.table.layout import make_meta, meta_timestamp, meta_used

BUCKETS, BUCKET_SIZE = 6, 2**30
NUM_EMBEDDINGS = BUCKETS * BUCKET_SIZE
TABLES = (("t", True), ("u", False))  # t: whole rows, u: weights, ids and optimizer state apart


# -- the model ---------------------------------------------------------------------------------
def build(buckets=BUCKETS, dim=8, num_embeddings=NUM_EMBEDDINGS):
    kv = [KVZCHTableParams(name, dim, num_embeddings=num_embeddings, total_num_buckets=buckets,
                           learning_rate=0.1, enable_optimizer_offloading=True,
                           backend_return_whole_row=whole, checkpoint_chunk_rows=16, expected_rows=500)
          for name, whole in TABLES]
    plain = EmbeddingBagConfig(name="plain", embedding_dim=8, num_embeddings=40, feature_names=["f_plain"])
    ebc = EmbeddingBagCollection(tables=[kvzch_embedding_bag_config(t, [f"f_{t.name}"]) for t in kv] + [plain],
                                 device=torch.device("meta"))
    return sharded(ebc, {t.name: KVZCHConstraints(kvzch=t) for t in kv},
                   {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}, batch_size=16)


def train(model, seed, steps=3, n=24):
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * seed + step)
        values = torch.cat([torch.randint(0, NUM_EMBEDDINGS, (2 * n,), generator=gen),
                            torch.randint(0, 40, (n,), generator=gen)])
        kjt = KeyedJaggedTensor(keys=["f_t", "f_u", "f_plain"], values=values,
                                lengths=torch.ones(3 * n, dtype=torch.long))
        model(kjt).wait().values().sum().backward()


def all_rows(model):
    """{(table, id): whole row as raw int32 bits (header, weight, optimizer state)} over all ranks."""
    mine = {}
    for name, tbe in kvzch_tables(model):
        ids = torch.sort(tbe.store.keys()).values
        mine.update(((name, i), r.view(torch.int32)) for i, r in zip(ids.tolist(), tbe.store.read_ids(ids, "row")))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {k: v for g in gathered for k, v in g.items()}


def same_rows(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def state_of(model):
    return {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}


def newest_stamp(store) -> int:
    meta = store.read_ids(torch.sort(store.keys()).values, "meta").reshape(-1)
    stamps = meta_timestamp(meta[meta_used(meta)])
    return int(stamps.max()) if stamps.numel() else 0


# -- 1. metadata readable with plain torch ------------------------------------------------------
def save_ours(rank, world, path):
    model = build()
    train(model, 10 + rank)
    dcp.save(state_of(model), checkpoint_id=path, planner=KVZCHSavePlanner())
    return all_rows(model)


class PendingProbe(KVZCHLoadPlanner):
    """Records the most chunks of split tables held at once, waiting for their other parts
    (whether read straight from the files or by DCP's reader)."""

    most_pending = 0

    def finish_plan(self, new_plan):
        tables = set(self._tables.values())
        for table in tables:
            def probe(*args, receive=table.receive):
                receive(*args)
                held = sum(len(t.pending) for t in tables)
                PendingProbe.most_pending = max(PendingProbe.most_pending, held)
            table.receive = probe
        return super().finish_plan(new_plan)


def load_ours(rank, world, path):
    model = build()
    train(model, 50 + rank, steps=1)
    state = state_of(model)
    dcp.load(state, checkpoint_id=path, planner=PendingProbe(checkpoint_id=path))
    # One data file per saving rank: a split chunk's parts (weights, ids, header words,
    # optimizer state) arrive one after another, so at most one chunk waits at a time.
    assert PendingProbe.most_pending == 1
    model.load_state_dict(state["model"])
    model.fused_optimizer.load_state_dict(state["optim"])
    return all_rows(model)


READ_METADATA = textwrap.dedent("""
    import json, sys
    sys.modules["torchrec_kvzch"] = None  # importing the plugin fails from here on
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    metadata = FileSystemReader(sys.argv[1]).read_metadata()
    record = metadata.planner_data["__torchrec_kvzch__"]
    if len(sys.argv) > 2:  # the whole checkpoint into one torch.save file, by DCP's own mappings
        dcp_to_torch_save(sys.argv[1], sys.argv[2])
        state = torch.load(sys.argv[2], weights_only=True)
        record["rows"] = list(state["model"]["embedding_bags.t.weight"].shape)
    print(json.dumps(record))
""")


def read_without_plugin(*paths):
    return subprocess.run([sys.executable, "-c", READ_METADATA, *paths], capture_output=True, text=True)


def test_metadata_is_plain_data_and_old_records_still_load(pools, tmp_path):
    """The checkpoint's metadata unpickles with torch alone (the plugin made unimportable) and
    holds the tables' record as plain data; a checkpoint whose metadata holds the record of
    earlier versions (classes of the plugin: unreadable without it) still loads."""
    path = str(tmp_path / "ckpt")
    saved = pools[2].run(save_ours, path)[0]
    done = read_without_plugin(path, str(tmp_path / "whole.pt"))
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(done.stdout)
    assert record["rows"] == [sum(1 for name, _ in saved if name == "t"), 16]
    assert record["format"] == 1 and record["checksum_files"] == ["kvzch_checksums_0.json", "kvzch_checksums_1.json"]
    t, u = record["tables"]["model.embedding_bags.t.weight"], record["tables"]["model.embedding_bags.u.weight"]
    assert sum(t["rows_per_rank"]) == sum(1 for name, _ in saved if name == "t") and len(t["rows_per_rank"]) == 2
    assert (t["layout"], u["layout"], t["embedding_dim"], t["weight_dtype"], t["optimizer"]) == (
        "whole_row", "split", 8, "fp32", "exact_row_wise_adagrad")
    assert (t["num_embeddings"], t["total_num_buckets"], t["row_width"], u["row_width"]) == (NUM_EMBEDDINGS, BUCKETS, 16, 8)

    old = str(tmp_path / "old")
    shutil.copytree(path, old)
    metadata = FileSystemReader(old).read_metadata()
    tables, files = saved_record(metadata.planner_data)
    mappings = {k: v for k, v in metadata.planner_data.items() if k != PLANNER_DATA_KEY}
    metadata.planner_data = CheckpointMappings(mappings, tables, files)
    with open(os.path.join(old, ".metadata"), "wb") as f, pytest.MonkeyPatch.context() as mp:
        for cls in (CheckpointMappings, SavedTable):  # pickled where the old versions had them
            mp.setattr(cls, "__module__", "torchrec_kvzch.checkpoint.planner")
        pickle.dump(metadata, f)
    assert b"torchrec_kvzch.checkpoint.planner" in open(os.path.join(old, ".metadata"), "rb").read()
    assert read_without_plugin(old).returncode != 0  # the old record needs the plugin
    assert same_rows(pools[2].run(load_ours, old)[0], saved)


# -- 2. upstream-layout checkpoints -------------------------------------------------------------
def one_shard_per_rank(local: torch.Tensor, offsets=None, total=None) -> ShardedTensor:
    """Upstream's layout: one row-wise shard per rank, rank r's rows after those of ranks < r."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if offsets is None:
        counts = [None] * world
        dist.all_gather_object(counts, local.shape[0])
        offsets = [sum(counts[:r]) for r in range(world)] + [sum(counts)]
        sizes = counts
    else:
        sizes = [offsets[r + 1] - offsets[r] for r in range(world)]
    rest = list(local.shape[1:])
    shards = [ShardMetadata([offsets[r]] + [0] * len(rest), [sizes[r]] + rest, f"rank:{r}/cpu") for r in range(world)]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        [Shard(local.contiguous(), shards[rank])],
        ShardedTensorMetadata(shards, torch.Size([offsets[-1]] + rest), TensorProperties(dtype=local.dtype)))


def upstream_state(model, with_metadata=True):
    """The model's state as upstream TorchRec lays out a virtual table: weight (whole rows or
    weights), weight_id [n, 1], bucket [buckets, 1], metadata [n, 1] and a 1-D momentum1 (split)
    or [n, 1] (whole rows); no counters, clock or metaheader."""
    state = state_of(model)
    world = dist.get_world_size()
    for name, tbe in kvzch_tables(model):
        store, base = tbe.store, f"embedding_bags.{name}."
        for extra in ("counters", "clock", "metaheader"):
            state["model"].pop(base + extra, None)
        ids = torch.sort(store.keys()).values
        whole = store.params.backend_return_whole_row
        state["model"][base + "weight"] = one_shard_per_rank(store.read_ids(ids, "row" if whole else "weight"))
        state["model"][base + "weight_id"] = one_shard_per_rank(ids.unsqueeze(1))
        if with_metadata:
            state["model"][base + "metadata"] = one_shard_per_rank(store.read_ids(ids, "meta"))
        starts = [store.params.bucket_range(r, world).start for r in range(world)] + [BUCKETS]
        state["model"][base + "bucket"] = one_shard_per_rank(RowSnapshot(store).bucket_counts().unsqueeze(1), starts)
        optimizer = store.read_ids(ids, "optimizer")
        state["optim"]["state"][base + "weight"][f"{name}.momentum1"] = one_shard_per_rank(
            optimizer if whole else optimizer.reshape(-1))
    return state


def save_upstream(rank, world, path, with_metadata=True, num_embeddings=NUM_EMBEDDINGS):
    model = build(num_embeddings=num_embeddings)
    train(model, 20 + rank)
    dcp.save(upstream_state(model, with_metadata), checkpoint_id=path, planner=DefaultSavePlanner())
    return all_rows(model)


def load_upstream(rank, world, path, buckets=BUCKETS, dim=8):
    """Load into a trained model; (error, rows, rows unchanged, per-table (clock, newest
    stamp, inserted, evicted) of this rank)."""
    model = build(buckets, dim)
    train(model, 60 + rank, steps=1)
    before = all_rows(model)
    state = state_of(model)
    try:
        dcp.load(state, checkpoint_id=path, planner=KVZCHLoadPlanner(checkpoint_id=path))
    except CheckpointException as e:
        return str(e), None, same_rows(before, all_rows(model)), None
    model.load_state_dict(state["model"])
    model.fused_optimizer.load_state_dict(state["optim"])
    history = {name: (k.store.clock, newest_stamp(k.store), k.store.history.inserted, k.store.history.evicted)
               for name, k in kvzch_tables(model)}
    for _, tbe in kvzch_tables(model):  # each rank holds exactly the rows of its buckets
        r, ids = tbe.store.bucket_range, torch.sort(tbe.store.keys()).values
        assert ((ids >= r.id_start) & (ids < r.id_end)).all()
    return None, all_rows(model), None, history


def test_upstream_checkpoint_loads_at_another_world_size(pools, tmp_path):
    """An upstream-layout checkpoint of 2 ranks (stock dcp.save, DefaultSavePlanner) loads at 1
    and 3 ranks: every row arrives bit for bit (id, header, weight, optimizer state) on the rank
    owning its bucket, counters start at zero and each rank's clock is its newest stamp."""
    path = str(tmp_path / "upstream")
    saved = pools[2].run(save_upstream, path)[0]
    assert PLANNER_DATA_KEY not in FileSystemReader(path).read_metadata().planner_data
    assert sum(1 for name, _ in saved if name == "u") > 50
    for world in (1, 3):
        for error, rows, _, history in pools[world].run(load_upstream, path):
            assert error is None, error[-1500:]
            assert same_rows(rows, saved)
            for clock, newest, inserted, evicted in history.values():
                assert clock == newest and inserted == evicted == 0


def test_upstream_checkpoint_without_header_words_and_mismatches(pools, tmp_path):
    """Without ``metadata`` the split table's rows load with fresh headers (stamp 0); a table
    of another total_num_buckets or embedding_dim is refused by name, changing nothing."""
    path = str(tmp_path / "upstream")
    saved = pools[2].run(save_upstream, path, False)[0]
    for error, rows, _, history in pools[3].run(load_upstream, path):
        assert error is None, error[-1500:]
        assert same_rows({k: v for k, v in rows.items() if k[0] == "t"}, {k: v for k, v in saved.items() if k[0] == "t"})
        u_rows = {k: v for k, v in rows.items() if k[0] == "u"}
        assert u_rows.keys() == {k for k in saved if k[0] == "u"}
        for key, row in u_rows.items():  # id, then weights and optimizer state as saved
            assert torch.equal(row[:2], saved[key][:2]) and torch.equal(row[4:], saved[key][4:])
            assert int(row[2:4].view(torch.long)) == int(make_meta(0, 0, used=True))  # fresh: used, stamp 0
        assert history["u"][0] == 0
    for geometry, fragment in (((12, 8), "has 6 buckets, this table 12"),
                               ((BUCKETS, 12), "KV-ZCH table 't' (saved by upstream TorchRec) holds whole rows of 16 columns")):
        for error, _, unchanged, _ in pools[2].run(load_upstream, path, *geometry):
            assert error is not None and fragment in error and path in error, (error or "")[-1500:]
            assert unchanged
    # Saved with twice the bucket size: the ids counted in a rank's buckets are not its ids.
    wider = str(tmp_path / "wider")
    pools[2].run(save_upstream, wider, True, 2 * NUM_EMBEDDINGS)
    for error, _, unchanged, _ in pools[2].run(load_upstream, wider):
        assert error is not None and "saved with another num_embeddings" in error and "KV-ZCH table 't'" in error
        assert unchanged


# -- 3. load_state_dict interchange; 4. plain weight_id shards -----------------------------------
def load_state_dict_across(rank, world):
    source = build()
    train(source, 30 + rank)
    want = all_rows(source)
    out = {}

    # Another model's own state dict: rows, headers and (split table) optimizer state arrive.
    target = build()
    train(target, 40 + rank)
    target.load_state_dict(source.state_dict())
    target.fused_optimizer.load_state_dict(source.fused_optimizer.state_dict())
    out["other model"] = same_rows(all_rows(target), want)

    # Upstream TorchRec's materialised state dict: extra "metadata", no counters / clock.
    upstream = upstream_state(source)  # KV-ZCH entries: plain tensors, one shard per rank
    fresh = build()
    train(fresh, 70 + rank)
    fresh.load_state_dict(upstream["model"])
    fresh.fused_optimizer.load_state_dict(upstream["optim"])
    got = all_rows(fresh)
    out["upstream"] = same_rows(got, want)
    out["upstream history"] = all(k.store.clock == newest_stamp(k.store) and k.store.history.inserted == 0
                                  for _, k in kvzch_tables(fresh))

    # Anything else unknown is still reported, not dropped.
    bogus = source.state_dict()
    bogus["embedding_bags.t.bogus"] = torch.zeros(1)
    try:
        fresh.load_state_dict(bogus)
        out["bogus"] = None
    except RuntimeError as e:
        out["bogus"] = str(e)

    # A strict load refused (an unknown key, a table's weight missing) leaves the KV-ZCH rows, and
    # one refused for a table's entries (rows of another width) changes no table, ordinary ones
    # included. Not strict, a missing weight is reported and the other tables load.
    other = build()
    train(other, 90 + rank)
    theirs, before = other.state_dict(), all_rows(fresh)
    wide = build(dim=12).state_dict()["embedding_bags.u.weight"]
    out["refused"] = []
    for change in ({"embedding_bags.t.bogus": torch.zeros(1)}, {"embedding_bags.u.weight": None},
                   {"embedding_bags.u.weight": wide}):
        state = {k: v for k, v in {**theirs, **change}.items() if v is not None}
        plain = fresh.state_dict()["embedding_bags.plain.weight"].local_shards()[0].tensor.clone()
        try:
            fresh.load_state_dict(state)
        except (RuntimeError, ValueError) as e:
            out["refused"].append("embedding_bags.u.weight" in str(e) or "KV-ZCH table 'u'" in str(e)
                                  or "bogus" in str(e))
            if "KV-ZCH table 'u'" in str(e):
                out["plain unchanged"] = torch.equal(
                    fresh.state_dict()["embedding_bags.plain.weight"].local_shards()[0].tensor, plain)
    out["unchanged after refusals"] = same_rows(all_rows(fresh), before)
    result = fresh.load_state_dict({k: v for k, v in theirs.items() if k != "embedding_bags.u.weight"}, strict=False)
    out["missing reported"] = "embedding_bags.u.weight" in result.missing_keys
    got, want_t = all_rows(fresh), {k: v for k, v in all_rows(other).items() if k[0] == "t"}
    out["not strict loads the rest"] = same_rows({k: v for k, v in got.items() if k[0] == "t"}, want_t)

    # weight_id shards are plain int64 tensors sharing the snapshot's ids; weights stay lazy.
    state = source.state_dict()
    for name, _ in TABLES:
        ids_entry, weight = state[f"embedding_bags.{name}.weight_id"], kv_view(state[f"embedding_bags.{name}.weight"])
        shards = ids_entry.local_shards()
        assert all(type(s.tensor) is torch.Tensor and s.tensor.dtype == torch.long for s in shards)
        assert all(s.tensor.untyped_storage().data_ptr() == weight.snapshot.ids.untyped_storage().data_ptr()
                   for s in shards)
        ids = torch.cat([s.tensor for s in shards]).reshape(-1)
        assert torch.equal(torch.sort(ids).values, weight.snapshot.ids) and torch.equal(ids, weight.snapshot.ids)
        assert torch.equal(weight.get_weights_by_ids(ids[:5]).view(torch.int32),
                           weight.narrow(0, 0, 5).view(torch.int32))

    # The weight snapshots as TorchRec's lookups hand them out (its KV-ZCH kernels' accessor).
    lookups = [x for m in source.modules() for x in getattr(m, "_lookups", ())]
    out["snapshot names"] = sorted(name for x in lookups for name, *_ in x.get_named_split_embedding_weights_snapshot())
    kernel = next(kvzch_kernels(source))
    out["prefixed"] = sorted(name for name, *_ in kernel.get_named_split_embedding_weights_snapshot(prefix="p"))
    return out


def test_load_state_dict_from_another_model_and_from_upstream(pools):
    for out in pools[2].run(load_state_dict_across):
        assert out["other model"] and out["upstream"] and out["upstream history"]
        assert out["bogus"] is not None and "embedding_bags.t.bogus" in out["bogus"]
        assert out["refused"] == [True, True, True] and out["unchanged after refusals"] and out["missing reported"]
        assert out["plain unchanged"] and out["not strict loads the rest"]
        assert out["snapshot names"] == sorted(name for name, _ in TABLES)
        assert out["prefixed"] == sorted(f"p.{name}" for name, _ in TABLES)


def dense_state_into_whole_rows(rank, world):
    """TorchRec's own row-wise FUSED table (every row's Adagrad state 1.0) loaded, model then
    optimizer state dict, into the same table declared KV-ZCH, as TorchRec does it (whole rows):
    each id's weights and optimizer state."""
    from torchrec.distributed.planner import ParameterConstraints

    def build(kv):
        config = EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"],
                                    use_virtual_table=kv, total_num_buckets=4 if kv else None)
        plain = {"t": ParameterConstraints(sharding_types=["row_wise"], compute_kernels=["fused"])}
        return sharded(EmbeddingBagCollection(tables=[config], device=torch.device("meta")), None if kv else plain,
                       fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1})

    source = build(False)
    batch = KeyedJaggedTensor(keys=["f"], values=torch.arange(64), lengths=torch.ones(64, dtype=torch.long))
    source(batch).wait().values().sum().backward()
    target = build(True)
    target.load_state_dict(source.state_dict())
    target.state_dict()
    target.fused_optimizer.load_state_dict(source.fused_optimizer.state_dict())
    [(_, tbe)] = kvzch_tables(target)
    ids = torch.sort(tbe.store.keys()).values
    return tbe.store.params.backend_return_whole_row, tbe.store.read_ids(ids, RowPart.OPTIMIZER).view(-1).tolist()


def test_a_dense_tables_optimizer_state_loads_into_whole_rows(pools):
    for whole, state in pools[2].run(dense_state_into_whole_rows):
        assert whole and state == [1.0] * 32


# -- 5. set_range as fbgemm's KVTensorWrapper ----------------------------------------------------
def test_set_range_writes_ids_in_range_and_whole_rows_by_position():
    params = KVZCHTableParams("kv", 4, num_embeddings=2**40, total_num_buckets=64,
                              enable_optimizer_offloading=True, backend_return_whole_row=True)
    store = RowStore(params)
    store.find_or_insert(torch.tensor([10, 20, 30]))
    weights = KVTensor(store, RowPart.WEIGHT)
    weights.set_range(0, 19, 3, torch.full((3, 4), 5.0))  # ids 19, 20, 21 (19 and 21 created)
    assert sorted(store.keys().tolist()) == [10, 19, 20, 21, 30]
    assert store.read_ids(torch.tensor([19, 20, 21])).eq(5.0).all()
    assert not store.read_ids(torch.tensor([10, 30])).eq(5.0).any()
    optimizer = KVTensor(store, RowPart.OPTIMIZER)
    optimizer.set_range(0, 30, 1, torch.full((1, 1), 7.0))
    assert store.read_ids(torch.tensor([30]), "optimizer").item() == 7.0

    rows = KVTensor(store, RowPart.ROW)  # positions of the view: ids 20 and 21
    new = rows.narrow(0, 2, 2).clone()
    new[:, :4] = torch.tensor([[999, 0], [999, 0]]).view(torch.float32)  # wrong keys: replaced
    new.view(torch.long)[:, 1] = make_meta(5, 1, used=True)
    new[:, 4:8] = 3.0
    rows.set_range(0, 2, 2, new)
    assert store.read_ids(torch.tensor([20, 21])).eq(3.0).all() and store.find(torch.tensor([999])).item() == -1
    with pytest.raises(IndexError, match=r"rows \[4, 6\)"):
        rows.set_range(0, 4, 2, new)
    with pytest.raises(ValueError, match="outside this shard"):
        KVTensor(RowStore(params, bucket_range=params.bucket_range(0, 2)), RowPart.WEIGHT).set_range(
            0, 2**39 + 1, 1, torch.ones(1, 4))


# -- a dense table's weights (no ids) ------------------------------------------------------------
def test_a_dense_weight_loads_row_by_id_only_when_it_covers_the_shard():
    from torchrec_kvzch.torchrec.materialised import materialised_load

    params = KVZCHTableParams("d", 4, num_embeddings=64, total_num_buckets=8, learning_rate=0.1,
                              init_range=(-0.5, 0.5))
    whole = RowStore(params)  # one rank: ids [0, 64)
    dense = torch.randn(64, 4)
    materialised_load(KVTensor(whole, RowPart.WEIGHT), {"weight": dense})()
    assert torch.equal(torch.sort(whole.keys()).values, torch.arange(64))
    assert torch.equal(whole.read_ids(torch.arange(64)), dense)
    assert int(whole.counters["inserted"]) == 0  # a load creates rows but counts no lookup

    half = RowStore(params, bucket_range=params.bucket_range(1, 2))  # ids [32, 64)
    half.find_or_insert(torch.tensor([40]))
    before = half.read_ids(torch.tensor([40])).clone()
    for weight in (dense, dense[:32], torch.randn(32, 8)):  # wrong ids, wrong ids, wrong width
        with pytest.raises(ValueError, match="KV-ZCH table 'd'"):
            materialised_load(KVTensor(half, RowPart.WEIGHT), {"weight": weight})
        assert torch.equal(torch.sort(half.keys()).values, torch.tensor([40]))  # refused before any change
        assert torch.equal(half.read_ids(torch.tensor([40])), before)


# -- 5. DCP's own planners, writers and checkpointers where they cannot serve ---------------------
def dcp_misuses(rank, world, path):
    """What each misuse raises, and whether the table and the checkpoint stayed as they were."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from torchrec_kvzch import KVZCHAsyncStager

    model = build()
    train(model, 50 + rank)
    dcp.save(state_of(model), checkpoint_id=path, planner=KVZCHSavePlanner())
    other = build()
    train(other, 60 + rank)
    before, errors = all_rows(other), {}

    def attempt(name, fn):
        try:
            fn()
        except (Exception, CheckpointException) as e:  # (DCP wraps a rank's error in one: a BaseException)
            errors[name] = str(e)

    attempt("default load", lambda: dcp.load(state_of(other), checkpoint_id=path, planner=DefaultLoadPlanner()))
    attempt("default save", lambda: dcp.save(state_of(other), checkpoint_id=path + "-default"))
    attempt("no overwrite", lambda: dcp.save(state_of(other), planner=KVZCHSavePlanner(),
                                             storage_writer=FileSystemWriter(path, overwrite=False)))
    stager = KVZCHAsyncStager()
    attempt("process", lambda: dcp.async_save(state_of(other), checkpoint_id=path + "-process", planner=KVZCHSavePlanner(),
                                              async_stager=stager,
                                              async_checkpointer_type=AsyncCheckpointerType.PROCESS).result())
    unchanged = same_rows(all_rows(other), before)
    state = state_of(other)
    dcp.load(state, checkpoint_id=path, planner=KVZCHLoadPlanner(checkpoint_id=path))  # (still whole)
    other.load_state_dict(state["model"])
    return errors, unchanged, same_rows(all_rows(other), all_rows(model))


def test_dcps_own_planners_and_process_checkpointer_are_refused_and_change_nothing(pools, tmp_path):
    """DCP's default planners copy row entries by position (a KV-ZCH table's rows go by id), and its
    process-based async checkpointer pickles the staged rows away from their snapshot: each is refused
    naming the fix, the table as it was; a writer that refuses to overwrite leaves the checkpoint loadable."""
    errors, unchanged, restored = pools[1].run(dcp_misuses, str(tmp_path / "ckpt"))[0]
    assert "DCP's default planners load a row entry by position" in errors["default load"]
    assert "DCP's default planners save a row entry by position" in errors["default save"]
    assert "KVZCHLoadPlanner(checkpoint_id=path)" in errors["default load"]
    assert "Checkpoint already exists" in errors["no overwrite"]
    assert "AsyncCheckpointerType.THREAD" in errors["process"]
    assert unchanged and restored
