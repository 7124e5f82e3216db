"""Served tables built from CheckpointManager directories (issue 31): after any chain of deltas,
with eviction and admission, saved at 1-3 ranks, a served table - of every bucket or of a range
of them - answers every id as the trained table's rows would at the last save, at each dtype
within its bound; an id without a row reads the declared default. Damaged chains are refused
naming the file, and a replica reads only the chunks of its buckets.

The model, its training and its damage are test_resume's.
"""

import dataclasses
import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from hypothesis import example, given, settings, strategies as st
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from test_resume import BUCKET_SIZE, BUCKETS, _damage, build, state_of, train_step
from test_serving import int8_bound
from torchrec_kvzch import AdmissionPolicy
from torchrec_kvzch.checkpoint.manager import CheckpointManager
from torchrec_kvzch.serving import decode, encode
from torchrec_kvzch.serving.build import build_table
from torchrec_kvzch.serving.model import ServingOptions, served_model
from torchrec_kvzch.serving.modules import ServedEmbeddingBagCollection
from torchrec_kvzch.serving.source import CheckpointSource
from torchrec_kvzch.torchrec import kvzch_tables

KINDS = ("none", "ttl", "lfu", "lru")


def trained(rank, world, kind, gaps, full_every, root, admission):
    """Train, saving after each of ``gaps`` steps (every ``full_every``-th in full, deltas
    between); per table, what this rank's shard holds at the last save: its ids, their
    weights, its id range and its trainable default row (or None)."""
    pg = dist.group.WORLD
    model, dense = build(pg, kind, 0.05, admission=admission)
    manager = CheckpointManager(root, keep=1, process_group=pg, full_every=full_every)
    step = 0
    for gap in gaps:
        for _ in range(gap):
            train_step(model, dense, step, rank, world)
            step += 1
        manager.save(state_of(model, dense), step)
    manager.close()
    out = {}
    for name, tbe in kvzch_tables(model):
        ids = tbe.store.keys()
        default = tbe.default_state().get("weight")
        r = tbe.store.bucket_range
        out[name] = (ids, tbe.store.read_ids(ids).float(), (r.id_start, r.id_end),
                     None if default is None else default.detach().reshape(-1).clone())
    return out


def expected_reads(shards, name, lo, hi, absent):
    """(the ids with rows in ``[lo, hi)`` then ``absent``, what each reads at the last save: its
    row's weights, else the default of the rank that trained its buckets, zeros without one;
    how many ids have rows)."""
    rows = {}
    for shard in shards:
        ids, weights, _, _ = shard[name]
        rows.update((i, w) for i, w in zip(ids.tolist(), weights) if lo <= i < hi)

    def default(i):
        _, _, _, row = next(s[name] for s in shards if s[name][2][0] <= i < s[name][2][1])
        return row if row is not None else torch.zeros(8)

    query = torch.cat([torch.tensor(sorted(rows), dtype=torch.long), absent[~torch.isin(absent, torch.tensor(list(rows)))]])
    return query, torch.stack([rows.get(i, default(i)) for i in query.tolist()]), len(rows)


def assert_reads(served, query, want, dtype):
    got = served.weights(query)
    if dtype == "int8":  # rows and defaults alike: within the bound of row-wise quantization
        assert ((got - want).abs() <= int8_bound(want)[:, None]).all()
    assert torch.equal(got, decode(encode(want, dtype), dtype))


@settings(max_examples=max(6, settings().max_examples // 6), deadline=None)
@given(kind=st.sampled_from(KINDS), world=st.integers(1, 3), gaps=st.lists(st.integers(1, 3), min_size=1, max_size=4),
       full_every=st.integers(1, 3), admitted=st.booleans(), dtype=st.sampled_from(["fp32", "fp16", "int8"]),
       buckets=st.one_of(st.none(), st.tuples(st.integers(0, BUCKETS - 1), st.integers(1, BUCKETS))),
       seed=st.integers(0, 2**16))
@example(kind="ttl", world=2, gaps=[2, 1, 3, 2], full_every=3, admitted=True, dtype="fp32", buckets=None, seed=0)
@example(kind="lru", world=3, gaps=[3, 2, 2], full_every=3, admitted=False, dtype="int8", buckets=(1, 5), seed=1)
def _served_chain_property(pools, seen, kind, world, gaps, full_every, admitted, dtype, buckets, seed):
    if buckets is not None:
        buckets = (min(buckets[0], buckets[1] - 1), max(buckets[1], buckets[0] + 1))
    admission = AdmissionPolicy("count", min_count=2, default="trainable") if admitted else None
    with tempfile.TemporaryDirectory() as tmp:
        shards = pools[world].run(trained, kind, gaps, full_every, tmp, admission)
        source = CheckpointSource(tmp)
        chain = source.chain(source.latest())
        for name in ("t", "u"):
            served = build_table(chain, name, dtype=dtype, buckets=buckets)
            lo, hi = served.id_range
            assert (lo, hi) == ((0, BUCKETS * BUCKET_SIZE) if buckets is None
                                else (buckets[0] * BUCKET_SIZE, buckets[1] * BUCKET_SIZE))
            gen = torch.Generator().manual_seed(seed)
            absent = lo + torch.randint(0, hi - lo, (20,), generator=gen)
            query, want, live = expected_reads(shards, name, lo, hi, absent)
            assert len(served) == live
            assert_reads(served, query, want, dtype)
            seen.append((len(chain), live, admitted))


def test_a_served_table_answers_every_id_as_the_trained_table_at_the_last_save(pools):
    """Random training with creates, updates and evictions (with or without admission and its
    trainable default row), saved as chains of deltas at 1-3 ranks, served whole or as a range
    of buckets in fp32, fp16 or int8."""
    seen = []
    _served_chain_property(pools, seen)
    assert any(length > 1 for length, *_ in seen) and any(admitted for *_, admitted in seen)


def test_a_replica_reads_only_the_chunks_of_its_buckets_and_refuses_damage_in_them(pools, tmp_path):
    """Saved at 2 ranks: a damaged chunk of rank 1's ids stops a build of every bucket (the
    error names the file) but not one of rank 0's buckets, which never reads it."""
    root = tmp_path / "run"
    pools[2].run(trained, "none", [3], 1, str(root), None)
    step = CheckpointManager(root).latest()
    damaged, target, _ = _damage(str(root / f"step-{step:08d}"), str(tmp_path), "ids beside whole rows (last chunk)",
                                     "flip a bit")
    copy = tmp_path / "damaged"
    os.makedirs(copy)
    os.rename(damaged, copy / f"step-{step:08d}")
    chain = CheckpointSource(copy).chain(step)
    with pytest.raises(ValueError, match=rf"{os.path.basename(target)} is corrupt: 'model.ebc.embedding_bags.t.weight_id'"):
        build_table(chain, "t")
    served = build_table(chain, "t", buckets=(0, BUCKETS // 2))
    assert len(served) > 0 and served.id_range == (0, BUCKETS // 2 * BUCKET_SIZE)
    # A flip in an item's zip header (its extra field's length) fails torch.load itself (an
    # IndexError): a ValueError naming the file and the entry all the same.
    header = tmp_path / "header"
    shutil.copytree(root / f"step-{step:08d}", header / f"step-{step:08d}")
    storage = FileSystemReader(str(header / f"step-{step:08d}")).read_metadata().storage_data
    index = min((i for i in storage if i.fqn.endswith("embedding_bags.t.weight")), key=lambda i: tuple(i.offset))
    target = header / f"step-{step:08d}" / storage[index].relative_path
    with open(target, "r+b") as f:
        f.seek(storage[index].offset + 28)
        byte = f.read(1)
        f.seek(storage[index].offset + 28)
        f.write(bytes([byte[0] ^ 0x5A]))
    with pytest.raises(ValueError, match=rf"{target.name} is corrupt: reading 'model.ebc.embedding_bags.t.weight' "
                                         r"failed \(\w+: .*\); restore the file or serve another checkpoint"):
        build_table(CheckpointSource(header).chain(step), "t")


def test_bad_requests_name_the_table_and_the_fix(pools, tmp_path):
    pools[1].run(trained, "none", [2], 1, str(tmp_path), None)
    source = CheckpointSource(tmp_path)
    chain = source.chain(source.latest())
    with pytest.raises(ValueError, match=r"has no KV-ZCH table 'v'; it has \['t', 'u'\]"):
        build_table(chain, "v")
    with pytest.raises(ValueError, match=r"served table 't': buckets \(4, 9\) are not a range of its 6 buckets"):
        build_table(chain, "t", buckets=(4, 9))
    with pytest.raises(ValueError, match="served table 't': default 'random' is unknown; use one of admission, zeros"):
        build_table(chain, "t", default="random")
    import test_resume
    wide = dataclasses.replace(test_resume.table_params()[0], embedding_dim=16)
    with pytest.raises(ValueError, match=r"served table 't': its parameters give embedding_dim 16, .* saved it with 8"):
        build_table(chain, "t", default="initial", params=wide)


# -- the served model ----------------------------------------------------------------------------
def train_phase(rank, world, root, start, stop, probe, admission=None):
    """Resume the test model from the latest checkpoint under ``root`` (if any), train steps
    ``[start, stop)`` saving every second step (every third save in full, deltas between),
    and return its eval predictions on ``probe`` (every rank scores the whole batch)."""
    pg = dist.group.WORLD
    model, dense = build(pg, "ttl", 0.05, admission=admission)
    manager = CheckpointManager(root, keep=5, process_group=pg, full_every=3)
    state = state_of(model, dense)
    if manager.load(state) is not None:
        model.load_state_dict(state["model"])
        model.fused_optimizer.load_state_dict(state["optim"])
        dense.load_state_dict(state["dense"])
    for step in range(start, stop):
        train_step(model, dense, step, rank, world)
        if step % 2:
            manager.save(state_of(model, dense), step + 1)
    manager.close()
    model.eval()
    with torch.no_grad():
        return model(probe).detach()


def probe_batch(ids_t, ids_u, plain):
    """One example per id triple, every example on every rank (a KJT of the three features)."""
    values = torch.stack([ids_t, ids_u, plain]).reshape(-1)
    return KeyedJaggedTensor(keys=["f_t", "f_u", "f_plain"], values=values, lengths=torch.ones(values.numel(), dtype=torch.long))


@pytest.mark.parametrize("world,admitted", [(1, True), (2, True), (2, False)])
def test_the_served_model_predicts_what_the_trained_model_predicts(pools, tmp_path, world, admitted):
    """The test model trained at 1 or 2 ranks and saved as a chain of deltas, rebuilt unsharded
    and served from the directory: its predictions in fp32 equal the trained model's eval
    predictions, ids without rows included (admission's default row, or without admission
    the initial weights training's evaluation reads: ``default="initial"``); int8 within
    quantization's reach."""
    import test_resume
    admission = AdmissionPolicy("count", min_count=2, default="trainable") if admitted else None
    kv = test_resume.table_params("ttl", admission=admission)
    options = ServingOptions() if admitted else ServingOptions(default="initial", kvzch={t.name: t for t in kv})
    population = torch.randint(0, BUCKETS * BUCKET_SIZE, (40,), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([population[torch.arange(24) % 40], torch.tensor([17, 2**32 + 5])])  # (two never seen)
    probe = probe_batch(ids, ids.flip(0), torch.arange(26) % 40)
    outs = pools[world].run(train_phase, str(tmp_path), 0, 6, probe, admission)
    trained = outs[0]
    assert all(torch.equal(o, trained) for o in outs)  # (every rank scored the whole batch)
    served, step = served_model(test_resume.Net(kv), tmp_path, options=options)
    assert step == 6 and isinstance(served.ebc, ServedEmbeddingBagCollection)
    with torch.no_grad():
        assert torch.equal(served(probe), trained)
        net8, _ = served_model(test_resume.Net(kv), tmp_path, options=dataclasses.replace(options, dtype="int8"))
        assert (net8(probe) - trained).abs().max() < 0.05
    if admitted:  # "initial" (the serving CLI's default) reads what evaluation reads: the default row
        initial, _ = served_model(test_resume.Net(kv), tmp_path,
                                  options=ServingOptions(default="initial", kvzch={t.name: t for t in kv}))
        with torch.no_grad():
            assert torch.equal(initial(probe), trained)
    if not admitted:  # zeros for unseen ids: the two never-seen ids' examples differ, no other
        zeros, _ = served_model(test_resume.Net(kv), tmp_path, options=ServingOptions(default="zeros"))
        with torch.no_grad():
            differ = (zeros(probe) != trained).reshape(-1)
        assert differ[-2:].all()


def test_a_model_that_does_not_match_the_checkpoint_is_refused_by_name(pools, tmp_path):
    """Another dim, a table the checkpoint lacks, another prefix, a batch with unknown features:
    each names the table, entry or feature and the fix; the model passed in is unchanged."""
    import test_resume
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    probe = probe_batch(torch.tensor([1, 2]), torch.tensor([3, 4]), torch.tensor([5, 6]))
    pools[1].run(train_phase, str(tmp_path), 0, 6, probe)
    wide = [dataclasses.replace(t, embedding_dim=16) for t in test_resume.table_params("ttl")]
    net = test_resume.Net(wide)
    with pytest.raises(ValueError, match=r"KV-ZCH table 't' was saved with embedding_dim 8, the model has 16"):
        served_model(net, tmp_path)
    assert isinstance(net.ebc, EmbeddingBagCollection)
    for field, saved, declared in [("num_embeddings", BUCKETS * BUCKET_SIZE, BUCKETS * 2**20), ("buckets", BUCKETS, 3)]:
        with pytest.raises(ValueError, match=rf"KV-ZCH table 't' was saved with \w*{field} {saved}, the model has "
                                             rf"{declared}: serve the model it was trained with"):
            served_model(test_resume.Net(test_resume.table_params("ttl", **{field: declared})), tmp_path)
    extra = test_resume.Net(test_resume.table_params("ttl"))
    extra.ebc = EmbeddingBagCollection(tables=extra.ebc.embedding_bag_configs() + [EmbeddingBagConfig(
        name="other", embedding_dim=8, num_embeddings=10, feature_names=["f_other"])], device=torch.device("meta"))
    with pytest.raises(ValueError, match=r"has no entry 'model.ebc.embedding_bags.other.weight' \(table 'other'\)"):
        served_model(extra, tmp_path)
    with pytest.raises(ValueError, match=r"saved as 'model.ebc.embedding_bags.t.weight', the model has it as "
                                         r"'trained.ebc.embedding_bags.t.weight'; pass prefix='model'"):
        served_model(test_resume.Net(test_resume.table_params("ttl")), tmp_path, prefix="trained")
    with pytest.raises(ValueError, match="ServingOptions.dtype: 'int4' is not served"):
        served_model(test_resume.Net(test_resume.table_params("ttl")), tmp_path, options=ServingOptions(dtype="int4"))
    with pytest.raises(ValueError, match=r"ServingOptions.buckets names 'plain', which is not a KV-ZCH table"):
        served_model(test_resume.Net(test_resume.table_params("ttl")), tmp_path,
                     options=ServingOptions(buckets={"plain": (0, 1)}))
    kv = {t.name: t for t in test_resume.table_params("ttl")}
    for params, match in [({**kv, "plain": kv["t"]}, r"ServingOptions.kvzch names 'plain', which is not a KV-ZCH "
                                                      r"table of both the model and the checkpoint; those: \['t', 'u'\]"),
                          ({"t": kv["u"], "u": kv["u"]}, r"ServingOptions.kvzch\['t'\] holds the parameters of table "
                                                         r"'u'; key each table's parameters by its own name")]:
        with pytest.raises(ValueError, match=match):
            served_model(test_resume.Net(test_resume.table_params("ttl")), tmp_path,
                         options=ServingOptions(default="initial", kvzch=params))
    with pytest.raises(FileNotFoundError, match=r"step-00000005 is not a complete checkpoint \(no .metadata\); "
                                                r"complete ones under .*: \[2, 4, 6\]"):
        served_model(test_resume.Net(test_resume.table_params("ttl")), tmp_path, step=5)
    served, _ = served_model(test_resume.Net(test_resume.table_params("ttl")), tmp_path)
    odd = KeyedJaggedTensor(keys=["f_t", "f_x"], values=torch.tensor([1, 2]), lengths=torch.ones(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"unknown features \['f_x'\]; no feature \['f_u', 'f_plain'\]; this module "
                                         r"serves \['f_t', 'f_u', 'f_plain'\]"):
        served(odd)
    with pytest.raises(ValueError, match=r"served table 'plain': id 40 \(position 1 of the batch\) is outside"):
        served(probe_batch(torch.tensor([1, 2]), torch.tensor([3, 4]), torch.tensor([5, 40])))


def test_the_served_model_exports_and_predicts_the_same_in_a_process_without_torchrec(pools, tmp_path):
    """``torch.export`` of the served model (unseen ids reading their initial weights, as in
    training's evaluation), saved to a file and loaded in a fresh process that imports torch,
    fbgemm_gpu and our op library only: the same predictions at other batch sizes (dynamic),
    and the id check (a routing error) kept in the program."""
    import subprocess
    import sys

    import test_resume
    from torchrec_kvzch.serving.export import export_served, native_library

    probe = probe_batch(torch.tensor([1, 2, 3]), torch.tensor([3, 4, 5]), torch.tensor([5, 6, 7]))
    pools[1].run(train_phase, str(tmp_path / "run"), 0, 6, probe)
    kv = test_resume.table_params("ttl")
    served, _ = served_model(test_resume.Net(kv), tmp_path / "run",
                             options=ServingOptions(default="initial", kvzch={t.name: t for t in kv}))
    program = export_served(served, (probe,))
    torch.export.save(program, tmp_path / "model.pt2")
    batches = [probe_batch(torch.tensor([7]), torch.tensor([8]), torch.tensor([9])), probe,
               probe_batch(torch.arange(50) * 1000, torch.arange(50), torch.arange(50) % 40)]
    with torch.no_grad():
        want = [served(b) for b in batches]
    torch.save({"inputs": [(b.values(), b.lengths()) for b in batches], "want": want}, tmp_path / "cases.pt")
    script = f"""
import sys, torch, fbgemm_gpu
torch.ops.load_library({native_library()!r})
program = torch.export.load({str(tmp_path / 'model.pt2')!r}).module()
cases = torch.load({str(tmp_path / 'cases.pt')!r})
for (values, lengths), want in zip(cases["inputs"], cases["want"]):
    assert torch.equal(program(values, lengths), want)
try:
    program(torch.tensor([1, 2, 40]), torch.ones(3, dtype=torch.long))
    raise SystemExit("an id outside the ordinary table was served")
except Exception as e:
    assert "served table 'plain': id 40" in str(e), e
assert not any(m.startswith("torchrec") for m in sys.modules), [m for m in sys.modules if m.startswith("torchrec")]
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def trained_collection(rank, world, case, root):
    """test_sharding's EBC or EC sharded over ``world`` ranks, trained 3 steps and saved; its
    eval outputs on one batch (every rank the same) and that batch."""
    import test_sharding
    gen = torch.Generator().manual_seed(5)
    virtual = case["buckets"] * 2**37
    universe = {"kv": torch.randint(0, virtual, (50,), generator=gen).unique(),
                "kv2": torch.randint(0, virtual, (30,), generator=gen).unique(), "plain": torch.arange(37)}
    dmp = test_sharding.build(world, case, universe, twin=False)

    def kjt(rank, step):
        keys, lengths, local = test_sharding.batch(rank, step, universe, case, empty=False)
        weights = torch.rand(int(lengths.sum()), generator=torch.Generator().manual_seed(step)) \
            if case.get("weighted") else None
        values = torch.cat([universe["kv"][local["kv"]], universe["kv2"][local["kv2"]], local["plain"]])
        return KeyedJaggedTensor(keys, values, lengths=lengths, weights=weights)

    for step in range(3):
        out = test_sharding.values(dmp(kjt(rank, step)))
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(step)))
    CheckpointManager(root, process_group=dist.group.WORLD).save({"model": dmp.state_dict()}, 3)
    dmp.eval()
    probe = kjt(0, 99)  # (its ids: some trained, some not)
    with torch.no_grad():
        return test_sharding.values(dmp(probe)), probe


@pytest.mark.parametrize("case", [
    dict(pooling=None, dim=8, buckets=6, optimizer="exact_row_wise_adagrad", batch=5, max_len=4),
    dict(pooling=None, dim=8, buckets=6, optimizer="exact_sgd", batch=5, max_len=4, weight_dtype="fp16"),
    dict(pooling="MEAN", dim=8, dim2=4, buckets=5, optimizer="exact_sgd", batch=5, max_len=4),
    dict(pooling="SUM", dim=4, dim2=16, buckets=7, optimizer="exact_row_wise_adagrad", batch=5, max_len=4,
         weighted=True),
    dict(pooling="MEAN", dim=4, dim2=8, buckets=5, optimizer="exact_sgd", batch=5, max_len=4, weighted=True),
], ids=["sequence", "sequence_fp16", "mean", "weighted", "weighted_mean"])
def test_served_collections_answer_as_the_trained_ones(pools, tmp_path, case):
    """An EmbeddingCollection (sequence; fp16-stored KV-ZCH tables too, whose unseen ids read
    initial weights rounded to fp16 as training stores them) and EmbeddingBagCollections (MEAN; weighted SUM and MEAN) with
    KV-ZCH and ordinary tables, trained on 2 ranks: the served module itself (the model is the
    collection) gives the trained module's eval outputs - each row exact, pooled bags mixing
    rows and unseen ids' initial weights within rounding."""
    import test_sharding
    from torchrec.modules.embedding_configs import PoolingType
    if case["pooling"] is not None:
        case = dict(case, pooling=PoolingType[case["pooling"]])
    (want, probe), _ = pools[2].run(trained_collection, case, str(tmp_path))
    module, params = test_sharding.collection(case, universe=None)
    served, _ = served_model(module, tmp_path, options=ServingOptions(default="initial", kvzch=params))
    with torch.no_grad():
        got = test_sharding.values(served(probe))
    if case["pooling"] is None:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    if case.get("weighted"):  # a batch without its weights is refused, as TorchRec's weighted EBC refuses it
        bare = KeyedJaggedTensor(probe.keys(), probe.values(), lengths=probe.lengths())
        with pytest.raises(ValueError, match=r"ServedEmbeddingBagCollection: the module is weighted "
                                             r"\(is_weighted=True\) and the batch has no weights"):
            served(bare)
