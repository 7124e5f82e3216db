"""Incremental checkpoints: chains of deltas restore exactly, at any world size, or not at all.

The model, its batches and the bit-for-bit comparison are test_resume's.
"""

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hypothesis import example, given, settings, strategies as st
from torch.distributed.checkpoint.api import CheckpointException

from test_resume import _damage, _history_totals, build, same, snapshot, state_of, train_step
from torchrec_kvzch import AdmissionPolicy
from torchrec_kvzch.checkpoint.load_planner import KVZCHLoadPlanner
from torchrec_kvzch.checkpoint.manager import CheckpointError, CheckpointManager
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec_kvzch.table.layout import meta_count
from torchrec_kvzch.torchrec import kvzch_tables

KINDS = ("none", "ttl", "lfu", "lru", "rank")  # creates, updates, evictions, lfu's count decay


def save_chain(rank, world, kind, gaps, full_every, root, asynchronous, dense_lr, admission=None, table_kw=None):
    """Train, saving after each of ``gaps`` steps (deltas between full checkpoints, every
    ``full_every``-th in full); the state at the last save, and each save's kind."""
    pg = dist.group.WORLD
    model, dense = build(pg, kind, dense_lr, admission=admission, **(table_kw or {}))
    group = dist.new_group(backend="gloo") if asynchronous else pg
    manager = CheckpointManager(root, keep=1, process_group=group, full_every=full_every)
    step, last = 0, None
    for gap in gaps:
        for _ in range(gap):
            train_step(model, dense, step, rank, world)
            step += 1
        last = copy.deepcopy(snapshot(model, dense, pg))  # (its dense tensors are the live ones)
        manager.save(state_of(model, dense), step, asynchronous=asynchronous)
    for extra in range(step, step + 2):  # trains on while the last save is written
        train_step(model, dense, extra, rank, world)
    manager.close()
    return last, [len(manager.chain(s)) for s in manager.steps()], step


def restore(rank, world, kind, root, dense_lr, step=None, admission=None, table_kw=None):
    """A model with rows of its own loads the chain; its state, or the error and whether the
    model stayed as it was."""
    pg = dist.group.WORLD
    model, dense = build(pg, kind, dense_lr, admission=admission, **(table_kw or {}))
    train_step(model, dense, 99, rank, world)  # rows, clock and history the load must replace
    before = snapshot(model, dense, pg)
    state = state_of(model, dense)
    try:
        CheckpointManager(root, process_group=pg, full_every=4).load(state, step)
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        return str(e), same(before, snapshot(model, dense, pg)) == []
    model.load_state_dict(state["model"])
    model.fused_optimizer.load_state_dict(state["optim"])
    dense.load_state_dict(state["dense"])
    return None, snapshot(model, dense, pg)


def differences(a, b, resharded: bool) -> list[str]:
    """Bit for bit; across world sizes the counters per rank become totals (they follow the
    buckets), and what differs by design is left out (``same``)."""
    if not resharded:
        return same(a, b)
    totals = [] if _history_totals(a) == _history_totals(b) else [
        f"history totals {_history_totals(a)} vs {_history_totals(b)}"]
    def world_free(x):
        return {**x, "history": 0, "plain_opt": {(0, 0): _whole(x["plain_opt"])}}
    return same(world_free(a), world_free(b), across_worlds=True) + totals


def _whole(shards: dict) -> torch.Tensor:
    """The tensor that shards ``{offsets: tensor}`` of any sharding cut."""
    rows = max(o[0] + t.shape[0] for o, t in shards.items())
    cols = max((o[1] if len(o) > 1 else 0) + (t.shape[1] if t.dim() > 1 else 1) for o, t in shards.items())
    out = torch.zeros(rows, cols)
    for o, t in shards.items():
        t = t.reshape(t.shape[0], -1)
        c = o[1] if len(o) > 1 else 0
        out[o[0]:o[0] + t.shape[0], c:c + t.shape[1]] = t
    return out


@settings(max_examples=max(6, settings().max_examples // 6), deadline=None)
@given(kind=st.sampled_from(KINDS), w_save=st.integers(1, 3), w_load=st.integers(1, 3),
       gaps=st.lists(st.integers(1, 3), min_size=2, max_size=5), full_every=st.integers(2, 4),
       asynchronous=st.booleans(), admitted=st.booleans())
@example(kind="ttl", w_save=2, w_load=3, gaps=[2, 1, 3, 2], full_every=4, asynchronous=True, admitted=False)
@example(kind="lru", w_save=3, w_load=1, gaps=[3, 2, 2], full_every=3, asynchronous=False, admitted=True)
@example(kind="lfu", w_save=2, w_load=3, gaps=[2, 3, 2, 3], full_every=4, asynchronous=False, admitted=False)
def _chain_property(pools, seen, kind, w_save, w_load, gaps, full_every, asynchronous, admitted):
    admission = AdmissionPolicy("count", min_count=2) if admitted else None
    dense_lr = 0.05 if w_save == w_load else 0.0
    with tempfile.TemporaryDirectory() as tmp:
        saved = pools[w_save].run(save_chain, kind, gaps, full_every, tmp, asynchronous, dense_lr, admission)
        want, chain_lengths, _ = saved[0]
        error, got = pools[w_load].run(restore, kind, tmp, dense_lr, None, admission)[0]
    assert error is None, error[-1500:]
    assert differences(want, got, resharded=w_save != w_load) == []
    seen.append((chain_lengths[-1], w_save != w_load, sum(h[2] for h in want["history"][0].values())))


def test_base_and_deltas_restore_the_state_of_the_last_delta(pools):
    """Random training with creates, updates and evictions (with or without admission), saved
    as chains of deltas (sync or async, training on while they are written) at 1-3 ranks and
    restored at 1-3: every row with its header, clocks, counters, the
    ordinary table, dense weights and optimizer state equal those at the last save."""
    seen = []
    _chain_property(pools, seen)
    assert any(length > 2 for length, *_ in seen) and any(resharded for _, resharded, _ in seen)
    assert any(evicted for *_, evicted in seen)


@pytest.mark.parametrize("optimizer", ["adam", "partial_row_wise_adam"])
def test_adam_moments_travel_in_deltas(pools, optimizer):
    """A chain of deltas of Adam tables (whole rows and momentum1 / momentum2 apart), saved at
    2 ranks, restored at 3: the rows with both moments and the clocks of the last save."""
    kw = {"optimizer": optimizer}
    with tempfile.TemporaryDirectory() as tmp:
        want, chain_lengths, _ = pools[2].run(save_chain, "none", [2, 1, 2], 4, tmp, False, 0.0, None, kw)[0]
        error, got = pools[3].run(restore, "none", tmp, 0.0, None, None, kw)[0]
    assert error is None, error[-1500:]
    assert chain_lengths[-1] == 3 and differences(want, got, resharded=True) == []


def _untouched_rows_decay(rank, world, root):
    """lfu: rows counted up, saved in full, then left alone while training decays every count
    twice and the delta is saved; (their counts at the delta, after a restore, as saved)."""
    pg = dist.group.WORLD
    model, dense = build(pg, "lfu", 0.05)
    (_, tbe), = [t for t in kvzch_tables(model) if t[0] == "t"]
    manager = CheckpointManager(root, process_group=pg, full_every=4)
    popular, other = torch.arange(1, 7) * 1000, torch.arange(1, 7) * 1000 + 7

    def step(ids):
        kjt = KeyedJaggedTensor(keys=["f_t", "f_u", "f_plain"], values=torch.cat([ids, ids, ids % 40]),
                                lengths=torch.ones(3 * ids.numel(), dtype=torch.long))
        model(kjt).sum().backward()
        dense.step()
        dense.zero_grad()

    for _ in range(3):
        step(popular.repeat(8))
    manager.save(state_of(model, dense), 1)
    for _ in range(4):  # the clock passes two multiples of interval_steps: two decays
        step(other)
    manager.save(state_of(model, dense), 2)
    want = copy.deepcopy(snapshot(model, dense, pg))
    counts = meta_count(tbe.store.read_ids(popular, "meta").reshape(-1)).tolist()
    error, got = restore(rank, world, "lfu", root, 0.05)
    return counts, manager.chain(2), error, differences(want, got, resharded=False)


def test_a_delta_replays_lfu_decay_on_the_rows_it_does_not_carry(pools, tmp_path):
    counts, chain, error, diff = pools[1].run(_untouched_rows_decay, str(tmp_path))[0]
    assert chain == [1, 2] and error is None and diff == []
    assert all(2 <= c < 24 for c in counts)  # decayed from 24, still above count_threshold


# -- damaged chains --------------------------------------------------------------------------
def test_a_damaged_or_missing_link_is_refused_before_anything_changes(pools, tmp_path):
    """A chain of a full checkpoint and three deltas; a copy of it with one link damaged (a
    flipped bit in a delta's rows, a deleted data file of the full one, a missing middle
    delta, a base saved again after its delta) is refused naming the link, on every rank,
    with the model unchanged; the intact chain restores."""
    root = tmp_path / "chain"
    want = pools[2].run(save_chain, "ttl", [2, 2, 2, 2], 4, str(root), False, 0.05)[0][0]
    steps = sorted(int(p.name.split("-")[1]) for p in root.iterdir())
    assert steps == [2, 4, 6, 8]
    cases = {}
    for name in ("flip", "full file", "missing", "replaced"):
        copy = tmp_path / name
        os.makedirs(copy)
        for s in steps:
            os.symlink(root / f"step-{s:08d}", copy / f"step-{s:08d}")
        cases[name] = copy
    flipped = _damage(str(root / "step-00000006"), str(tmp_path), "whole rows", "flip a bit")
    os.remove(cases["flip"] / "step-00000006")
    os.rename(flipped[0], cases["flip"] / "step-00000006")
    gone = _damage(str(root / "step-00000002"), str(tmp_path), "whole rows", "delete the file")
    os.remove(cases["full file"] / "step-00000002")
    os.rename(gone[0], cases["full file"] / "step-00000002")
    os.remove(cases["missing"] / "step-00000004")
    os.remove(cases["replaced"] / "step-00000004")
    pools[2].run(_save_again, str(root / "step-00000004"), str(cases["replaced"] / "step-00000004"))
    expected = {"flip": "step-00000006", "full file": "step-00000002", "missing": "step-00000004",
                "replaced": "saved again"}
    for name, copy in cases.items():
        for error, unchanged in pools[2].run(restore, "ttl", str(copy), 0.05):
            assert error is not None and unchanged, name
            assert expected[name] in error, (name, error[-800:])
    for error, got in pools[2].run(restore, "ttl", str(root), 0.05):
        assert error is None and same(want, got) == []


def _save_again(rank, world, original, path):
    """The checkpoint of ``original``'s step saved again (a new id), moved to ``path``."""
    model, dense = build(dist.group.WORLD, "ttl", 0.05)
    train_step(model, dense, 0, rank, world)
    root = os.path.join(os.path.dirname(os.path.dirname(path)), "resaved")
    manager = CheckpointManager(root, process_group=dist.group.WORLD)
    manager.save(state_of(model, dense), int(os.path.basename(path).split("-")[1]))
    dist.barrier()
    if rank == 0:
        os.rename(manager.path(manager.latest()), path)
    dist.barrier()


def test_a_delta_alone_is_refused_by_the_load_planner(pools, tmp_path):
    pools[1].run(save_chain, "none", [1, 1], 2, str(tmp_path), False, 0.05)
    path = str(tmp_path / "step-00000002")
    error, unchanged = pools[1].run(_plain_load, path)[0]
    assert unchanged and "incremental checkpoint (a delta of step 1)" in error and "CheckpointManager.load" in error


def _plain_load(rank, world, path):
    model, dense = build(dist.group.WORLD, "none", 0.05)
    train_step(model, dense, 0, rank, world)
    before = snapshot(model, dense, dist.group.WORLD)
    try:
        dcp.load(state_of(model, dense), checkpoint_id=path, planner=KVZCHLoadPlanner(checkpoint_id=path))
    except CheckpointException as e:
        return str(e), same(before, snapshot(model, dense, dist.group.WORLD)) == []
    return None, False


# -- when a delta cannot be saved ----------------------------------------------------------------
def _fallbacks(rank, world, root):
    """Saves whose delta cannot be told: the kind each was saved as."""
    model, dense = build(dist.group.WORLD, "none", 0.05)
    manager = CheckpointManager(root, keep=10, process_group=dist.group.WORLD, full_every=10)
    (_, tbe), = [t for t in kvzch_tables(model) if t[0] == "t"]
    kinds, step = [], 0

    def save():
        nonlocal step
        step += 1
        train_step(model, dense, step, rank, world)
        manager.save(state_of(model, dense), step)
        kinds.append(len(manager.chain(step)) > 1)

    save()  # the first: full
    save()  # a delta
    tbe.store.write_ids(torch.tensor([tbe.store.bucket_range.id_start]), torch.ones(1, 8))
    save()  # a write from outside training: full
    save()  # a delta again
    manager.save(state_of(model, dense), step + 1, incremental=False)
    kinds.append(len(manager.chain(step + 1)) > 1)
    step += 1
    save()  # a delta
    manager.load(state_of(model, dense), load_optimizer=False)
    save()  # loaded with fresh optimizer state, not the checkpoint's: full
    manager.load(state_of(model, dense))
    save()  # loaded: a delta of it
    return kinds


def test_a_delta_that_cannot_be_told_is_saved_in_full(pools, tmp_path):
    """The first save, one after a write from outside training, one asked in full and one
    after a load without the optimizer state are full; the others deltas."""
    kinds = pools[1].run(_fallbacks, str(tmp_path))[0]
    assert kinds == [False, True, False, True, False, True, False, True]
    kinds = pools[1].run(_asked_for, str(tmp_path / "asked"))[0]
    assert kinds == [False, False, True, True, True]


def _asked_for(rank, world, root):
    """A manager saving in full by default (full_every=1), asked for deltas: the first after
    rows were deleted before deletes were logged is full, the rest deltas as asked."""
    model, dense = build(dist.group.WORLD, "ttl", 0.05)
    manager = CheckpointManager(root, process_group=dist.group.WORLD)
    kinds = []
    for step, incremental in enumerate((False, True, True, True, True), start=1):
        for s in range(3 * step, 3 * step + 3):  # ttl evicts every step
            train_step(model, dense, s, rank, world)
        manager.save(state_of(model, dense), step, incremental=incremental)
        kinds.append(len(manager.chain(step)) > 1)
    return kinds


def test_keep_never_drops_a_link_a_kept_checkpoint_needs(tmp_path):
    manager = CheckpointManager(tmp_path, keep=1, full_every=3)
    kept = []
    for step in range(1, 7):
        manager.save({"w": torch.full((4,), float(step))}, step)
        kept.append(manager.steps())
    assert kept == [[1], [1, 2], [1, 2, 3], [4], [4, 5], [4, 5, 6]]
    assert manager.chain(6) == [4, 5, 6]
    into = {"w": torch.zeros(4)}
    assert CheckpointManager(tmp_path, full_every=3).load(into) == 6 and torch.equal(into["w"], torch.full((4,), 6.0))


def _one_rank_holds_rows(rank, world, root, save: bool):
    """A table whose ids all fall in the last rank's buckets (the others hold none of its rows)
    saved in full and as a delta, or (``save`` False) loaded; returns this rank's rows."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from _dist import sharded
    from torchrec_kvzch import KVZCHConstraints, KVZCHTableParams, kvzch_embedding_bag_config

    u = KVZCHTableParams("u", 8, num_embeddings=8 * 2**20, total_num_buckets=8, expected_rows=100)
    ebc = EmbeddingBagCollection(tables=[kvzch_embedding_bag_config(u, ["f"])], device=torch.device("meta"))
    model = sharded(ebc, {"u": KVZCHConstraints(kvzch=u)},
                    {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}, batch_size=4)
    manager = CheckpointManager(root, full_every=2)
    if save:
        for step in (1, 2):
            ids = 8 * 2**20 - 1 - torch.arange(3) - 10 * rank - 100 * step  # the last bucket's
            kjt = KeyedJaggedTensor(keys=["f"], values=ids, lengths=torch.ones(3, dtype=torch.long))
            model(kjt).wait().values().sum().backward()
            manager.save({"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}, step)
    else:
        assert manager.load({"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}) == 2
    manager.close()
    [(_, tbe)] = kvzch_tables(model)
    ids = torch.sort(tbe.store.keys()).values
    return ids, tbe.store.read_ids(ids, "row").view(torch.int32)


@pytest.mark.parametrize("w_load", [1, 2])
def test_a_rank_holding_no_rows_of_a_table_saves_and_loads(pools, tmp_path, w_load):
    """A rank with no rows of a table has an empty chunk at the offset of the next rank's rows: the
    same item for DCP, whose dedup must not keep the empty one (the save would fail, or lose rows)."""
    saved = pools[2].run(_one_rank_holds_rows, str(tmp_path), True)
    assert saved[0][0].numel() == 0 and saved[1][0].numel() == 12
    got = pools[w_load].run(_one_rank_holds_rows, str(tmp_path), False)
    ids, rows = (torch.cat([g[i] for g in got]) for i in (0, 1))
    assert torch.equal(ids, saved[1][0]) and torch.equal(rows, saved[1][1])
