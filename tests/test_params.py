"""The KV-ZCH parameter set: every validation error, the bucket math, fbgemm conversion."""

import subprocess
import sys
import types
from unittest import mock

import pytest
from hypothesis import given, strategies as st

from torchrec_kvzch import EvictionPolicy, KVZCHTableParams, OptimizerKind


def make(**kw):
    base = dict(name="t", embedding_dim=16, num_embeddings=2**20, total_num_buckets=64)
    base.update(kw)
    return KVZCHTableParams(**base)


@pytest.mark.parametrize(
    "kw, fragment",
    [
        (dict(backend_return_whole_row=True), "backend_return_whole_row is only valid with enable_optimizer_offloading"),
        (dict(num_embeddings=1000, total_num_buckets=64), "num_embeddings 1000 is not a multiple of total_num_buckets=64"),
        (dict(embedding_dim=0), "embedding_dim must be a positive integer"),
        (dict(embedding_dim=-3), "embedding_dim must be a positive integer"),
        (dict(embedding_dim=8.0), "embedding_dim must be a positive integer"),
        (dict(total_num_buckets=0), "total_num_buckets must be a positive integer"),
        (dict(num_embeddings=True), "num_embeddings must be a positive integer"),
        (dict(checkpoint_chunk_rows=0), "checkpoint_chunk_rows must be a positive integer"),
        (dict(optimizer="lamb"), "optimizer 'lamb' is not supported (upstream's KV-ZCH tables train with these "
                                 "alone); use one of exact_rowwise_adagrad, exact_sgd, adam, partial_rowwise_adam"),
        (dict(optimizer="adam", beta2=1.0), "beta2 must be a number in [0, 1)"),
        (dict(learning_rate=0), "learning_rate must be a positive finite number"),
        (dict(eps=float("nan")), "eps must be a positive finite number"),
        (dict(init_range=(0.1, -0.1)), "init_range must be finite (low, high) with low < high"),
        (dict(init_range=5), "init_range must be a pair of numbers"),
        (dict(weight_dtype="bf8"), "weight_dtype 'bf8' is not supported"),
        (dict(eviction="ttl"), "eviction must be an EvictionPolicy"),
        (dict(eviction=EvictionPolicy(kind="random")), "eviction.kind 'random' is unknown"),
        (dict(eviction=EvictionPolicy(kind="ttl")), "eviction.kind 'ttl' needs eviction.ttl_steps"),
        (dict(eviction=EvictionPolicy(kind="lru", max_rows=-5)), "eviction.max_rows must be a positive integer, got -5"),
        (dict(eviction=EvictionPolicy(kind="lru")), "eviction.kind 'lru' needs eviction.max_rows or eviction.max_bytes"),
        (dict(eviction=EvictionPolicy(max_bytes=2**30)), "a budget (eviction.max_rows / max_bytes) needs eviction.kind"),
        (dict(eviction=EvictionPolicy(kind="ttl", ttl_steps=5, interval_steps=0)), "eviction.interval_steps must be a positive integer"),
        (dict(eviction=EvictionPolicy(kind="lfu", count_threshold=2, count_decay=0)), "eviction.count_decay must be in (0, 1]"),
        (dict(name=""), "KV-ZCH table name must be a non-empty string"),
        (dict(beta1=0.8), "beta1 has no effect with optimizer exact_row_wise_adagrad"),
        (dict(optimizer="exact_sgd", beta2=0.99), "beta2 has no effect with optimizer exact_sgd"),
        (dict(enable_optimizer_offloading="false"), "enable_optimizer_offloading must be True or False"),
        (dict(enable_optimizer_offloading=True, backend_return_whole_row=1), "backend_return_whole_row must be True"),
        (dict(learning_rate=True), "learning_rate must be a positive finite number"),
        (dict(init_seed=True), "init_seed must be an integer in [-2^55, 2^55)"),
        (dict(init_seed=2**70), "init_seed must be an integer in [-2^55, 2^55)"),
    ],
)
def test_validation_errors_name_table_field_and_fix(kw, fragment):
    with pytest.raises(ValueError) as err:
        make(**kw)
    assert fragment in str(err.value)
    if kw.get("name") != "":
        assert "KV-ZCH table 't'" in str(err.value)


@pytest.mark.parametrize("name", ["items", "keys", "values", "update", "pop", "training", "forward", "cuda",
                                  "_modules", "user.v2", "user", "item", "Items", "forward_"])
def test_a_table_name_is_refused_exactly_where_torchrecs_module_dict_refuses_it(name):
    """TorchRec keeps a collection's tables in an nn.ModuleDict; a name it refuses failed only
    when the collection was built, as a KeyError that named no fix."""
    import torch
    try:
        torch.nn.ModuleDict({name: torch.nn.Identity()})
    except KeyError:
        with pytest.raises(ValueError, match=f"KV-ZCH table '{name}': name '{name}' .*; fix: rename the table"):
            make(name=name)
    else:
        assert make(name=name).name == name


def test_validation_holds_under_python_O():
    # Real exceptions, not asserts: `python -O` strips asserts (fbgemm's validate() relies on them).
    code = ("from torchrec_kvzch import KVZCHTableParams as P\n"
            "try:\n    P('t', 8, backend_return_whole_row=True)\nexcept ValueError:\n    print('raised')")
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "raised"


def test_fewer_buckets_than_ranks_is_an_error():
    p = make(num_embeddings=64, total_num_buckets=4)
    with pytest.raises(ValueError, match=r"total_num_buckets \(4\) is smaller than the world size \(8\)"):
        p.bucket_range(0, 8)
    with pytest.raises(ValueError, match="rank 3 is outside"):
        p.bucket_range(3, 2)


def test_optimizer_parsing_and_state_sizes():
    assert make(optimizer="EXACT_SGD").optimizer is OptimizerKind.EXACT_SGD
    assert make(optimizer="exact_row_wise_adagrad").optimizer is OptimizerKind.EXACT_ROWWISE_ADAGRAD
    assert OptimizerKind.EXACT_ROWWISE_ADAGRAD.state_floats(16) == 1 and OptimizerKind.EXACT_SGD.state_floats(16) == 0
    assert OptimizerKind.EXACT_ROWWISE_ADAGRAD.to_fbgemm().name == "EXACT_ROWWISE_ADAGRAD"


def torchrec_buckets(num_embeddings, total, rank, world):
    from torchrec.distributed import batched_embedding_kernel as bek

    table = types.SimpleNamespace(name="t", num_embeddings=num_embeddings, total_num_buckets=total)
    with mock.patch.object(bek.dist, "get_world_size", return_value=world), \
            mock.patch.object(bek.dist, "get_rank", return_value=rank):
        return bek._get_sharded_local_buckets_for_zero_collision([table])[0]


@given(buckets=st.integers(1, 300), world=st.integers(1, 40), per_bucket=st.integers(1, 1 << 20))
def test_bucket_split_equals_torchrec(buckets, world, per_bucket):
    if buckets < world:
        return
    p = make(num_embeddings=buckets * per_bucket, total_num_buckets=buckets)
    ranges = [p.bucket_range(r, world) for r in range(world)]
    for rank, r in enumerate(ranges):
        assert (r.start, r.end, r.size) == torchrec_buckets(p.num_embeddings, buckets, rank, world)
    # Contiguous, covering, the first (buckets % world) ranks own one more.
    assert ranges[0].start == 0 and ranges[-1].end == buckets
    assert all(a.end == b.start for a, b in zip(ranges, ranges[1:]))
    sizes = [r.num_buckets for r in ranges]
    assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("policy, message", [
    (dict(kind="ttl"), "needs eviction.ttl_steps"),
    (dict(kind="ttl", ttl_steps=3, ttl_minutes=2.0), "two TTLs"),
    (dict(kind="ttl", ttl_minutes=-1.0), "ttl_minutes must be a positive number"),
    (dict(kind="l2"), "needs eviction.l2_threshold"),
    (dict(kind="ttl", ttl_steps=3, l2_threshold=0.5), "l2_threshold has no effect"),
    (dict(kind="lfu", count_threshold=2, trigger="rows"), "trigger_rows goes with"),
    (dict(kind="lfu", count_threshold=2, trigger_bytes=10), "trigger_bytes goes with"),
    (dict(kind="lru", max_rows=5, trigger="manual"), "has none"),
    (dict(kind="ttl", ttl_steps=3, trigger="hourly"), "trigger 'hourly' is unknown"),
    # fields the kind or trigger never reads
    (dict(kind="l2", l2_threshold=0.5, count_decay=0.5), "count_decay has no effect with eviction.kind 'l2'"),
    (dict(kind="lru", max_rows=5, count_decay=0.9), "count_decay has no effect"),
    (dict(kind="ttl", ttl_steps=3, count_decay=0.9), "count_decay has no effect"),
    (dict(kind="lfu", count_threshold=2, count_decay=True), "count_decay must be in"),
    (dict(kind="lru", max_rows=5, interval_steps=10), "interval_steps has no effect with eviction.kind 'lru'"),
    (dict(kind="none", interval_steps=10), "interval_steps has no effect"),
    (dict(kind="lfu", count_threshold=2, trigger="manual", interval_steps=10), "trigger 'manual'"),
    (dict(kind="lfu", count_threshold=2, trigger="rows", trigger_rows=9, interval_steps=3), "interval_steps has no"),
    (dict(kind="lfu", count_threshold=2, score_buckets=10), "score_buckets has no effect"),
    (dict(kind="ttl", ttl_steps=3, score_bucket_width=0.5), "score_bucket_width has no effect"),
    (dict(kind="lfu", count_threshold=2, count_decay=0.5, decay_interval_minutes=60), "decay_interval_minutes has no"),
    (dict(kind="feature_score", keep_rows=3, decay_interval_minutes=60), "count_decay, which is 1.0"),
    (dict(kind="feature_score", keep_rows=3, count_decay=0.5, decay_interval_minutes=0), "must be a positive number"),
])
def test_eviction_policy_refuses_inconsistent_fields(policy, message):
    with pytest.raises(ValueError, match=message):
        make(eviction=EvictionPolicy(**policy))


def test_eviction_policy_accepts_triggers_and_mixed_rules():
    mixed = make(eviction=EvictionPolicy(kind="lfu", count_threshold=2, ttl_minutes=30.0,
                                         trigger="rows", trigger_rows=100)).eviction
    assert mixed.trigger.value == "rows" and mixed.ttl_minutes == 30.0
    assert make(eviction=EvictionPolicy(kind="l2", l2_threshold=0.1)).eviction.kind.value == "l2"
    spaced = EvictionPolicy(kind="lfu", count_threshold=2, count_decay=0.5, trigger="free_memory",
                            free_memory_bytes=1 << 30, interval_steps=100)  # (it spaces the memory checks)
    assert make(eviction=spaced).eviction.interval_steps == 100


def test_an_untested_stack_is_warned_about(monkeypatch, caplog):
    """Importing the plugin checks torch/fbgemm-gpu/torchrec against the tested pairings: this
    stack passes, and the same fbgemm-gpu and torchrec beside torch 2.12 are warned about."""
    import torchrec_kvzch

    assert torchrec_kvzch.installed_stack() in torchrec_kvzch.SUPPORTED_STACKS
    assert torchrec_kvzch.check_stack()
    real = torchrec_kvzch.version
    monkeypatch.setattr(torchrec_kvzch, "version", lambda name: "2.12.0" if name == "torch" else real(name))
    with caplog.at_level("WARNING", logger="torchrec_kvzch"):
        assert not torchrec_kvzch.check_stack()
    assert "this is 2.12/" in caplog.text and "fbgemm-gpu must match torch" in caplog.text
