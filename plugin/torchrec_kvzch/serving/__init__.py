"""Serving trained models from their checkpoints (issue 31; docs/serving.md): KV-ZCH tables
without optimizer state, quantized as fbgemm's inference TBE reads them (``table``), read from
a CheckpointManager directory chunk by chunk (``source``, ``build``), behind TorchRec's module
interfaces (``modules``, ``model``), exported with torch.export (``export``), and following new
checkpoints live (``follower``)."""

from torchrec_kvzch.serving.export import export_served, native_library
from torchrec_kvzch.serving.follower import Follower, Version
from torchrec_kvzch.serving.model import ServingOptions, served_model
from torchrec_kvzch.serving.modules import ServedEmbeddingBagCollection, ServedEmbeddingCollection
from torchrec_kvzch.serving.table import SERVED_DTYPES, ServedTable, decode, encode

__all__ = ["SERVED_DTYPES", "Follower", "ServedEmbeddingBagCollection", "ServedEmbeddingCollection", "ServedTable",
           "ServingOptions", "Version", "decode", "encode", "export_served", "native_library", "served_model"]
