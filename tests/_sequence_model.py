"""Stand-ins for what TorchRec's missing ``torchrec.distributed.tests.test_sequence_model`` offers.

The torchrec 1.8.0 wheel's ``test_utils/test_sharding.py`` imports
``TestEmbeddingCollectionSharder`` from that module, which the wheel does not ship;
``tests/test_upstream_ports.py`` registers this module under that name. The EC ports also need a
sequence model like upstream's ``TestSequenceSparseNN``: ``SequenceSparseNN`` is our own version
with the same constructor, submodule names (``dense``, ``sparse.ec``) and forward contract.
(The file name does not start with "test_", so pytest does not collect it.)
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.fbgemm_qcomm_codec import QCommsConfig, get_qcomm_codecs_registry
from torchrec.distributed.test_utils.test_model import (
    DENSE_LAYER_OUT_SIZE,
    ModelInput,
    TestDenseArch,
    TestSparseNNBase,
)
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection

SEQUENCE_LENGTH = 20  # every feature's sequence is cut or zero-padded to this many ids
SPARSE_SCALE = 10.0  # makes the prediction sensitive enough to wrong embeddings


class _SequenceArch(nn.Module):
    """EmbeddingCollection whose per-feature sequences are padded and laid side by side."""

    def __init__(self, tables: List[EmbeddingConfig], features: List[str],
                 device: Optional[torch.device]) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(tables=tables, device=device or torch.device("cpu"),
                                      need_indices=True)
        self.features = features

    def forward(self, kjt, batch_size: int) -> torch.Tensor:
        by_feature = self.ec(kjt)
        flat = torch.cat([
            by_feature[name].to_padded_dense(desired_length=SEQUENCE_LENGTH).flatten(1)
            for name in self.features
        ], dim=1)
        missing = batch_size - flat.size(0)
        return F.pad(flat, (0, 0, 0, missing)) if missing > 0 else flat


class SequenceSparseNN(TestSparseNNBase):
    """Dense arch + padded EC sequences -> one linear layer; the features of the first
    embedding group are used. Returns ``(loss, prediction)`` in training mode, else the
    prediction (as TorchRec's test models do)."""

    def __init__(self, tables: List[EmbeddingConfig],
                 weighted_tables: Optional[List[EmbeddingConfig]] = None,
                 num_float_features: int = 10,
                 embedding_groups: Optional[Dict[str, List[str]]] = None,
                 dense_device: Optional[torch.device] = None,
                 sparse_device: Optional[torch.device] = None,
                 feature_processor_modules: Optional[Dict[str, nn.Module]] = None) -> None:
        super().__init__(tables=tables, weighted_tables=weighted_tables,
                         embedding_groups=embedding_groups, dense_device=dense_device,
                         sparse_device=sparse_device)
        groups = list((embedding_groups or {}).values())
        self.dense = TestDenseArch(num_float_features=num_float_features, device=dense_device)
        self.sparse = _SequenceArch(tables, groups[0] if groups else [], sparse_device)
        sparse_width = SEQUENCE_LENGTH * sum(t.embedding_dim * len(t.feature_names) for t in tables)
        self.over = nn.Linear(DENSE_LAYER_OUT_SIZE + sparse_width, 16, device=dense_device)

    def forward(self, input: ModelInput):
        dense = self.dense(input.float_features)
        sparse = SPARSE_SCALE * self.sparse(input.idlist_features, input.float_features.size(0))
        prediction = torch.sigmoid(self.over(torch.cat([dense, sparse], dim=1)).mean(dim=1))
        if not self.training:
            return prediction
        return F.binary_cross_entropy_with_logits(prediction, input.label), prediction


class TestEmbeddingCollectionSharder(EmbeddingCollectionSharder):
    """EC sharder offering one sharding type and one compute kernel (learning rate 0.1 unless
    ``fused_params`` says otherwise); test_sharding.py builds it with these arguments."""

    def __init__(self, sharding_type: str, kernel_type: str,
                 qcomms_config: Optional[QCommsConfig] = None,
                 fused_params: Optional[Dict[str, Any]] = None,
                 use_index_dedup: bool = False) -> None:
        self._sharding_type = sharding_type
        self._kernel_type = kernel_type
        registry = get_qcomm_codecs_registry(qcomms_config) if qcomms_config is not None else {}
        super().__init__(fused_params={"learning_rate": 0.1, **(fused_params or {})},
                         qcomm_codecs_registry=registry, use_index_dedup=use_index_dedup)

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return [self._sharding_type]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return [self._kernel_type]
