"""Feature-score eviction (``EvictionPolicy(kind="feature_score")``, TorchRec's
``FeatureScoreBasedEvictionPolicy``): scores kept in the rows' headers, fed from the batch,
decayed and cut as fbgemm's ``FeatureScoreBasedEvict`` does."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from torchrec_kvzch import EvictionPolicy, KVZCHTableParams, RowStore
from torchrec_kvzch.table.eviction import lowest_scores
from torchrec_kvzch.table.layout import meta_score, meta_timestamp
from torchrec_kvzch.table.snapshot import RowSnapshot
from torchrec_kvzch.torchrec.tables import kvzch_tables

from test_eviction import Model


class ScoreModel(Model):
    """fbgemm's rule in plain Python, row by row (``feature_evict.h``): each occurrence adds
    its score; a pass decays every score (fp32 of the fp64 product), puts them in buckets
    (0: below 1e-9; b: ``int(score / width) + 1``; the last: the rest) and drops every zero
    score if those suffice, else the rows scoring at most ``b * width`` for the first bucket
    ``b`` whose running count reaches the excess over ``keep_rows`` (the buckets hold the scores
    before the decay, the comparison takes them after it). Budgets drop the lowest
    (score, timestamp, id) first; the batch's own rows are never dropped for it. (``Model``'s
    rows, id -> [timestamp, score], with the score an ``np.float32``.)"""

    def forward(self, ids, scores):
        self.clock += 1
        protected = set(ids) & self.rows.keys()
        doomed = self.run_pass(protected) if self.due() else set()
        if self.max_rows is not None:
            new = len(set(ids) - self.rows.keys())
            survivors = len(self.rows) - len(doomed)
            if survivors + new > self.max_rows:
                need = survivors + new - (self.max_rows - self.max_rows // 64)
                pool = sorted((i for i in self.rows if i not in protected | doomed),
                              key=lambda i: (self.rows[i][1], self.rows[i][0], i))
                doomed.update(pool[:need])
        self.drop(doomed)
        for i, w in zip(ids, scores):
            row = self.rows.setdefault(i, [self.clock, np.float32(0)])
            row[0], row[1] = self.clock, np.float32(abs(row[1] + np.float32(w)))

    def run_pass(self, protected=frozenset()):
        p = self.policy
        excess, counts = len(self.rows) - p.keep_rows, [0] * p.score_buckets
        for _, s in self.rows.values():  # (the cut comes from the scores before the decay)
            counts[self.bucket(s)] += 1
        for row in self.rows.values():
            row[1] = np.float32(float(row[1]) * p.count_decay)
        if excess <= 0:
            return set()
        if counts[0] >= excess:
            doomed = {i for i, (_, s) in self.rows.items() if abs(s) < 1e-9}
        else:
            held, cut = counts[0], p.score_buckets - 1
            for b in range(1, p.score_buckets):
                held += counts[b]
                if held >= excess:
                    cut = b
                    break
            doomed = {i for i, (_, s) in self.rows.items() if float(s) <= cut * p.score_bucket_width}
        return doomed - protected

    def bucket(self, s):
        p = self.policy
        if abs(s) < 1e-9:
            return 0
        if s >= p.score_buckets * p.score_bucket_width:
            return p.score_buckets - 1
        return min(int(float(s) / p.score_bucket_width) + 1, p.score_buckets - 1)


def store_rows(store):
    ids = torch.sort(store.keys()).values
    meta = store.meta[store.find(ids)]
    return {i: [t, np.float32(s)] for i, t, s in zip(ids.tolist(), meta_timestamp(meta).tolist(),
                                                     meta_score(meta).tolist())}


def policies(d):
    trigger = d.draw(st.sampled_from(["interval", "rows", "manual"]))
    return EvictionPolicy(
        "feature_score", keep_rows=d.draw(st.integers(1, 30)), count_decay=d.draw(st.sampled_from([1.0, 0.5, 0.9])),
        score_bucket_width=d.draw(st.sampled_from([0.2, 0.5, 1.0])), score_buckets=d.draw(st.sampled_from([2, 5, 1000])),
        trigger=trigger, interval_steps=d.draw(st.integers(1, 3)) if trigger == "interval" else 1,
        trigger_rows=d.draw(st.integers(1, 40)) if trigger == "rows" else None,
        max_rows=d.draw(st.one_of(st.none(), st.integers(5, 40))))


@settings(max_examples=max(10, settings().max_examples // 2), deadline=None)
@given(data=st.data())
def test_store_agrees_with_fbgemms_rule_written_out(data):
    """Any sequence of batches (scores: multiples of 1/4, so that sums are exact),
    idle steps, passes on request and frozen snapshots: the same rows, timestamps and scores
    as the plain model, and a snapshot's headers as they were at its freeze."""
    policy = policies(data)
    params = KVZCHTableParams("t", 4, num_embeddings=2**20, total_num_buckets=16, eviction=policy)
    store = RowStore(params, backend=data.draw(st.sampled_from(["native", "torch"])))
    model = ScoreModel(params.eviction, store.evictor.max_rows)
    snapshot = None
    ops = data.draw(st.lists(st.one_of(
        st.tuples(st.just("batch"), st.lists(st.tuples(st.integers(0, 60), st.integers(0, 12)), max_size=25)),
        st.tuples(st.just("unscored"), st.lists(st.integers(0, 60), max_size=10)),
        st.tuples(st.just("pass"), st.none()),
        st.tuples(st.just("freeze"), st.none()),
        st.tuples(st.just("release"), st.none())), max_size=30))
    for op, arg in ops:
        if op in ("batch", "unscored"):
            ids = [i for i, _ in arg] if op == "batch" else arg
            scores = [w / 4 for _, w in arg] if op == "batch" else [0.0] * len(arg)
            store.lookup_for_update(torch.tensor(ids, dtype=torch.long),
                                    torch.tensor(scores) if op == "batch" else None)
            model.forward(ids, scores)
        elif op == "pass":
            store.evictor.run_pass()
            model.drop(model.run_pass())
        elif op == "freeze" and snapshot is None:
            snapshot = RowSnapshot(store)
            snapshot.freeze()
            at_freeze = snapshot.read(0, len(snapshot), "row").clone()
        elif op == "release" and snapshot is not None:
            assert torch.equal(snapshot.read(0, len(snapshot), "row"), at_freeze)
            snapshot.release()
            snapshot = None
        assert store_rows(store) == model.rows
        assert store.counters["evicted"] == model.evicted


def test_cut_is_fbgemms_bucket_threshold():
    """The three cases of fbgemm's rule, and the overshoot it allows (a whole bucket)."""
    s = torch.tensor([0.0, 0.0, 0.1, 0.3, 0.3, 0.5, 2.0, 100.0])
    assert not lowest_scores(s, 8, 0.2, 10).any()  # keeps all
    assert lowest_scores(s, 7, 0.2, 10).tolist() == [True, True] + [False] * 6  # zeros, both, for 1
    # 3 to drop: buckets 0 {0, 0}, 1 {0.1}: the cut is bucket 1 (<= 0.2)
    assert lowest_scores(s, 5, 0.2, 10).sum() == 3
    # 4 to drop: bucket 2 [0.2, 0.4) holds both 0.3s: cut at 0.4, 5 rows go (one more than asked)
    assert lowest_scores(s, 4, 0.2, 10).sum() == 5
    # the cut takes scores equal to it, as fbgemm's (``overall_ratio <= threshold`` since 1.6),
    # though they sit in the next bucket
    assert lowest_scores(torch.tensor([0.25, 0.5, 0.5, 1.0]), 3, 0.5, 10).tolist() == [True, True, True, False]
    # integer scores land on bucket edges: 3 rows of 0.9 (bucket 5), 3 of 1.0 (bucket 6), 3 of 2.0;
    # 2 to drop -> the cut is bucket 5, 1.0: the 0.9s and the 1.0s go (fbgemm keeps 3 rows)
    s9 = torch.tensor([0.9] * 3 + [1.0] * 3 + [2.0] * 3)
    assert lowest_scores(s9, 7, 0.2, 1000).tolist() == [True] * 6 + [False] * 3
    # the cut comes from the scores before a decay; the decayed ones are compared with it
    decayed = s9 * 0.5  # 0.45, 0.5, 1.0: all at most the cut of 1.0 (one from them, 0.6, would keep the 1.0s)
    assert lowest_scores(s9, 7, 0.2, 1000, decayed).tolist() == [True] * 9
    # a score past the last bucket's start counts in it: 2 buckets of 0.2, 7 to drop -> the cut is 0.2
    assert lowest_scores(s, 1, 0.2, 2).tolist() == [True] * 3 + [False] * 5


def test_decay_interval_spaces_the_decays_in_wall_clock_time():
    """With ``decay_interval_minutes`` a pass decays only once that long has passed since the
    last decay (or the first training batch); the cut still runs at every pass."""
    policy = EvictionPolicy("feature_score", keep_rows=100, count_decay=0.5, decay_interval_minutes=60)
    store = RowStore(KVZCHTableParams("t", 4, eviction=policy))
    now = [0.0]
    store.evictor.time_source = lambda: now[0]
    scores = []
    for minute in (0, 30, 59, 61, 90, 125):
        now[0] = minute * 60.0
        store.lookup_for_update(torch.tensor([7]), torch.tensor([0.0]))  # (a pass every step)
        scores.append(float(meta_score(store.meta[store.find(torch.tensor([7]))])[0]))
        if minute == 0:
            store.meta[0:1] = store.meta[0:1] | (torch.tensor([16.0]).view(torch.int32).long() << 32)
    assert scores == [0.0, 16.0, 16.0, 8.0, 8.0, 4.0]


def test_policy_fields_are_checked():
    def refused(match, **kw):
        with pytest.raises(ValueError, match=match):
            EvictionPolicy(**kw).validate("t")

    refused("needs eviction.keep_rows", kind="feature_score")
    refused("keep_rows has no effect with eviction.kind 'lfu'", kind="lfu", count_threshold=1, keep_rows=3)
    refused("default_feature_score goes with eviction.feature_scores", kind="feature_score", keep_rows=3,
            default_feature_score=1.0)
    refused("score_buckets must be an integer >= 2", kind="feature_score", keep_rows=3, score_buckets=1)
    refused("score_bucket_width must be a positive number", kind="feature_score", keep_rows=3, score_bucket_width=0)
    refused("feature_scores maps feature names to numbers", kind="feature_score", keep_rows=3,
            feature_scores={"f": float("nan")})
    policy = EvictionPolicy("feature_score", keep_rows=3, feature_scores={"b": 2, "a": 1}).validate("t")
    assert policy.feature_scores == (("a", 1.0), ("b", 2.0)) and hash(policy)
    with pytest.raises(ValueError, match="feature 'c' has no score in eviction.feature_scores"):
        policy.feature_score("c", "t")


# -- declared as in TorchRec, sharded, checkpointed ------------------------------------------
def scored_model(rank, world, keep, trigger):
    """A pooled table scored by the KJT's weights and a sequence table scored by its feature
    (TorchRec's automatic collection), both declared with ``FeatureScoreBasedEvictionPolicy``
    and passes past ``trigger`` rows a shard (fbgemm's id-count trigger)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import KVZCHTBEConfig
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import KeyValueParams
    from torchrec.modules.embedding_configs import EmbeddingConfig, FeatureScoreBasedEvictionPolicy

    from test_declarations import _dmp, config

    def policy(**auto):
        return FeatureScoreBasedEvictionPolicy(training_id_eviction_trigger_count=trigger, training_id_keep_count=keep,
                                               decay_rate=0.5, **auto)

    user = config(policy(), name="user")
    seq = config(policy(enable_auto_feature_score_collection=True, feature_score_mapping={"f_seq": 1.5}),
                 cls=EmbeddingConfig, name="seq")
    by_count = KeyValueParams(kvzch_tbe_config=KVZCHTBEConfig(kvzch_eviction_trigger_mode=4))
    constraints = {n: ParameterConstraints(sharding_types=["row_wise"], compute_kernels=["dram_virtual_table"],
                                           key_value_params=by_count) for n in ("user", "seq")}
    return _dmp(rank, world, [user, seq], constraints,
                {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1})


def scored_batches(rank, step):
    from test_declarations import _batch

    gen = torch.Generator().manual_seed(7 + 100 * step + rank)
    weights = torch.randint(1, 9, (8,), generator=gen) / 4  # (exact sums)
    return _batch(rank, step, ["f_user"], weights=weights), _batch(rank, step, ["f_seq"])


def headers(model):
    """{table: (ids, weights, header words)} of this rank's rows, by id."""
    from torchrec_kvzch.torchrec.tables import kvzch_tables

    out = {}
    for name, tbe in kvzch_tables(model):
        store = tbe.store
        ids = torch.sort(store.keys()).values
        slots = store.find(ids)
        out[name] = (ids, store.weights[slots].clone(), store.meta[slots].clone())
    return out


def train_scored(rank, world, steps):
    """Train with scores on the batch, no pass due; a twin without the pooled table's weights
    trains alike (scores never scale an output or a gradient)."""
    scored, twin = scored_model(rank, world, 10_000, 10_000), scored_model(rank, world, 10_000, 10_000)
    same = True
    for step in range(steps):
        (bags, seqs), (plain, twin_seqs) = scored_batches(rank, step), scored_batches(rank, step)
        plain = type(bags)(keys=bags.keys(), values=bags.values(), lengths=bags.lengths())
        # (TorchRec's input dist writes the collected scores into a KJT's weights: one KJT a call)
        a, b = scored(bags, seqs), twin(plain, twin_seqs)
        same &= torch.equal(a, b)
        a.backward(), b.backward()
    rows, twin_rows = headers(scored), headers(twin)
    same &= all(torch.equal(rows[n][1], twin_rows[n][1]) for n in rows)
    return same, rows


def test_declared_scores_add_up_the_batches_and_never_scale_outputs(pools):
    """Each id's score is the sum of its occurrences' scores over every rank's batches: the KJT
    weights for the pooled table, 1.5 per occurrence for the sequence table."""
    steps, world = 3, 2
    results = pools[world].run(train_scored, steps)
    assert all(same for same, _ in results)
    expected = {"user": {}, "seq": {}}
    for rank in range(world):
        for step in range(steps):
            bags, seqs = scored_batches(rank, step)
            for i, w in zip(bags.values().tolist(), bags.weights().tolist()):
                expected["user"][i] = expected["user"].get(i, 0.0) + w
            for i in seqs.values().tolist():
                expected["seq"][i] = expected["seq"].get(i, 0.0) + 1.5
    for name in ("user", "seq"):
        got = {}
        for _, rows in results:
            ids, _, meta = rows[name]
            got.update(zip(ids.tolist(), meta_score(meta).tolist()))
        assert got == expected[name]


def save_scored(rank, world, root):
    """Train with passes (keep 8 rows a shard past 12) that decay and cut scores; a full
    checkpoint at step 3, a delta at step 6; returns the rows at step 6."""
    from torchrec_kvzch.checkpoint.manager import CheckpointManager

    model = scored_model(rank, world, 8, 12)
    for _, tbe in kvzch_tables(model):  # a day between clock readings: every pass decays (declared: daily)
        assert tbe.store.evictor.policy.decay_interval_minutes == 24 * 60
        tbe.store.evictor.time_source = itertools.count(0, 24 * 3600).__next__
    manager = CheckpointManager(root)
    for step in range(6):
        model(*scored_batches(rank, step)).backward()
        if step + 1 in (3, 6):
            state = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
            manager.save(state, step + 1, incremental=True)  # (the first: in full, logging from then on)
    evicted = {n: t.store.history.evicted for n, t in kvzch_tables(model)}
    return headers(model), evicted


def load_scored(rank, world, root):
    from torchrec_kvzch.checkpoint.manager import CheckpointManager

    model = scored_model(rank, world, 8, 12)
    state = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
    assert CheckpointManager(root).load(state) == 6
    return headers(model)


def test_scores_resume_exactly_at_another_world_size_through_a_delta(pools, tmp_path):
    """Saved on 2 ranks as a full checkpoint and a delta whose base decays every score (the
    rows the delta leaves out decay on load as they did in training), loaded on 1 rank: the
    same rows, weights, timestamps and scores."""
    saved = pools[2].run(save_scored, str(tmp_path))
    assert all(evicted["user"] > 0 and evicted["seq"] > 0 for _, evicted in saved)  # passes ran
    from torchrec_kvzch.checkpoint.manager import CheckpointManager

    link = CheckpointManager(tmp_path)._link(6)[1]
    assert link["step"] == 3 and all(all(r) for r in link["decays"].values())  # a delta, decays to replay
    [loaded] = pools[1].run(load_scored, str(tmp_path))
    for name in ("user", "seq"):
        ids, weights, meta = (torch.cat([rows[name][k] for rows, _ in saved]) for k in range(3))
        order = torch.argsort(ids)
        assert torch.equal(loaded[name][0], ids[order])
        assert torch.equal(loaded[name][1], weights[order])
        assert torch.equal(loaded[name][2], meta[order])
        assert meta_score(meta).max() > 0


def test_configured_in_yaml(tmp_path):
    """A YAML ``eviction`` block with scores per feature."""
    from torchrec_kvzch.job import config_path
    from torchrec_kvzch.torchrec.config import load_config

    text = config_path("eviction").read_text().replace(
        "eviction: {kind: ttl, ttl_steps: 50, interval_steps: 10}",
        "eviction: {kind: feature_score, keep_rows: 5000, count_decay: 0.9, trigger: rows, trigger_rows: 8000,\n"
        "                 feature_scores: {user_id: 2.5}, default_feature_score: 1.0}")
    path = tmp_path / "scored.yaml"
    path.write_text(text)
    user = load_config(path).kvzch_tables[0]
    assert user.eviction == EvictionPolicy("feature_score", keep_rows=5000, count_decay=0.9, trigger="rows",
                                           trigger_rows=8000, feature_scores={"user_id": 2.5},
                                           default_feature_score=1.0).validate("user")
    path.write_text(text.replace("keep_rows: 5000, ", ""))
    with pytest.raises(ValueError, match="needs eviction.keep_rows"):
        load_config(path)


def shard_refused(rank, world):
    """What a kernel cannot score is refused when it is sharded, naming the table and the fix."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import KVZCHTBEConfig
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import KeyValueParams
    from torchrec.modules.embedding_configs import FeatureScoreBasedEvictionPolicy
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from _dist import refusals, sharded
    from test_declarations import config
    from torchrec_kvzch.torchrec import KVZCHConstraints, kvzch_embedding_bag_config

    weighted = EmbeddingBagCollection(tables=[config(FeatureScoreBasedEvictionPolicy(training_id_keep_count=5),
                                                     name="user")], is_weighted=True, device=torch.device("meta"))
    native = KVZCHTableParams("user", 16, num_embeddings=2**20, total_num_buckets=8, eviction=EvictionPolicy(
        "feature_score", keep_rows=5, feature_scores={"other": 1.0}))
    unscored = EmbeddingBagCollection(tables=[kvzch_embedding_bag_config(native, ["f_user"])],
                                      device=torch.device("meta"))
    manual = {"user": ParameterConstraints(key_value_params=KeyValueParams(
        kvzch_tbe_config=KVZCHTBEConfig(kvzch_eviction_trigger_mode=3)))}
    return refusals(lambda: sharded(weighted, manual),
                    lambda: sharded(unscored, {"user": KVZCHConstraints(kvzch=native)}), errors=ValueError)


def negative_score_refused(rank, world):
    """One step, then a batch with a negative score: the error, and whether every table's rows,
    headers and clock are as before it."""
    model = scored_model(rank, world, 8, 12)
    model(*scored_batches(rank, 0)).backward()
    before = headers(model), [t.store.clock for _, t in kvzch_tables(model)]
    user, seq = scored_batches(rank, 1)
    bad = type(user)(keys=user.keys(), values=user.values(), lengths=user.lengths(),
                     weights=torch.tensor([1.0, 0.5, -0.25, 1.0, 1.0, 1.0, 1.0, 1.0]))
    with pytest.raises(ValueError) as refused:
        model(bad, seq)
    after = headers(model), [t.store.clock for _, t in kvzch_tables(model)]
    same = before[1] == after[1] and all(torch.equal(a, b) for n in before[0]
                                         for a, b in zip(before[0][n], after[0][n]))
    return str(refused.value), same


def test_a_negative_score_is_refused_before_any_table_looks_the_batch_up(pools):
    [(message, unchanged)] = pools[1].run(negative_score_refused)
    assert "feature 'f_user' (table 'user') has feature score -0.25 at its id 2" in message
    assert unchanged


def test_what_a_kernel_cannot_score_is_refused_by_name(pools):
    [messages] = pools[1].run(shard_refused)
    assert len(messages) == 2
    assert "KV-ZCH table 'user': its feature scores would be the KJT's weights" in messages[0]
    assert "in a weighted EmbeddingBagCollection are pooling weights too" in messages[0]
    assert "KV-ZCH table 'user': feature 'f_user' has no score in eviction.feature_scores ['other']" in messages[1]


def test_a_count_ordered_rank_budget_refuses_to_mix_scores_and_counts():
    """An ``lfu`` rank budget compares the headers' count fields: across feature-score and
    counting tables that compares scores with counts, so it is refused; ``lru`` is fine, and so
    is ``lfu`` over feature-score tables alone."""
    from torchrec_kvzch import RankBudget, SharedBudget

    scored = KVZCHTableParams("scored", 4, num_embeddings=2**20, total_num_buckets=4,
                              eviction=EvictionPolicy("feature_score", keep_rows=10))
    counted = KVZCHTableParams("counted", 4, num_embeddings=2**20, total_num_buckets=4,
                               eviction=EvictionPolicy("lfu", count_threshold=1))
    budget = SharedBudget(RankBudget(max_rows=100, order="lfu"))
    stores = [RowStore(scored, budget=budget)]
    with pytest.raises(ValueError, match="rank budget: order 'lfu' compares access counts, but table 'scored' "
                                         "keeps feature scores where table 'counted' keeps counts"):
        stores.append(RowStore(counted, budget=budget))
    stores.append(RowStore(scored, budget=budget))  # scores with scores
    lru = SharedBudget(RankBudget(max_rows=100, order="lru"))
    stores += [RowStore(scored, budget=lru), RowStore(counted, budget=lru)]
