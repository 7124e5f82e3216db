"""TorchRec's embedding writes (``DistributedModelParallel.write``) into KV-ZCH tables.

A table declared with ``enable_embedding_update=True`` in an ``EmbeddingCollection`` is, as
upstream, an embedding cache: ``write(kjt)`` - ids as the values, each id's row in the
weights, ``[n, D]`` - sends each row to the rank whose shard holds its id and writes it there
(``KVZCHEmbeddingKernel.update``); lookups read the rows without training them.

The distribution is ours: TorchRec's (``RwSparseFeaturesWriteDist``) splits ids by table size
over the world, where KV-ZCH shards are whole buckets, and the KJT its all-to-all rebuilds on
the CPU keeps one value of each row. Ours routes by the shards' row ranges, as lookups are
routed, and sends ids and rows in two all-to-alls after one of their counts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.types import Awaitable, NoWait
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


class BucketedWriteDist(nn.Module):
    """The writes of a row-wise sequence sharding's writable tables, to their shards' ranks.
    ``forward(kjt)`` returns (twice awaitable, as TorchRec's write dists) the KJT of this rank's
    part: its features in order, each id local to its shard (as lookups see them), its row in
    the weights."""

    def __init__(self, sharding, device: torch.device | None = None) -> None:
        super().__init__()
        self._pg = sharding._pg
        self._world = dist.get_world_size(self._pg)
        self._keys: list[str] = []
        starts, owners = [], []  # per feature: its table's shard starts (ascending) and their ranks
        self._tables: list[tuple[str, int]] = []  # per feature: its table's name and num_embeddings
        for group in sharding._grouped_embedding_configs:
            if not group.enable_embedding_update:
                continue
            for table in group.embedding_tables:
                shards = sorted((s.shard_offsets[0], s.placement.rank()) for s in table.global_metadata.shards_metadata)
                for feature in table.feature_names:
                    self._keys.append(feature)
                    self._tables.append((table.name, table.num_embeddings))
                    starts.append(torch.tensor([s for s, _ in shards]))
                    owners.append(torch.tensor([r for _, r in shards]))
        self._starts, self._owners = starts, owners

    def forward(self, kjt: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        if kjt.keys() != self._keys or kjt.weights_or_none() is None or kjt.weights().dim() != 2:
            raise ValueError(f"an embedding write takes a KJT of the features {self._keys}, in that order, "
                             f"with one row per id in its 2-D weights; got features {kjt.keys()}")
        device, rows = kjt.values().device, kjt.weights()
        dest, local, feature = [], [], []
        for f, part in enumerate(kjt.split([1] * len(self._keys))):
            values = part.values().long()
            starts = self._starts[f].to(device)
            shard = torch.searchsorted(starts, values, right=True) - 1
            (table, limit), low, high = self._tables[f], *(torch.aminmax(values) if values.numel() else (0, 0))
            if int(low) < 0 or int(high) >= limit:  # (before anything is sent: no table is written in part)
                raise ValueError(f"embedding write of feature '{self._keys[f]}' (table '{table}'): id "
                                 f"{int(low) if int(low) < 0 else int(high)} is outside [0, {limit}); hash or "
                                 "remap ids into the table's num_embeddings")
            local.append(values - starts[shard])
            dest.append(self._owners[f].to(device)[shard])
            feature.append(torch.full_like(values, f))
        dest, feature, local = torch.cat(dest), torch.cat(feature), torch.cat(local)
        order = torch.argsort(dest * len(self._keys) + feature, stable=True)  # by rank, then feature
        counts = torch.bincount(dest * len(self._keys) + feature, minlength=self._world * len(self._keys))
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self._pg)
        send = counts.view(self._world, -1).sum(1).tolist()
        take = received.view(self._world, -1)  # [source rank, feature]
        got_ids = local.new_empty(int(take.sum()))
        got_rows = rows.new_empty(int(take.sum()), rows.shape[1])
        dist.all_to_all_single(got_ids, local[order].contiguous(), take.sum(1).tolist(), send, group=self._pg)
        dist.all_to_all_single(got_rows, rows[order].contiguous(), take.sum(1).tolist(), send, group=self._pg)
        # From each source rank, its ids feature by feature: regroup feature-major.
        source_feature = torch.arange(take.numel(), device=device).repeat_interleave(take.reshape(-1))
        regroup = torch.argsort((source_feature % len(self._keys)) * self._world + source_feature // len(self._keys),
                                stable=True)
        out = KeyedJaggedTensor(keys=self._keys, values=got_ids[regroup], weights=got_rows[regroup],
                                lengths=take.sum(0))
        return NoWait(NoWait(out))
