"""A KV-ZCH table built on a real device carries a dense weight before sharding (pretrained rows,
or TorchRec's initialisation): its sharders load row i as the row of id i, each rank the ids of
its own buckets, for EmbeddingBagCollection and EmbeddingCollection alike. Before, an EBC's
KV-ZCH table trained on id-seeded rows instead (silently) and an EC failed to shard."""

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from _dist import run_ranks
from torchrec_kvzch import KVZCHTableParams, kvzch_embedding_bag_config, kvzch_embedding_config

ROWS, DIM = 1024, 8
IDS = torch.tensor([3, 700, 1023])  # on both ranks' shards (512 ids each on 2 ranks)
PRETRAINED = torch.arange(ROWS * DIM, dtype=torch.float32).reshape(ROWS, DIM) / 1000


def build(kind: str):
    params = KVZCHTableParams("t", DIM, num_embeddings=ROWS, total_num_buckets=64)
    if kind == "ebc":
        plain = EmbeddingBagConfig(name="plain", embedding_dim=DIM, num_embeddings=10, feature_names=["p"])
        return EmbeddingBagCollection(tables=[kvzch_embedding_bag_config(params, ["f"]), plain],
                                      device=torch.device("cpu"))
    plain = EmbeddingConfig(name="plain", embedding_dim=DIM, num_embeddings=10, feature_names=["p"])
    return EmbeddingCollection(tables=[kvzch_embedding_config(params, ["f"]), plain], device=torch.device("cpu"))


def rows_read(model, kind: str) -> torch.Tensor:
    """The rows the sharded model reads for IDS (bags of one id: a pooled bag is its row)."""
    batch = KeyedJaggedTensor(keys=["f", "p"], values=torch.cat([IDS, torch.tensor([1, 2, 3])]),
                              lengths=torch.ones(6, dtype=torch.long))
    model.eval()
    with torch.no_grad():
        out = model(batch).wait()
    model.train()
    return out["f"] if kind == "ebc" else out["f"].values()


def shard_materialised(rank, world):
    from _dist import sharded
    from torchrec_kvzch import kvzch_tables

    results = {}
    for kind in ("ebc", "ec"):
        for pretrained in (True, False):
            module = build(kind)
            weight = (module.embedding_bags if kind == "ebc" else module.embeddings)["t"].weight
            if pretrained:
                with torch.no_grad():
                    weight.copy_(PRETRAINED)
            expected = weight.detach().clone()[IDS]  # as set, or as TorchRec initialised it
            model = sharded(module, fused_params={"learning_rate": 0.1})
            [(_, tbe)] = kvzch_tables(model)
            read = rows_read(model, kind)
            keys = torch.sort(tbe.store.keys()).values
            r = tbe.store.bucket_range
            batch = KeyedJaggedTensor(keys=["f", "p"], values=torch.tensor([3, 1023, 1, 2]),
                                      lengths=torch.ones(4, dtype=torch.long))
            out = model(batch).wait()
            (out.values() if kind == "ebc" else out["f"].values()).sum().backward()  # trains on
            # Each rank loads its own ids from its own module (whose initialisation may differ).
            mine = (IDS >= r.id_start) & (IDS < r.id_end)
            results[kind, pretrained] = (torch.equal(read[mine], expected[mine]) and bool(mine.any()),
                                         torch.equal(keys, torch.arange(r.id_start, r.id_end)),
                                         not torch.equal(rows_read(model, kind), read))
    return results


def test_rows_set_before_sharding_become_the_tables_rows_on_two_ranks():
    for by_rank in run_ranks(2, shard_materialised):
        # rows read as set (or as initialised), each shard holding exactly its ids; trained on
        assert by_rank == {key: (True, True, True) for key in by_rank}, by_rank
