"""Admission control (params/admission.py, table/admission.py): decisions against a plain-Python
model of the policy, what ids not admitted yet read, and what the rest of the plugin sees."""

import dataclasses

import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from hypothesis import given, settings, strategies as st

from torchrec_kvzch import AdmissionPolicy, KVZCHTableParams, RowStore, TableTBE
from torchrec_kvzch.torchrec.config import ConfigError, load_config

MASK = 2**64 - 1


def mix64(x: int) -> int:
    """splitmix64's finalizer on Python ints (as unsigned 64-bit), for the model."""
    x &= MASK
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def signed(x: int) -> int:
    return x - 2**64 if x >= 2**63 else x


class Model:
    """The policy as written in table/admission.py's docstring, one id at a time."""

    def __init__(self, policy: AdmissionPolicy, seed: int):
        self.policy, self.width = policy, policy.sketch_width
        salts = [mix64(d + (seed << 8)) for d in range(policy.sketch_depth + 1)]
        self.row_salts, self.draw_salt = salts[:-1], salts[-1]
        self.counts = [[0] * self.width for _ in self.row_salts]
        self.rows, self.admitted, self.rejected = set(), 0, 0

    def batch(self, ids: list[int], step: int) -> list[bool]:
        seen = {}
        for i in ids:
            if i not in self.rows:
                seen[i] = seen.get(i, 0) + 1
        after, raised = {}, {}
        for i, c in seen.items():
            pos = [(d, mix64(i ^ s) & (self.width - 1)) for d, s in enumerate(self.row_salts)]
            after[i] = min(min(self.counts[d][p] for d, p in pos) + c, 255)
            for dp in pos:  # counters shared within the batch take the largest new count
                raised[dp] = max(raised.get(dp, 0), after[i])
        for (d, p), v in raised.items():
            self.counts[d][p] = max(self.counts[d][p], v)
        ok = {}
        for i, c in seen.items():
            if self.policy.kind.value == "count":
                ok[i] = after[i] >= self.policy.min_count
            else:
                u = ((signed(mix64(mix64(i ^ self.draw_salt) + step)) >> 11) & ((1 << 53) - 1)) / 2.0**53
                ok[i] = u < 1.0 - (1.0 - self.policy.probability) ** c
            self.admitted += ok[i]
            self.rejected += not ok[i]
        self.rows |= {i for i, good in ok.items() if good}
        return [i in self.rows for i in ids]


def params(admission: AdmissionPolicy, dim=8, **kw) -> KVZCHTableParams:
    return KVZCHTableParams("t", dim, num_embeddings=2**20, total_num_buckets=16, admission=admission,
                            learning_rate=0.1, **kw)


policies = st.one_of(
    st.builds(lambda m, w: AdmissionPolicy("count", min_count=m, sketch_width=w, sketch_depth=2),
              st.integers(2, 4), st.sampled_from([8, 64, 1024])),
    st.builds(lambda p, w: AdmissionPolicy("probability", probability=p, sketch_width=w, sketch_depth=3),
              st.floats(0.05, 0.95), st.sampled_from([8, 1024])))


@settings(deadline=None)
@given(policy=policies, log=st.lists(st.lists(st.integers(0, 40), max_size=20), max_size=12),
       seed=st.integers(0, 2**20))
def test_decisions_equal_a_plain_python_model_of_the_policy(policy, log, seed):
    """Small sketches (8 counters) make ids share counters: the model must agree there too."""
    store = RowStore(params(policy, init_seed=seed))
    model = Model(store.params.admission, seed)
    for step, ids in enumerate(log, 1):
        slots = store.lookup_for_update(torch.tensor(ids, dtype=torch.long))
        assert (slots >= 0).tolist() == model.batch(ids, step)
        assert sorted(store.keys().tolist()) == sorted(model.rows)
    assert (store.counters["admitted"], store.counters["rejected"]) == (model.admitted, model.rejected)


def test_count_admits_on_the_min_count_th_sighting_and_a_sketch_never_undercounts():
    store = RowStore(params(AdmissionPolicy("count", min_count=3)))
    seen = [store.lookup_for_update(torch.tensor(b)).ge(0).tolist() for b in ([5, 6], [5], [6, 6, 5], [7])]
    assert seen == [[False, False], [False], [True, True, True], [False]]
    assert bool((store.admission.estimate(torch.tensor([5, 6, 7])) >= torch.tensor([3, 3, 1])).all())


@pytest.mark.parametrize("default", ["zeros", "trainable"])
@pytest.mark.parametrize("pooling", [PoolingMode.SUM, PoolingMode.MEAN, PoolingMode.NONE])
def test_ids_not_admitted_read_the_default_row_and_bags_pool_over_all_ids(pooling, default):
    """Against a table without admission holding the same admitted rows: the admitted ids' part
    of each bag is that table's; the rest reads the default row (MEAN divides by all ids)."""
    p = params(AdmissionPolicy("count", min_count=2, default=default))
    ours = TableTBE(p, p.bucket_range(0, 1), num_features=2, pooling=pooling)
    plain = TableTBE(dataclasses.replace(p, admission=AdmissionPolicy()), p.bucket_range(0, 1),
                     num_features=2, pooling=pooling)
    warm = torch.tensor([1, 2, 3, 1, 2, 3])  # seen twice: admitted in this first batch
    ours(warm, torch.tensor([0, 3, 6, 6, 6])).sum().backward()
    plain(warm, torch.tensor([0, 3, 6, 6, 6])).sum().backward()
    ids = torch.tensor([1, 50, 2, 51, 52, 3])  # 50-52 are new, seen once: not admitted
    offsets = torch.tensor([0, 2, 3, 5, 6])  # feature 0: [1, 50], [2]; feature 1: [51, 52], [3]
    out = ours(ids, offsets)
    known = ids <= 3
    with torch.no_grad():
        fallback = ours.default.split_embedding_weights()[0][0] if default == "trainable" else torch.zeros(8)
        rows = torch.where(known.unsqueeze(1), plain.store.read_ids(ids.clamp(max=3)), fallback)
    if pooling == PoolingMode.NONE:
        want = rows
    else:
        bags = [rows[s:e].sum(0) / (max(e - s, 1) if pooling == PoolingMode.MEAN else 1)
                for s, e in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
        want = torch.cat([torch.stack(bags[:2]), torch.stack(bags[2:])], dim=1)  # [B, F * D]
    torch.testing.assert_close(out, want)
    assert sorted(ours.store.keys().tolist()) == [1, 2, 3]  # no rows for 50-52
    out.sum().backward()
    ours.eval()  # evaluation: an id without a row reads the default row too
    with torch.no_grad():
        rows = ours(torch.tensor([50, 1]), torch.tensor([0, 1, 2]))
    if pooling != PoolingMode.NONE:
        rows = rows.view(2, 8)
    expect = ours.default.split_embedding_weights()[0][0] if ours.default is not None else torch.zeros(8)
    torch.testing.assert_close(rows[0], expect)


def test_the_trainable_default_row_learns_from_every_id_not_admitted():
    p = params(AdmissionPolicy("count", min_count=5, default="trainable"))
    tbe = TableTBE(p, p.bucket_range(0, 1))
    for step in range(3):
        tbe(torch.arange(100 * step, 100 * step + 10), torch.tensor([0, 10])).sum().backward()
    weights = tbe.default.split_embedding_weights()[0]
    assert len(tbe.store) == 0 and bool((weights < 0).all())  # SUM's gradient 1: rows move down
    assert tbe.store.counters["rejected"] == 30 and tbe.store.counters["admitted"] == 0


@pytest.mark.parametrize("block, fragment", [
    ("{kind: count}", "admission.min_count must be an integer in [2, 255] with kind 'count'"),
    ("{kind: count, min_count: 1}", "admission.min_count must be an integer in [2, 255]"),
    ("{kind: count, min_count: 256}", "admission.min_count must be an integer in [2, 255]"),
    ("{kind: probability, probability: 1.5}", "admission.probability must be in (0, 1)"),
    ("{kind: count, min_count: 2, probability: 0.5}", "admission.probability has no effect"),
    ("{kind: count, min_count: 2, sketch_width: 1000}", "admission.sketch_width must be a power of two"),
    ("{kind: count, min_count: 2, default: mean}", "admission.default 'mean' is unknown"),
    ("{kind: lottery}", "admission.kind 'lottery' is unknown"),
    ("{default: trainable}", "admission.default has no effect with admission.kind 'none'"),
    ("{kind: none, sketch_width: 1024}", "admission.sketch_width has no effect with admission.kind 'none'"),
    ("{kind: count, min_count: 2, width: 8}", "kvzch.admission.width: unknown key"),
])
def test_admission_is_declared_in_yaml_and_checked(tmp_path, block, fragment):
    path = tmp_path / "a.yaml"
    path.write_text("tables:\n  - name: t\n    embedding_dim: 8\n    features: [f]\n"
                    f"    kvzch: {{total_num_buckets: 16, admission: {block}}}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert fragment in str(err.value)


def test_a_yaml_admission_block_becomes_the_policy(tmp_path):
    path = tmp_path / "a.yaml"
    path.write_text("tables:\n  - name: t\n    embedding_dim: 8\n    features: [f]\n"
                    "    kvzch: {total_num_buckets: 16, admission: {kind: count, min_count: 3, "
                    "default: trainable, sketch_width: 2^16}}\n")
    policy = load_config(path).tables[0].kvzch.admission
    assert (policy.kind.value, policy.min_count, policy.default.value, policy.sketch_width) == (
        "count", 3, "trainable", 2**16)


# -- checkpoints: admission state is saved, and a resume is exact --------------------------------
def _model(default="trainable", sketch_width=64):
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from _dist import sharded
    from torchrec_kvzch import KVZCHConstraints, kvzch_embedding_bag_config

    p = KVZCHTableParams("t", 8, num_embeddings=2**20, total_num_buckets=8, learning_rate=0.1,
                         admission=AdmissionPolicy("count", min_count=2, default=default, sketch_width=sketch_width),
                         enable_optimizer_offloading=True, backend_return_whole_row=True)
    ebc = EmbeddingBagCollection(tables=[kvzch_embedding_bag_config(p, ["f"])], device=torch.device("meta"))
    return sharded(ebc, {"t": KVZCHConstraints(kvzch=p)})


def _batch(step, rank, world):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    ids = torch.randint(0, 90, (24,), generator=torch.Generator().manual_seed(step)) * 11_000  # every bucket, repeats
    mine = ids[rank::world]
    return KeyedJaggedTensor(keys=["f"], values=mine, lengths=torch.ones_like(mine))


def _steps(model, steps, rank, world):
    outs = []
    for step in steps:
        out = model(_batch(step, rank, world)).wait().values()
        out.sum().backward()
        outs.append(out.detach())
    return outs


def _sketch_total(model) -> int:
    from torchrec_kvzch import kvzch_tables

    [(_, tbe)] = kvzch_tables(model)
    return int(tbe.store.admission.counts.long().sum())


def _counters(model) -> dict:
    from torchrec_kvzch import kvzch_tables

    [(_, tbe)] = kvzch_tables(model)
    return {k: v for k, v in tbe.store.counters.items() if k != "bytes"}


def _save_and_go_on(rank, world, path):
    from torchrec_kvzch import CheckpointManager

    model = _model()
    _steps(model, range(4), rank, world)
    CheckpointManager(path).save({"model": model.state_dict()}, step=4)
    at_save = (_counters(model), _sketch_total(model))
    return _steps(model, range(4, 7), rank, world), *at_save


def _load_and_go_on(rank, world, path):
    from torchrec_kvzch import CheckpointManager

    model = _model()
    _steps(model, range(100, 102), rank, world)  # state of its own, which the load replaces
    state = {"model": model.state_dict()}
    CheckpointManager(path).load(state)
    model.load_state_dict(state["model"])
    loaded = (_counters(model), _sketch_total(model))
    return _steps(model, range(4, 7), rank, world), *loaded


def test_a_resume_with_admission_is_exact_and_another_world_size_merges_the_sketches(pools, tmp_path):
    """Saved at 2 ranks: loaded at 2, every output after the resume is bitwise the run's that
    went on (same admissions, default rows and rows); loaded at 1, the sketches add up and the
    totals are kept."""
    path = str(tmp_path / "ckpt")
    saved = pools[2].run(_save_and_go_on, path)
    resumed = pools[2].run(_load_and_go_on, path)
    for (outs, counters, sketch), (again, loaded, loaded_sketch) in zip(saved, resumed):
        assert (loaded, loaded_sketch) == (counters, sketch)
        assert all(torch.equal(a, b) for a, b in zip(outs, again))
    [(_, merged, merged_sketch)] = pools[1].run(_load_and_go_on, path)
    for key in ("rows", "admitted", "rejected"):
        assert merged[key] == sum(c[key] for _, c, _ in saved)
    assert merged_sketch == sum(s for _, _, s in saved)


def _save_a_chain(rank, world, path):
    from torchrec_kvzch import CheckpointManager

    model, manager = _model(), CheckpointManager(path, full_every=2)
    for step in (4, 5):  # step 5 is a delta of step 4
        _steps(model, [step], rank, world)
        manager.save({"model": model.state_dict()}, step=step)
    return manager.chain(5)


def _load_into_a_wider_sketch(rank, world, path):
    from torchrec_kvzch import CheckpointManager, kvzch_tables
    from torchrec_kvzch.checkpoint.manager import CheckpointError

    model = _model(sketch_width=128)
    _steps(model, range(100, 102), rank, world)
    [(_, tbe)] = kvzch_tables(model)
    store = tbe.store
    before = (store.read_ids(store.keys(), "row").clone(), _counters(model), store.admission.counts.clone())
    with pytest.raises(CheckpointError) as refused:
        CheckpointManager(path).load({"model": model.state_dict()})
    after = (store.read_ids(store.keys(), "row"), _counters(model), store.admission.counts)
    unchanged = all(torch.equal(a, b) for a, b in zip(before[::2], after[::2])) and before[1] == after[1]
    return str(refused.value), unchanged


def test_a_sketch_that_does_not_fit_is_refused_before_a_chain_changes_anything(pools, tmp_path):
    """Saved at 2 ranks, loaded at 1 into a wider sketch: merging the blocks could only fail
    after the rows were replaced, so the manager's check of the chain refuses it, naming the
    shape saved (not a reshaped one), and the model stays as it was."""
    path = str(tmp_path / "ckpt")
    assert pools[2].run(_save_a_chain, path)[0] == [4, 5]
    [(error, unchanged)] = pools[1].run(_load_into_a_wider_sketch, path)
    assert "KV-ZCH table 't' was saved with a 'admission_sketch' of [4, 64] per rank (saved at world size 2), " \
           "this model's is [4, 128] per rank" in error, error
    assert unchanged
