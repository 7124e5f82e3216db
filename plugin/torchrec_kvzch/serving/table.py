"""One served KV-ZCH table: the weights of its rows (no optimizer state) in fp32, fp16 or int8,
stored as fbgemm's inference TBE reads them, ids mapped to dense slots by the id map. A lookup
is one call of fbgemm's ``int_nbit_split_embedding_codegen_lookup_function`` over the table's
own bytes: no copy, no TBE module (whose script objects do not export).

Row 0 holds the default row; the id in slot ``s`` lives in row ``s + 1``. An id without a row
maps to slot -1, hence row 0: it reads the default (zeros unless declared), never another id's
row, and it counts in a MEAN bag's length as it would in training.

int8 rows are fbgemm's row-wise quantization: ``[scale fp16 | bias fp16 | D x uint8]``, a value
being ``q * scale + bias`` (``encode`` writes it with fbgemm's own quantizer, whose output has
the pair at the end of the row; the TBE reads it at the start).
"""

from __future__ import annotations

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import torch
from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode

from torchrec_kvzch.table.id_map import IdMap, as_ids
from torchrec_kvzch.table.native import empty_large, native_status, regrown

SERVED_DTYPES = {"fp32": SparseType.FP32, "fp16": SparseType.FP16, "int8": SparseType.INT8}
POOLINGS = {"sum": PoolingMode.SUM, "mean": PoolingMode.MEAN, "none": PoolingMode.NONE}
_QPARAM_BYTES = 4  # an int8 row's scale and bias, two fp16


def row_bytes(dim: int, dtype: str) -> int:
    """Bytes of one served row (fbgemm's CPU row alignment, 1)."""
    return {"fp32": 4 * dim, "fp16": 2 * dim, "int8": dim + _QPARAM_BYTES}[dtype]


def encode(weights: torch.Tensor, dtype: str) -> torch.Tensor:
    """fp32 rows ``[n, D]`` -> served rows ``[n, row_bytes]`` (uint8)."""
    weights = weights.detach().float().contiguous()
    if dtype == "fp32":
        return weights.view(torch.uint8)
    if dtype == "fp16":
        return weights.half().view(torch.uint8)
    fused = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(weights, 8)  # q | scale | bias
    return torch.cat([fused[:, -_QPARAM_BYTES:], fused[:, :-_QPARAM_BYTES]], dim=1)


def decode(rows: torch.Tensor, dtype: str) -> torch.Tensor:
    """Served rows -> the fp32 values a lookup reads from them."""
    if dtype == "fp32":
        return rows.contiguous().view(torch.float32).clone()
    if dtype == "fp16":
        return rows.contiguous().view(torch.float16).float()
    fused = torch.cat([rows[:, _QPARAM_BYTES:], rows[:, :_QPARAM_BYTES]], dim=1).contiguous()
    return torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat(fused, 8)


class ServedTable:
    """The rows of one KV-ZCH table (or of a range of its buckets) for inference.

    ``default_row``: what an id without a row reads (``[dim]``; None: zeros). Updates
    (``upsert``, ``delete``) change the table in place; a replica that must never show half an
    update builds the next version beside this one and swaps the reference."""

    def __init__(self, name: str, dim: int, dtype: str = "fp32", pooling: str = "sum",
                 default_row: torch.Tensor | None = None, capacity: int = 0) -> None:
        def fail(problem: str) -> None:
            raise ValueError(f"served table '{name}': {problem}")

        if dtype not in SERVED_DTYPES:
            fail(f"dtype {dtype!r} is not served; use one of {', '.join(SERVED_DTYPES)}")
        if pooling not in POOLINGS:
            fail(f"pooling {pooling!r} is unknown; use one of {', '.join(POOLINGS)}")
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
            fail(f"embedding_dim must be a positive integer, got {dim!r}")
        if dtype == "int8" and dim % 2:
            fail(f"embedding_dim {dim} is odd: int8 rows keep their fp16 scale and bias aligned, "
                 "which needs an even dim; serve this table as fp16 or fp32")
        self.name, self.dim, self.dtype, self.pooling = name, dim, dtype, pooling
        self.row_bytes = row_bytes(dim, dtype)
        self._native = native_status()
        self.id_map = IdMap()
        self.rows = empty_large((1 + max(capacity, 0), self.row_bytes), torch.uint8, torch.device("cpu"),
                                self._native, reserve=4 * (1 + capacity))
        self.set_default(default_row)
        if capacity:
            self.id_map.reserve(capacity)
        # What the lookup op needs beside the rows (one table, on the host).
        self._offsets = torch.zeros(1, dtype=torch.int64)
        self._placements = torch.tensor([EmbeddingLocation.HOST.value], dtype=torch.int32)
        self._tys = torch.tensor([SERVED_DTYPES[dtype].as_int()], dtype=torch.uint8)
        self._d_offsets = torch.tensor([0, dim], dtype=torch.int32)
        self._no_bytes = torch.zeros(0, dtype=torch.uint8)
        self._no_cache = (torch.zeros(0, 0, dtype=torch.uint8), torch.zeros(0, dtype=torch.int32))

    def __len__(self) -> int:
        return len(self.id_map)

    @property
    def nbytes(self) -> int:
        """Memory held: the live rows and the default row, plus the id map."""
        return (len(self) + 1) * self.row_bytes + self.id_map.nbytes

    # -- updates ------------------------------------------------------------------------------
    def set_default(self, row: torch.Tensor | None) -> None:
        if row is None:
            row = torch.zeros(self.dim)
        if tuple(row.shape) != (self.dim,):
            raise ValueError(f"served table '{self.name}': default row of shape {list(row.shape)}, "
                             f"expected [{self.dim}]")
        self.rows[0] = encode(row.view(1, -1), self.dtype)[0]

    def upsert(self, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Set the rows of ``ids`` (distinct) to ``weights`` ``[n, dim]``, adding absent ids."""
        ids = as_ids(ids, torch.device("cpu"))
        if tuple(weights.shape) != (ids.numel(), self.dim):
            raise ValueError(f"served table '{self.name}': {ids.numel()} ids with weights of shape "
                             f"{list(weights.shape)}; expected [{ids.numel()}, {self.dim}]")
        if ids.numel() != torch.unique(ids).numel():
            raise ValueError(f"served table '{self.name}': an update names an id twice; give each once")
        encoded = encode(weights, self.dtype)  # (before anything changes: a bad row raises here)
        slots = self.id_map.find_or_insert(ids)
        self._room(len(self) + 1)
        self.rows[slots + 1] = encoded

    def delete(self, ids: torch.Tensor) -> int:
        """Remove ``ids`` (absent ones are ignored): they read the default from now on.
        Returns how many were removed."""
        before = len(self)
        moves = self.id_map.erase(ids)
        self.rows[moves.dst + 1] = self.rows[moves.src + 1]
        return before - len(self)

    def _room(self, rows: int) -> None:
        if rows <= self.rows.shape[0]:
            return
        grown = regrown(self.rows, rows)
        if grown is None:  # out of reserved address space: a copy, with room to grow again
            grown = empty_large((rows, self.row_bytes), torch.uint8, torch.device("cpu"), self._native,
                                reserve=2 * rows)
            grown[: self.rows.shape[0]] = self.rows
        self.rows = grown

    # -- lookups ------------------------------------------------------------------------------
    def slots(self, ids: torch.Tensor) -> torch.Tensor:
        """The row each id reads: its own, or 0 (the default). With the native op, one pass
        (``kvzch::served_rows``, which also exports: it has a Meta kernel)."""
        ids = as_ids(ids, torch.device("cpu"))
        if self.id_map.backend.name == "native":
            return torch.ops.kvzch.served_rows(self.id_map.table, ids)
        return self.id_map.find(ids) + 1

    def weights(self, ids: torch.Tensor) -> torch.Tensor:
        """The fp32 values each id reads, ``[n, dim]``."""
        return decode(self.rows[self.slots(ids)], self.dtype)

    def lookup(self, ids: torch.Tensor, offsets: torch.Tensor,
               per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Bags ``ids[offsets[b]:offsets[b+1]]`` pooled (``[B, dim]``), or, with pooling
        ``none``, one row per id (``[n, dim]``); fp32."""
        if self.pooling == "none" and per_sample_weights is not None:
            raise ValueError(f"served table '{self.name}': per-sample weights need a pooled table "
                             "(pooling sum or mean); a sequence table returns rows unweighted")
        d = self.dim
        return torch.ops.fbgemm.int_nbit_split_embedding_codegen_lookup_function(
            dev_weights=self.rows.view(-1)[: (len(self) + 1) * self.row_bytes], uvm_weights=self._no_bytes,
            weights_placements=self._placements, weights_offsets=self._offsets, weights_tys=self._tys,
            D_offsets=self._d_offsets, total_D=d, max_int2_D=0, max_int4_D=0,
            max_int8_D=d if self.dtype == "int8" else 0, max_float16_D=d if self.dtype == "fp16" else 0,
            max_float32_D=d if self.dtype == "fp32" else 0, indices=self.slots(ids),
            offsets=offsets.to(torch.int64), pooling_mode=int(POOLINGS[self.pooling]),
            indice_weights=None if per_sample_weights is None else per_sample_weights.float(),
            output_dtype=SparseType.FP32.as_int(), lxu_cache_weights=self._no_cache[0],
            lxu_cache_locations=self._no_cache[1], row_alignment=1, max_float8_D=0,
            fp8_exponent_bits=-1, fp8_exponent_bias=-1)
