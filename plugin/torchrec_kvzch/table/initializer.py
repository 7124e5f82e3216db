"""Id-seeded initial weights: a row's initial values depend only on (seed, id, column).

So a row comes out the same whichever rank creates it and in whatever order, and a model's
start does not depend on the world size. The native op and this torch twin are bit-identical.
"""

from __future__ import annotations

import torch

from torchrec_kvzch.table.hashing import mix64
from torchrec_kvzch.table.native import native_status


def uniform_by_id_torch(ids: torch.Tensor, dim: int, low: float, high: float, seed: int) -> torch.Tensor:
    salt = int(mix64(torch.tensor([seed], dtype=torch.long))[0])
    row = mix64(ids.long() ^ salt)
    cols = torch.arange(dim, device=ids.device)
    h = mix64(row[:, None] + (cols >> 1))  # one hash per pair of columns
    shift = torch.where(cols & 1 == 1, 16, 40)
    bits = (h >> shift) & ((1 << 24) - 1)
    u = bits.to(torch.float32) * (1.0 / 16777216.0)
    # Two rounded float32 steps, in the same order as the C++ op (no fused multiply-add).
    scaled = u * torch.tensor(high - low, dtype=torch.float32)
    return scaled + torch.tensor(low, dtype=torch.float32)


def fill_uniform_by_id(out: torch.Tensor, ids: torch.Tensor, low: float, high: float, seed: int,
                       native: bool | None = None) -> None:
    """Fill ``out`` (``[len(ids), dim]``) with values uniform in ``[low, high)``, a pure function of
    (seed, id, column). ``native=None`` uses the C++ op for CPU tensors when it is built; it
    writes float32 rows in place, other dtypes go through one float32 temporary."""
    if native is None:
        native = out.device.type == "cpu" and native_status()
    if native and out.dtype == torch.float32 and out.is_contiguous():
        torch.ops.kvzch.uniform_by_id_(out, ids.long(), low, high, seed)
    elif native:
        tmp = torch.empty(out.shape, dtype=torch.float32)
        torch.ops.kvzch.uniform_by_id_(tmp, ids.long(), low, high, seed)
        out.copy_(tmp)
    else:
        out.copy_(uniform_by_id_torch(ids, out.shape[1], low, high, seed))
