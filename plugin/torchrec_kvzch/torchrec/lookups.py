"""TorchRec's lookups and row-wise shardings, subclassed to build our kernel for KV-ZCH groups.

A row-wise sharding creates a lookup, and the lookup a kernel per group of tables: ours
(``KVZCHEmbeddingKernel``) for tables on ``STORE_KERNEL``, TorchRec's own for the others. TorchRec's
prefetch (``PrefetchTrainPipelineSparseDist``) and its KV-ZCH weight snapshots pass over customized
kernels, so the lookups hand both to ours themselves.
"""

from __future__ import annotations

from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup, GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.types import ShardingType

from torchrec_kvzch.torchrec.embedding_kernel import KVZCHEmbeddingKernel
from torchrec_kvzch.torchrec.writes import BucketedWriteDist

STORE_KERNEL = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value


class _WithOurKernels:
    def prefetch(self, sparse_features, forward_stream=None) -> None:
        """TorchRec's prefetch for its kernels, then ours (``KVZCHEmbeddingKernel.prefetch``)."""
        super().prefetch(sparse_features, forward_stream)
        if self._emb_modules:
            for kernel, features in zip(self._emb_modules, sparse_features.split(self._feature_splits)):
                if isinstance(kernel, KVZCHEmbeddingKernel):
                    kernel.prefetch(features, forward_stream)

    def get_named_split_embedding_weights_snapshot(self):
        """TorchRec's KV-ZCH kernels' snapshots, then ours."""
        yield from super().get_named_split_embedding_weights_snapshot()
        for kernel in self._emb_modules:
            if isinstance(kernel, KVZCHEmbeddingKernel):
                yield from kernel.get_named_split_embedding_weights_snapshot()


class KVZCHPooledLookup(_WithOurKernels, GroupedPooledEmbeddingsLookup):
    def _create_embedding_kernel(self, config, device, pg, sharding_type, env):
        if config.compute_kernel.value == STORE_KERNEL:
            return KVZCHEmbeddingKernel(config, pg, device, sharding_type, pooled=True)
        return super()._create_embedding_kernel(config, device, pg, sharding_type, env)


class KVZCHSequenceLookup(_WithOurKernels, GroupedEmbeddingsLookup):
    def _create_embedding_kernel(self, config, pg, device, env=None):
        if config.compute_kernel.value == STORE_KERNEL:
            return KVZCHEmbeddingKernel(config, pg, device, None, pooled=False)
        return super()._create_embedding_kernel(config, pg, device, env)


class KVZCHRwPooledSharding(RwPooledEmbeddingSharding):
    def create_lookup(self, device=None, fused_params=None, feature_processor=None):
        device = device if device is not None else self._device
        return KVZCHPooledLookup(grouped_configs=self._grouped_embedding_configs, pg=self._pg, device=device,
                                 feature_processor=feature_processor, sharding_type=ShardingType.ROW_WISE, env=self._env)


class KVZCHRwSequenceSharding(RwSequenceEmbeddingSharding):
    def create_lookup(self, device=None, fused_params=None, feature_processor=None):
        return KVZCHSequenceLookup(
            grouped_configs=self._grouped_embedding_configs, pg=self._pg,
            device=device if device is not None else self._device, env=self._env)

    def create_write_dist(self, device=None):  # (writes.py)
        return BucketedWriteDist(self, device)
