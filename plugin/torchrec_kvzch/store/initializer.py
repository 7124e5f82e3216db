"""Id-seeded initial weights: a row's initial values depend only on (seed, id, column).

So a row comes out the same whichever rank creates it and in whatever order, and a model's
start does not depend on the world size. The native op and this torch twin are bit-identical.
"""

from __future__ import annotations

import torch

from torchrec_kvzch.store.id_map import mix64, native_status


def uniform_by_id_torch(ids: torch.Tensor, dim: int, low: float, high: float, seed: int) -> torch.Tensor:
    salt = int(mix64(torch.tensor([seed], dtype=torch.long))[0])
    row = mix64(ids.long() ^ salt)
    bits = mix64(row[:, None] + torch.arange(dim, device=ids.device)) >> 40
    bits = bits & ((1 << 24) - 1)  # the logical shift's 24 random bits
    u = bits.to(torch.float32) * (1.0 / 16777216.0)
    # Two rounded float32 steps, in the same order as the C++ op (no fused multiply-add).
    scaled = u * torch.tensor(high - low, dtype=torch.float32)
    return scaled + torch.tensor(low, dtype=torch.float32)


def uniform_by_id(
    ids: torch.Tensor, dim: int, low: float, high: float, seed: int, backend: str = "auto"
) -> torch.Tensor:
    """float32 ``[len(ids), dim]`` uniform in ``[low, high)``, a pure function of (seed, id, column)."""
    if backend != "torch" and ids.device.type == "cpu" and native_status():
        return torch.ops.kvzch.uniform_by_id(ids.long(), dim, low, high, seed)
    return uniform_by_id_torch(ids, dim, low, high, seed)
