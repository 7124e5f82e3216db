"""DCP checkpoints of KV-ZCH tables: train -> save (sync or async) -> load at the same or another
world size; damaged or mismatched checkpoints are refused before any row changes."""

import json
import os
import tempfile
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from hypothesis import given, settings, strategies as st
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from _dist import sharded
from torchrec_kvzch import KVZCHTableParams
from torchrec_kvzch.checkpoint.integrity import checksum, read_saved
from torchrec_kvzch.checkpoint.load_planner import KVZCHLoadPlanner
from torchrec_kvzch.checkpoint.save_planner import KVZCHSavePlanner
from torchrec_kvzch.checkpoint.staging import KVZCHAsyncStager
from torchrec_kvzch.torchrec.state_dict import kv_view
from torchrec_kvzch.torchrec import KVZCHConstraints, kvzch_embedding_bag_config, kvzch_tables

BUCKETS = 12  # uneven on 5 and 7 ranks, even on 1, 2, 3


def tables(chunk, dims=(("user", 8), ("item", 12)), whole_row=True):
    return [KVZCHTableParams(n, d, num_embeddings=BUCKETS * 2**36, total_num_buckets=BUCKETS, learning_rate=0.1,
                             enable_optimizer_offloading=True, backend_return_whole_row=whole_row,
                             checkpoint_chunk_rows=chunk, expected_rows=2000)
            for n, d in dims]


def build(world_size, chunk, dims=(("user", 8), ("item", 12)), whole_row=True):
    kv = tables(chunk, dims, whole_row)
    plain = EmbeddingBagConfig(name="plain", embedding_dim=4, num_embeddings=50, feature_names=["f_plain"])
    ebc = EmbeddingBagCollection(tables=[kvzch_embedding_bag_config(t, [f"f_{t.name}"]) for t in kv] + [plain],
                                 device=torch.device("meta"))
    return sharded(ebc, {t.name: KVZCHConstraints(kvzch=t) for t in kv},
                   {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}, batch_size=64)


def batch(seed, n=16, names=("user", "item")):
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, BUCKETS * 2**36, (2 * n,), generator=gen) for _ in names]
    plain = torch.randint(0, 50, (2 * n,), generator=gen)
    return KeyedJaggedTensor(keys=[f"f_{t}" for t in names] + ["f_plain"], values=torch.cat([*ids, plain]),
                             lengths=torch.full(((len(names) + 1) * n,), 2))


def all_rows(model, whole=True):
    """{(table, id): whole row (or weight + optimizer state)} over all ranks, as raw bits."""
    mine = {}
    for name, tbe in kvzch_tables(model):
        ids = torch.sort(tbe.store.keys()).values
        rows = (tbe.store.read_ids(ids, "row") if whole else
                torch.cat([tbe.store.read_ids(ids, "weight"), tbe.store.read_ids(ids, "optimizer")], 1))
        mine.update(((name, i), r.view(torch.int32)) for i, r in zip(ids.tolist(), rows))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {k: v for g in gathered for k, v in g.items()}


def check_optimizer_entries(state, read_only):
    """KV-ZCH optimizer state: views (read-only with whole rows) whose global size counts every
    rank's rows."""
    for name in ("user", "item"):
        entry = state["optim"]["state"][f"embedding_bags.{name}.weight"][f"{name}.momentum1"]
        view = kv_view(entry)
        assert view is not None and view.read_only == read_only and view.part.value == "optimizer"
        rows = torch.tensor([torch.sort(tbe.store.keys()).values.numel() for n, tbe in kvzch_tables_of(state) if n == name])
        total = torch.tensor(entry.size(0))
        dist.all_reduce(rows)
        assert int(rows.sum()) == int(total) == state["model"][f"embedding_bags.{name}.weight"].size(0)


def kvzch_tables_of(state):
    """(name, tbe) of the tables behind a state dict's KV-ZCH entries."""
    for key, entry in state["model"].items():
        view = kv_view(entry)
        if view is not None and key.endswith(".weight"):
            yield key.split(".")[-2], type("K", (), {"store": view.store})


def plain_momentum(optim_state):
    """The ordinary FUSED table's rowwise-Adagrad state, gathered over ranks."""
    entry = optim_state["state"]["embedding_bags.plain.weight"]["plain.momentum1"]
    local = {s.metadata.shard_offsets[0]: s.tensor.clone() for s in entry.local_shards()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    merged = {k: v for g in gathered for k, v in g.items()}
    return torch.cat([merged[k] for k in sorted(merged)])


class GatedWriter(FileSystemWriter):
    """Writes nothing until ``gate`` is set: lets a test change rows before an async save
    reads any of them."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def write_data(self, plan, planner):
        self.gate.wait()
        return super().write_data(plan, planner)


def train_and_save(rank, world_size, path, chunk, steps, whole_row=True, asynchronous=False):
    """Train, save, and return every row (and the plain table's optimizer state) as of the
    save call, plus a probe output. ``asynchronous``: dcp.async_save, then train on old and new
    ids before the writer may read a row; the checkpoint must still hold the rows of the call."""
    model = build(world_size, chunk, whole_row=whole_row)
    checkpoint_group = dist.new_group(backend="gloo")  # async saves run collectives on a thread
    for step in range(steps):
        model(batch(100 * step + rank)).wait().values().sum().backward()
    state = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
    check_optimizer_entries(state, read_only=whole_row)
    rows = all_rows(model, whole_row)
    rows["plain momentum"] = plain_momentum(state["optim"])
    if asynchronous:
        stager, writer = KVZCHAsyncStager(), GatedWriter(path)
        future = dcp.async_save(state, storage_writer=writer, planner=KVZCHSavePlanner(),
                                async_stager=stager, process_group=checkpoint_group)
    else:
        dcp.save(state, checkpoint_id=path, planner=KVZCHSavePlanner())
    probe = model(batch(999)).wait().values().detach()  # new ids get id-seeded rows anywhere
    if not asynchronous:
        return rows, probe, None
    for step in range(3):  # rows seen before the call, and new ones
        model(batch(100 * step + rank)).wait().values().sum().backward()
        model(batch(7000 + step + 10 * rank)).wait().values().sum().backward()
    snapshots = {kv_view(e).snapshot for e in state["model"].values() if kv_view(e) is not None}
    copied = sum(s.copied_bytes for s in snapshots)
    writer.gate.set()
    future.result()
    stager.close()
    still_frozen = any(s.frozen for s in snapshots) or any(k.store._frozen for _, k in kvzch_tables(model))
    return rows, probe, {"copied": copied, "still_frozen": still_frozen}


def load_and_compare(rank, world_size, path, chunk, expected_rows, probes, whole_row=True):
    model = build(world_size, chunk, whole_row=whole_row)
    model(batch(5000 + rank)).wait().values().sum().backward()  # rows that the load must drop
    state = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
    dcp.load(state, checkpoint_id=path, planner=KVZCHLoadPlanner(checkpoint_id=path))
    model.load_state_dict(state["model"])
    model.fused_optimizer.load_state_dict(state["optim"])
    rows = all_rows(model, whole_row)
    if "plain momentum" in expected_rows:
        rows["plain momentum"] = plain_momentum(model.fused_optimizer.state_dict())
    assert rows.keys() == expected_rows.keys()
    for key, row in rows.items():
        assert torch.equal(row, expected_rows[key]), key  # whole rows: header, weight, optimizer
    # Each rank holds exactly the rows of its buckets.
    for _, tbe in kvzch_tables(model):
        r = tbe.store.bucket_range
        ids = torch.sort(tbe.store.keys()).values
        assert ((ids >= r.id_start) & (ids < r.id_end)).all()
    return model(batch(999)).wait().values().detach() if world_size == len(probes) else None


def save_then_load(pools, tmp_path, save_world, load_world, whole_row=True, asynchronous=False, steps=3, chunk=7):
    path = str(tmp_path / "ckpt")
    saved = pools[save_world].run(train_and_save, path, chunk, steps, whole_row, asynchronous)
    expected = saved[0][0]
    probes = [probe for _, probe, _ in saved]
    outs = pools[load_world].run(load_and_compare, path, chunk, expected, probes, whole_row)
    if save_world == load_world:  # same local batches: identical outputs
        for out, probe in zip(outs, probes):
            assert torch.equal(out, probe)
    return saved


@pytest.mark.parametrize("save_world, load_world, whole_row", [
    (2, 2, True), (1, 2, True), (2, 1, True), (2, 3, True), (3, 2, True), (2, 2, False), (2, 3, False)])
def test_save_and_load_at_any_world_size(pools, tmp_path, save_world, load_world, whole_row):
    saved = save_then_load(pools, tmp_path, save_world, load_world, whole_row)
    assert len(saved[0][0]) > 50


@pytest.mark.parametrize("load_world", [2, 3])
def test_async_save_holds_the_rows_of_the_call(pools, tmp_path, load_world):
    saved = save_then_load(pools, tmp_path, 2, load_world, asynchronous=True)
    for _, _, info in saved:
        assert info["copied"] > 0 and not info["still_frozen"]


@settings(max_examples=max(2, settings().max_examples // 10))
@given(save_world=st.integers(1, 3), load_world=st.integers(1, 4), whole_row=st.booleans(),
       asynchronous=st.booleans(), steps=st.integers(0, 4), chunk=st.sampled_from([1, 5, 64]))
def test_save_and_load_property(pools, save_world, load_world, whole_row, asynchronous, steps, chunk):
    """Any world size to any other, sync or async, any chunking: every row and all optimizer
    state come back as they were at the save."""
    with tempfile.TemporaryDirectory() as tmp:
        save_then_load(pools, Path(tmp), save_world, load_world, whole_row, asynchronous, steps, chunk)


def load_mismatched(rank, world_size, path, dims):
    model = build(world_size, 7, dims)
    model(batch(77, names=[n for n, _ in dims])).wait().values().sum().backward()
    before = all_rows(model)
    state = {"model": model.state_dict()}
    try:
        dcp.load(state, checkpoint_id=path, planner=KVZCHLoadPlanner(checkpoint_id=path))
    except CheckpointException as e:  # DCP's wrapper of every rank's error (a BaseException)
        error = str(e)
    else:
        error = None
    after = all_rows(model)
    unchanged = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    return error, unchanged


@pytest.mark.parametrize("dims, fragment", [
    ((("user", 8), ("item", 16)), "KV-ZCH table 'item' was saved with embedding_dim 12 (fp32), this model has 16 (fp32)"),
    ((("user", 8), ("item", 12), ("extra", 4)), "has no rows for KV-ZCH table 'extra'"),
])
def test_mismatched_checkpoint_is_refused_before_any_row_changes(pools, tmp_path, dims, fragment):
    path = str(tmp_path / "ckpt")
    pools[1].run(train_and_save, path, 7, 1)
    for error, unchanged in pools[2].run(load_mismatched, path, dims):
        assert error is not None and fragment in error and path in error
        assert unchanged


def saves_with_plan_caching(rank, world_size, root):
    import logging

    reused = []

    class Reuse(logging.Handler):
        def emit(self, record):
            reused.append("No change in the local plan" in record.getMessage())

    log, handler = logging.getLogger("torch.distributed.checkpoint.default_planner"), Reuse()
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        model = build(world_size, 7)
        snapshots = []
        for i, steps in enumerate((2, 0, 3)):  # the second save changes nothing, the third adds rows
            for step in range(steps):
                model(batch(10 * i + step + 100 * rank)).wait().values().sum().backward()
            state = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
            reused.clear()
            dcp.save(state, checkpoint_id=f"{root}/save{i}", planner=KVZCHSavePlanner(enable_plan_caching=True))
            snapshots.append((all_rows(model), any(reused)))
        return snapshots
    finally:  # (the rank serves other cases next)
        log.removeHandler(handler)
        log.setLevel(level)


def test_save_plan_caching_reuses_plans_and_stays_correct(pools, tmp_path):
    root = str(tmp_path)
    snapshots = pools[2].run(saves_with_plan_caching, root)[0]
    assert [reused for _, reused in snapshots] == [False, True, False]
    assert len(snapshots[2][0]) > len(snapshots[1][0])
    for i, (rows, _) in enumerate(snapshots):
        pools[2].run(load_and_compare, f"{root}/save{i}", 7, rows, [None, None, None])


def damage_kv_rows(path: str, damage: str) -> str:
    """Damage the file holding the first chunk of table 'item' rows; returns its path."""
    storage = FileSystemReader(path).read_metadata().storage_data
    index = min((i for i in storage if i.fqn.endswith("item.weight")), key=lambda i: i.offset[0])
    info = storage[index]
    target = os.path.join(path, info.relative_path)
    if damage == "truncate":
        os.truncate(target, info.offset + info.length // 2)
    elif damage == "delete":
        os.remove(target)
    else:  # flip one byte in the middle of the rows, the file's size unchanged
        with open(target, "r+b") as f:
            f.seek(info.offset + info.length // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x5A]))
    return target


@pytest.mark.parametrize("damage, fragment", [
    ("truncate", "is truncated"), ("delete", "is missing"), ("corrupt", "is corrupt")])
def test_damaged_files_are_refused_before_any_row_changes(pools, tmp_path, damage, fragment):
    path = str(tmp_path / "ckpt")
    pools[1].run(train_and_save, path, 7, 1)
    target = damage_kv_rows(path, damage)
    for error, unchanged in pools[2].run(load_mismatched, path, (("user", 8), ("item", 12))):
        assert error is not None and unchanged
        assert target in error and fragment in error and "KV-ZCH table" in error


def save_stale_states(rank, world_size, root):
    """Saves of state dicts that no longer hold one moment of the tables: each save's error."""
    model = build(world_size, 7, whole_row=False)
    step = lambda seed: model(batch(seed + rank)).wait().values().sum().backward()
    step(0)
    errors = {}
    try:  # before the model's first state dict: the optimizer's holds the empty tables' views
        dcp.save({"optim": model.fused_optimizer.state_dict(), "model": model.state_dict()},
                 checkpoint_id=f"{root}/optim_before_any", planner=KVZCHSavePlanner())
        errors["optimizer's before any"] = None
    except BaseException as e:
        errors["optimizer's before any"] = (str(e), os.path.exists(f"{root}/optim_before_any/.metadata"))
    state = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
    dcp.save(state, checkpoint_id=f"{root}/first", planner=KVZCHSavePlanner())
    step(50)  # rows created and trained after the state dict was taken
    optim_first = model.fused_optimizer.state_dict()  # views of the old snapshot
    cases = {"reused": lambda path: dcp.save(state, checkpoint_id=path, planner=KVZCHSavePlanner()),
             "reused, async": lambda path: dcp.async_save(
                 state, checkpoint_id=path, planner=KVZCHSavePlanner(), async_stager=KVZCHAsyncStager(),
                 process_group=dist.new_group(backend="gloo")).result(),
             "optimizer's first": lambda path: dcp.save({"optim": optim_first, "model": model.state_dict()},
                                                        checkpoint_id=path, planner=KVZCHSavePlanner())}
    for name, save in cases.items():
        path = f"{root}/{name.replace(' ', '_')}"
        try:
            save(path)
            errors[name] = None
        except BaseException as e:  # DCP's CheckpointException, or the stager's own error
            errors[name] = (str(e), os.path.exists(f"{path}/.metadata"))
    return errors


def test_a_stale_state_dict_is_refused_at_save(pools, tmp_path):
    """A state dict saved again after training, or an optimizer state dict taken before the
    model's (its first included), would write rows of one moment beside ids and history of another: refused at
    save, naming the table and the fix, with no checkpoint written."""
    for errors in pools[1].run(save_stale_states, str(tmp_path)):
        for name in ("reused", "reused, async"):
            assert errors[name] is not None, name
            error, written = errors[name]
            assert "KV-ZCH table '" in error and "take a fresh state_dict()" in error and not written, name
        for name in ("optimizer's first", "optimizer's before any"):
            assert errors[name] is not None, name
            error, written = errors[name]
            assert "from 2 state_dict() calls" in error and "entries of KV-ZCH table '" in error and not written
            assert "take the model's state_dict() and then the optimizer's" in error


def test_verify_without_the_folder_is_refused():
    """DCP does not tell the planner which folder it reads: without ``checkpoint_id`` no file
    could be checked, so ``verify=True`` is refused up front rather than silently skipped."""
    with pytest.raises(ValueError, match="pass checkpoint_id .*or verify=False"):
        KVZCHLoadPlanner()
    KVZCHLoadPlanner(verify=False)  # asked for explicitly: loads unchecked


def test_a_save_into_a_used_folder_replaces_the_checksum_files(pools, tmp_path):
    path = str(tmp_path / "ckpt")
    pools[2].run(train_and_save, path, 7, 1)
    assert sorted(p for p in os.listdir(path) if p.startswith("kvzch_checksums")) == [
        "kvzch_checksums_0.json", "kvzch_checksums_1.json"]
    expected = pools[1].run(train_and_save, path, 7, 2)[0][0]
    assert [p for p in os.listdir(path) if p.startswith("kvzch_checksums")] == ["kvzch_checksums_0.json"]
    pools[2].run(load_and_compare, path, 7, expected, [None])


def materialised(state):
    """A copy of a state dict with every KV-ZCH view read into plain tensors (as if it had been
    written with torch.save and read back)."""
    if isinstance(state, dict):
        return {k: materialised(v) for k, v in state.items()}
    if kv_view(state) is None:
        return state
    shards = [Shard(s.tensor.full_tensor(), s.metadata) for s in state.local_shards()]
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, state.metadata())


def load_materialized(rank, world_size, whole_row):
    """A state dict whose KV-ZCH rows were materialised loads through load_state_dict, the
    legacy layout's optimizer state included."""
    source = build(world_size, 7, whole_row=whole_row)
    source(batch(3)).wait().values().sum().backward()
    model_state = materialised(source.state_dict())
    optim_state = materialised(source.fused_optimizer.state_dict())
    target = build(world_size, 7, whole_row=whole_row)
    target(batch(4)).wait().values().sum().backward()  # rows that must be replaced
    target.load_state_dict(model_state)
    target.fused_optimizer.load_state_dict(optim_state)
    want, got = all_rows(source, whole_row), all_rows(target, whole_row)
    return want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("whole_row", [True, False])
def test_materialised_state_dict_loads_through_load_state_dict(pools, whole_row):
    assert pools[2].run(load_materialized, whole_row) == [True, True]


def copy_and_restore(rank, world_size, root, how):
    """State dicts copied (``copy.deepcopy``) or pickled (``torch.save``) hold the rows of the
    moment they were taken, whatever training does after; loaded back, they restore them."""
    import copy
    import io
    model = build(world_size, 7, whole_row=False)
    model(batch(3 + rank)).wait().values().sum().backward()
    want = all_rows(model, False)
    state = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
    if how == "deepcopy":
        kept = copy.deepcopy(state)
    else:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        kept = torch.load(buffer, weights_only=False)  # (ShardedTensor: as TorchRec's own state dicts)
    for seed in range(3):  # rows trained and created after the copy
        model(batch(10 + seed + rank)).wait().values().sum().backward()
    assert all_rows(model, False) != want
    try:
        copy.deepcopy(state)  # the live state dict is stale now: its copy would mix two moments
        stale = None
    except ValueError as e:
        stale = str(e)
    model.load_state_dict(kept["model"])
    model.fused_optimizer.load_state_dict(kept["optim"])
    got = all_rows(model, False)
    return got.keys() == want.keys() and all(torch.equal(want[k], got[k]) for k in want), stale


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copied_or_pickled_state_dict_holds_its_moments_rows(pools, tmp_path, how):
    for restored, stale in pools[2].run(copy_and_restore, str(tmp_path), how):
        assert restored
        assert stale is not None and "the state dict to copy was taken before the table last changed" in stale


def to_zlib_checksums(path: str) -> None:
    """Rewrite the checksum side files as earlier versions wrote them: a flat {item: zlib CRC-32}."""
    metadata = FileSystemReader(path).read_metadata()
    by_key = {f"{i.fqn}@{','.join(map(str, i.offset)) if i.offset is not None else ''}": i
              for i in metadata.storage_data}
    for name in (n for n in os.listdir(path) if n.startswith("kvzch_checksums_")):
        with open(os.path.join(path, name)) as f:
            record = json.load(f)
        assert record["algorithm"] == "crc32c"
        old = {key: checksum(read_saved(path, metadata, by_key[key]), "crc32") for key in record["items"]}
        with open(os.path.join(path, name), "w") as f:
            json.dump(old, f)


def test_checkpoints_with_zlib_checksums_still_load_and_verify(pools, tmp_path):
    """Checkpoints of earlier versions recorded zlib's CRC-32 in flat side files: they load, and
    a damaged one is still refused before any row changes."""
    path = str(tmp_path / "ckpt")
    expected = pools[2].run(train_and_save, path, 7, 2)[0][0]
    to_zlib_checksums(path)
    pools[2].run(load_and_compare, path, 7, expected, [None])
    target = damage_kv_rows(path, "corrupt")
    for error, unchanged in pools[2].run(load_mismatched, path, (("user", 8), ("item", 12))):
        assert error is not None and unchanged
        assert target in error and "is corrupt" in error and "KV-ZCH table 'item'" in error


def load_counting_direct_reads(rank, world_size, path, chunk, expected, whole_row, raw_ids):
    """``load_and_compare``, counting the chunks read straight from the files; with
    ``raw_ids=False`` the ids' items are made unreadable that way (as with a storage transform)."""
    from torchrec_kvzch.checkpoint.files import SavedFiles

    reads = []
    locate, read_rows = SavedFiles._locate, SavedFiles.read_rows
    if not raw_ids:
        SavedFiles._locate = lambda self, index: None if index.fqn.endswith("weight_id") else locate(self, index)
    SavedFiles.read_rows = lambda self, span, first, out: reads.append(span) or read_rows(self, span, first, out)
    try:
        load_and_compare(rank, world_size, path, chunk, expected, [None], whole_row)
    finally:  # (the rank serves other cases next)
        SavedFiles._locate, SavedFiles.read_rows = locate, read_rows
    return len(reads)


@pytest.mark.parametrize("whole_row, raw_ids", [(True, True), (False, True), (False, False)])
def test_rows_are_read_straight_from_the_files(pools, tmp_path, whole_row, raw_ids):
    """Rows go from the files into the stores without DCP's per-chunk torch.load. A split table
    one of whose parts cannot be read so (its ids here) is left to DCP's reader whole, and
    loads all the same."""
    path = str(tmp_path / "ckpt")
    expected = pools[2].run(train_and_save, path, 7, 2, whole_row)[0][0]
    reads = pools[3].run(load_counting_direct_reads, path, 7, expected, whole_row, raw_ids)
    assert all(n > 0 for n in reads) if raw_ids else not any(reads)


class _OnDevice(torch.Tensor):
    """A CPU tensor posing as one in accelerator memory, as CUDA tensors are to a save planner:
    ``.numpy()`` refuses it until ``.cpu()`` copies it to host memory."""

    @property
    def device(self):
        return torch.device("cuda", 0)

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() first")

    def cpu(self, *args, **kwargs):
        return self.as_subclass(torch.Tensor).clone()


def test_a_synchronous_save_copies_device_tensors_to_the_host_before_their_checksums(tmp_path):
    """DCP hands a save planner's resolve_data ordinary tensors where they live (dense weights,
    FUSED tables, their optimizer state on the GPU) and copies them to the host only after it;
    the checksum must not read them first."""
    dense = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    dcp.save({"dense": dense.as_subclass(_OnDevice)}, checkpoint_id=str(tmp_path), planner=KVZCHSavePlanner(),
             no_dist=True)
    loaded = {"dense": torch.zeros(3, 4)}
    dcp.load(loaded, checkpoint_id=str(tmp_path), planner=KVZCHLoadPlanner(checkpoint_id=str(tmp_path)), no_dist=True)
    assert torch.equal(loaded["dense"], dense)
