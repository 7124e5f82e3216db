"""The KV-ZCH parameter set: per-table options, their validation, and the bucket math.

Every check raises ``ValueError`` naming the table, the field and the fix (fbgemm's own
``KVZCHParams.validate`` uses ``assert``, which ``python -O`` strips). TorchRec's own KV-ZCH
declarations become these parameters in ``torchrec/declarations.py``.
"""

from torchrec_kvzch.params.admission import AdmissionDefault, AdmissionKind, AdmissionPolicy
from torchrec_kvzch.params.eviction import EvictionKind, EvictionPolicy, EvictionTrigger, RankBudget
from torchrec_kvzch.params.optimizer import OPTIMIZER_DEFAULTS, OptimizerKind, WeightDecayMode
from torchrec_kvzch.params.storage import CachePolicy, DeviceCache, DiskStorage
from torchrec_kvzch.params.table import BucketRange, KVZCHTableParams

__all__ = ["OPTIMIZER_DEFAULTS", "AdmissionDefault", "AdmissionKind", "AdmissionPolicy", "BucketRange", "CachePolicy", "DeviceCache", "DiskStorage",
           "EvictionKind", "EvictionPolicy", "EvictionTrigger",
           "KVZCHTableParams", "OptimizerKind", "RankBudget", "WeightDecayMode"]
