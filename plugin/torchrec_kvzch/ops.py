"""Every op a served model's program calls, registered: ``import torchrec_kvzch.ops`` before
``torch.export.load`` in a process that serves one. It loads our native library (the CPU ops,
where it is built) and the device-independent ops (``table/served_rows.py``), and imports no
TorchRec."""

import fbgemm_gpu  # noqa: F401  (fbgemm's inference op, which every served lookup calls)

from torchrec_kvzch.table import served_rows  # noqa: F401
from torchrec_kvzch.table.native import NATIVE_WHY, native_status

__all__ = ["NATIVE_WHY", "native_status"]
