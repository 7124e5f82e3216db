"""One served KV-ZCH table: the weights of its rows (no optimizer state) in fp32, fp16 or int8,
stored as fbgemm's inference TBE reads them, ids mapped to dense slots by the id map. A lookup
is one call of fbgemm's ``int_nbit_split_embedding_codegen_lookup_function`` over the table's
own bytes: no copy, no TBE module (whose script objects do not export).

The first ``k`` rows hold the default rows and the id in slot ``s`` lives in row ``s + k``. An
id without a row reads a default row (zeros unless declared), never another id's row, and it
counts in a MEAN bag's length as it would in training. There are several defaults when the
checkpoint's ranks each trained their own (admission's trainable default row): default ``r``
serves the absent ids from ``default_starts[r]`` on, the ids of the rank that trained it.

int8 rows are fbgemm's row-wise quantization: ``[scale fp16 | bias fp16 | D x uint8]``, a value
being ``q * scale + bias`` (``encode`` writes it with fbgemm's own quantizer, whose output has
the pair at the end of the row; the TBE reads it at the start).

On CUDA the rows, the id map and every lookup stay on the device: fbgemm's CUDA inference op
reads rows padded to 16 bytes (its ``row_alignment`` there), and ids map through the id map's
GPU kernels (``kvzch::served_rows_py``, ``table/served_rows.py``).
"""

from __future__ import annotations

import copy

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import torch
from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode

from torchrec_kvzch.table.id_map import IdMap, as_ids
from torchrec_kvzch.table.initializer import uniform_by_id_torch
from torchrec_kvzch.table.native import empty_large, native_status, regrown, release_rows
from torchrec_kvzch.table.served_rows import outside_message, served_rows_py
from torchrec_kvzch.table.tbe import WEIGHTED_MEAN_EPS

SERVED_DTYPES = {"fp32": SparseType.FP32, "fp16": SparseType.FP16, "int8": SparseType.INT8}
POOLINGS = {"sum": PoolingMode.SUM, "mean": PoolingMode.MEAN, "none": PoolingMode.NONE}
_QPARAM_BYTES = 4  # an int8 row's scale and bias, two fp16


def row_bytes(dim: int, dtype: str, alignment: int = 1) -> int:
    """Bytes of one served row, padded to ``alignment`` bytes (fbgemm's inference op reads rows
    padded to 16 on CUDA; on CPU it takes them unpadded, 1)."""
    raw = {"fp32": 4 * dim, "fp16": 2 * dim, "int8": dim + _QPARAM_BYTES}[dtype]
    return -(-raw // alignment) * alignment


def encode(weights: torch.Tensor, dtype: str) -> torch.Tensor:
    """fp32 rows ``[n, D]`` -> served rows ``[n, row_bytes]`` (uint8)."""
    weights = weights.detach().float().contiguous()
    if dtype == "fp32":
        return weights.view(torch.uint8)
    if dtype == "fp16":
        return weights.half().view(torch.uint8)
    fused = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(weights, 8)  # q | scale | bias
    return torch.cat([fused[:, -_QPARAM_BYTES:], fused[:, :-_QPARAM_BYTES]], dim=1)


def error_bound(weights: torch.Tensor, dtype: str) -> torch.Tensor:
    """Per row of fp32 ``weights``, the most any value can read back off after ``encode`` in
    ``dtype``: 0 in fp32; fp16's rounding; for int8, half a quantization step plus the fp16
    rounding of the scale (over 255 steps) and of the bias, and fp32's of the arithmetic. An fp16
    rounding is relative down to fp16's subnormals and then absolute (half their spacing,
    2^-25): a row whose values span less than about 0.015 has a subnormal scale, and one
    spanning less than 255 * 2^-25 a scale of 0, which fbgemm replaces by 1 (every value then
    reads as the bias)."""
    w = weights.detach().float()
    if dtype == "fp32":
        return torch.zeros(w.shape[0])

    def fp16_rounding(x: torch.Tensor) -> torch.Tensor:
        return torch.clamp(x.abs() * 2**-11, min=2**-25)

    if dtype == "fp16":
        return fp16_rounding(w.abs().max(1).values)
    lo, hi = w.min(1).values, w.max(1).values
    step = (hi - lo) / 255
    return step / 2 + 255 * fp16_rounding(step) + fp16_rounding(lo) + (hi.abs() + lo.abs()) * 2**-20


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

    ``default_rows``: what an id without a row reads, ``[dim]`` or ``[k, dim]`` with
    ``default_starts`` (``[k]`` ascending ids, the first ``id_range[0]``; None: one zero row).
    ``id_range``: the ids this table serves, ``[lo, hi)`` (a replica of some buckets serves
    theirs); a lookup of any other id is refused. ``initial``: ``(low, high, seed[, weight_dtype])``
    of the trained table's initializer and storage: an id without a row reads the id-seeded
    weights a row of it would start with, as training's evaluation does (``RowStore.peek``;
    rounded to fp16 where the table stored fp16 weights), instead of a default.
    ``device``: where the rows live and lookups run (CPU or CUDA); ``id_map``: the id map's
    backend (``IdMap``: ``auto`` is the native op on CPU, the GPU kernels on CUDA). Updates (``upsert``, ``delete``) change the table in place; a replica that must never show
    half an update builds the next version beside this one and swaps the reference."""

    def __init__(self, name: str, dim: int, dtype: str = "fp32", pooling: str = "sum",
                 default_rows: torch.Tensor | None = None, capacity: int = 0, *,
                 default_starts: torch.Tensor | None = None, id_range: tuple[int, int] = (0, 2**63 - 1),
                 initial: tuple | None = None, device: torch.device | str = "cpu",
                 id_map: str = "auto") -> None:
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
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        lo, hi = id_range
        if not 0 <= lo < hi:
            fail(f"id_range {id_range!r} is empty or negative; pass (lo, hi) with 0 <= lo < hi")
        self.name, self.dim, self.dtype, self.pooling = name, dim, dtype, pooling
        self.id_range = (int(lo), int(hi))
        self.device = device
        self._alignment = 16 if device.type == "cuda" else 1  # (fbgemm's: the CPU op reads rows unpadded)
        self.row_bytes = row_bytes(dim, dtype, self._alignment)
        self._raw_bytes = row_bytes(dim, dtype)  # (the rest of a row is padding)
        if default_rows is None:
            default_rows = torch.zeros(1, dim)
        default_rows = default_rows.reshape(-1, dim) if default_rows.numel() else default_rows
        starts = torch.tensor([lo]) if default_starts is None else torch.as_tensor(default_starts, dtype=torch.long)
        if tuple(default_rows.shape) != (starts.numel(), dim):
            fail(f"default rows of shape {list(default_rows.shape)} for {starts.numel()} default start(s); "
                 f"expected [{starts.numel()}, {dim}]")
        if starts[0] != lo or (starts.numel() > 1 and not bool((starts[1:] > starts[:-1]).all())):
            fail(f"default_starts {starts.tolist()} must ascend from the first id served, {lo}")
        if initial is not None and (starts.numel() != 1 or bool(default_rows.any())):
            fail("initial weights for ids without a row leave no room for default rows; give one or the other")
        if initial is not None:
            if len(initial) not in (3, 4) or tuple(initial[3:]) not in ((), ("fp32",), ("fp16",)):
                fail(f"initial {initial!r} is not (low, high, seed) or (low, high, seed, weight_dtype 'fp32' or 'fp16')")
            initial = (float(initial[0]), float(initial[1]), int(initial[2]), (*initial[3:], "fp32")[0])
        self.initial = initial
        self.default_starts = starts.to(device).contiguous()
        self.defaults = starts.numel()  # the rows before the first id's
        self._native = native_status() and device.type == "cpu"  # (the native ops run on CPU)
        self.id_map = IdMap(id_map, device)
        self.rows = self._alloc(self.defaults + max(capacity, 0), reserve=4 * (self.defaults + capacity))
        self.rows[: self.defaults] = self._encoded(default_rows.to(device))
        if capacity:
            self.id_map.reserve(capacity)
        # What the lookup op needs beside the rows (one table, in the device's memory).
        on = dict(device=device)
        self._offsets = torch.zeros(1, dtype=torch.int64, **on)
        where = EmbeddingLocation.DEVICE if device.type == "cuda" else EmbeddingLocation.HOST
        self._placements = torch.tensor([where.value], dtype=torch.int32, **on)
        self._tys = torch.tensor([SERVED_DTYPES[dtype].as_int()], dtype=torch.uint8, **on)
        self._d_offsets = torch.tensor([0, dim], dtype=torch.int32, **on)
        self._no_bytes = torch.zeros(0, dtype=torch.uint8, **on)
        self._no_cache = (torch.zeros(0, 0, dtype=torch.uint8, **on), torch.zeros(0, dtype=torch.int32, **on))

    def __len__(self) -> int:
        return len(self.id_map)

    @property
    def nbytes(self) -> int:
        """Memory held: the live rows and the default row, plus the id map."""
        return (len(self) + self.defaults) * self.row_bytes + self.id_map.nbytes

    def copy(self) -> "ServedTable":
        """An independent table of the same rows (the next version, built beside this one)."""
        out = copy.copy(self)
        out.id_map = self.id_map.copy()
        used = len(self) + self.defaults
        # A plain allocation (with room for 1/8 more rows: untouched pages cost nothing): its
        # first touch is faster than a huge-page mapping's, whose faults may wait for the
        # kernel to compact memory; a follower copies a table per version.
        out.rows = torch.empty((used + used // 8, self.row_bytes), dtype=torch.uint8, device=self.device)
        out.rows[:used].copy_(self.rows[:used])
        return out

    def _alloc(self, rows: int, reserve: int) -> torch.Tensor:
        """Room for ``rows`` rows: on CPU a mapping with address space for ``reserve`` rows
        (``regrown`` grows it in place); elsewhere ``reserve`` rows outright."""
        if self.device.type == "cpu":
            return empty_large((rows, self.row_bytes), torch.uint8, self.device, self._native, reserve=reserve)
        return torch.empty((max(rows, reserve), self.row_bytes), dtype=torch.uint8, device=self.device)

    def _encoded(self, weights: torch.Tensor) -> torch.Tensor:
        """``encode`` with each row padded to the table's row bytes."""
        rows = encode(weights, self.dtype)
        pad = self.row_bytes - rows.shape[1]
        return torch.nn.functional.pad(rows, (0, pad)) if pad else rows

    def _decoded(self, rows: torch.Tensor) -> torch.Tensor:
        return decode(rows[:, : self._raw_bytes], self.dtype)

    def default_starts_match(self, starts: torch.Tensor | None) -> bool:
        """Whether default rows serving ids from ``starts`` (None: one zero row) fit this
        table's default rows (the same id ranges: the other rows stay where they are)."""
        starts = torch.tensor([self.id_range[0]]) if starts is None else starts
        return torch.equal(starts.to(self.device), self.default_starts)

    def set_defaults(self, rows: torch.Tensor | None, starts: torch.Tensor | None) -> None:
        """Replace the default rows (``default_starts_match`` must hold)."""
        if not self.default_starts_match(starts):
            raise ValueError(f"served table '{self.name}': default rows for other id ranges than "
                             f"{self.default_starts.tolist()}; build a new table")
        self.rows[: self.defaults] = self._encoded((torch.zeros(1, self.dim) if rows is None else rows).to(self.device))

    def empty_like(self) -> "ServedTable":
        """A table of the same kind and defaults without rows."""
        return ServedTable(self.name, self.dim, self.dtype, self.pooling, self._decoded(self.rows[: self.defaults]),
                           len(self), default_starts=self.default_starts, id_range=self.id_range, initial=self.initial,
                           device=self.device, id_map=self.id_map.backend.name)

    # -- updates ------------------------------------------------------------------------------
    def upsert(self, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Set the rows of ``ids`` (distinct) to ``weights`` ``[n, dim]``, adding absent ids.
        ``weights`` may be a strided view (a checkpoint chunk's weight columns): new rows are
        written from it in one copy."""
        ids = self._checked(ids)
        weights = weights.to(self.device)
        if tuple(weights.shape) != (ids.numel(), self.dim):
            raise ValueError(f"served table '{self.name}': {ids.numel()} ids with weights of shape "
                             f"{list(weights.shape)}; expected [{ids.numel()}, {self.dim}]")
        ascending = ids.numel() < 2 or bool((ids[1:] > ids[:-1]).all())  # (a checkpoint's: no sort needed)
        if not ascending and ids.numel() != torch.unique(ids).numel():
            raise ValueError(f"served table '{self.name}': an update names an id twice; give each once")
        self._check_values(ids, weights)
        before = len(self)
        slots = self.id_map.find_or_insert(ids)
        self._room(len(self) + self.defaults)
        if len(self) - before == ids.numel():  # all new: slots before, before + 1, ... in order
            start = before + self.defaults
            self._write(self.rows[start:start + ids.numel()], weights)
        else:
            self.rows[slots + self.defaults] = self._encoded(weights)

    def _write(self, out: torch.Tensor, weights: torch.Tensor) -> None:
        """Contiguous served rows ``out`` from fp32 ``weights``, in one pass where the dtype allows."""
        raw = out[:, : self._raw_bytes]
        if self.dtype == "int8":
            raw.copy_(encode(weights, "int8"))
        else:
            raw.view(torch.float32 if self.dtype == "fp32" else torch.float16).copy_(weights)
        if self._raw_bytes < self.row_bytes:
            out[:, self._raw_bytes:].zero_()

    def _check_values(self, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Rows that would be served wrong are refused before anything changes: values that are
        not finite, or beyond fp16's range in an fp16 or int8 table (they would read as inf, or
        NaN: an int8 row keeps its bias, the row's minimum, and scale in fp16, and CUDA's int8
        kernel dequantizes in half precision)."""
        limit = float("inf") if self.dtype == "fp32" else 65504.0
        if not weights.numel():
            return
        # Fast (one pass, strided views too): a row's norm is NaN or inf where a value is, and
        # bounds every |value|; only a row it flags is looked at value by value.
        norms = torch.linalg.vector_norm(weights.detach().float(), 2, dim=1)
        if bool(norms.isfinite().all()) and (limit == float("inf") or float(norms.max()) <= limit):
            return
        weights = weights.detach().float()
        bad = torch.nonzero(~(weights.isfinite() & (weights.abs() <= limit)).all(1)).view(-1)
        if bad.numel():
            i = int(bad[0])
            problem = ("is not finite" if not bool(weights[i].isfinite().all())
                       else "exceeds fp16's range (65504)"
                       + (", which int8 rows keep their scale and bias in" if self.dtype == "int8" else "")
                       + "; serve this table as fp32")
            raise ValueError(f"served table '{self.name}': the row of id {int(ids[i])} {problem} "
                             f"({bad.numel()} such row(s) in this update); nothing was changed")

    def delete(self, ids: torch.Tensor) -> int:
        """Remove ``ids`` (absent ones are ignored): they read the default from now on.
        Returns how many were removed."""
        before = len(self)
        moves = self.id_map.erase(as_ids(ids, self.device))
        self.rows[moves.dst + self.defaults] = self.rows[moves.src + self.defaults]
        # The dead rows past the end go back to the OS (whole pages), as the training store's do.
        release_rows(self.rows, len(self) + self.defaults, before + self.defaults, self._native)
        return before - len(self)

    def _room(self, rows: int) -> None:
        if rows <= self.rows.shape[0]:
            return
        grown = regrown(self.rows, rows)
        if grown is None:  # out of reserved room: a copy, with room to grow again
            grown = self._alloc(rows, reserve=2 * rows)
            grown[: self.rows.shape[0]] = self.rows
        self.rows = grown

    # -- lookups ------------------------------------------------------------------------------
    def _checked(self, ids: torch.Tensor) -> torch.Tensor:
        ids = as_ids(ids, self.device, check=False)
        lo, hi = self.id_range
        bad = torch.nonzero((ids < lo) | (ids >= hi))
        if bad.numel():
            i = int(bad[0])
            raise ValueError(outside_message(self.name, int(ids[i]), i, lo, hi))
        return ids

    def slots(self, ids: torch.Tensor) -> torch.Tensor:
        """The row each id reads: its own, or its default, in one op that also exports (the
        native ``kvzch::served_rows`` on CPU, ``kvzch::served_rows_py`` on the other backends;
        both have fake kernels)."""
        op = torch.ops.kvzch.served_rows if self.id_map.backend.name == "native" else served_rows_py
        return op(self.id_map.table, as_ids(ids, self.device, check=False), self.default_starts, *self.id_range,
                  self.name)

    def weights(self, ids: torch.Tensor) -> torch.Tensor:
        """The fp32 values each id reads, ``[n, dim]``."""
        rows = self.slots(ids)
        out = self._decoded(self.rows[rows])
        initial = self._initial_rows(ids, rows)
        return out if initial is None else out + self._decoded(initial)

    def lookup(self, ids: torch.Tensor, offsets: torch.Tensor,
               per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Bags ``ids[offsets[b]:offsets[b+1]]`` pooled (``[B, dim]``), or, with pooling
        ``none``, one row per id (``[n, dim]``); fp32."""
        if self.pooling == "none" and per_sample_weights is not None:
            raise ValueError(f"served table '{self.name}': per-sample weights need a pooled table "
                             "(pooling sum or mean); a sequence table returns rows unweighted")
        rows = self.slots(ids)
        weights = None if per_sample_weights is None else per_sample_weights.to(self.device, torch.float32)
        offsets = offsets.to(self.device, torch.int64)
        # A weighted MEAN is row-wise sharding's, as training computed it: sum(w * row) over the
        # bag's weights (TorchRec's sum(w) + 1e-6), pooled as SUM; fbgemm's MEAN divides by L.
        by_weights = self.pooling == "mean" and weights is not None
        mode = POOLINGS["sum" if by_weights else self.pooling]
        out = self._pool(self.rows.view(-1)[: (len(self) + self.defaults) * self.row_bytes], rows, offsets, weights,
                         mode)
        initial = self._initial_rows(ids, rows)
        if initial is not None:  # the same bags over the ids' initial rows (zero where an id has a row)
            out = out + self._pool(initial.view(-1), torch.arange(rows.numel(), device=self.device), offsets,
                                   weights, mode)
        if by_weights:
            sums = torch.cat([weights.new_zeros(1, dtype=torch.float64), weights.double().cumsum(0)])
            bag = (sums[offsets[1:]] - sums[offsets[:-1]]).float() + WEIGHTED_MEAN_EPS
            out = out / torch.where(offsets[1:] > offsets[:-1], bag, 1.0).unsqueeze(1)
        return out

    def _initial_rows(self, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
        """With ``initial``: served rows ``[n, row_bytes]`` of the initial weights of the ids
        without a row (zero rows for the others); else None. (Both parts of a bag add up to
        what training's evaluation pools; a bag of one id is exact.)"""
        if self.initial is None:
            return None
        low, high, seed, stored = self.initial
        ids = ids.reshape(-1).to(self.device, torch.long)
        init = (torch.ops.kvzch.uniform_by_id(ids, self.dim, low, high, seed) if self._native  # (both export)
                else uniform_by_id_torch(ids, self.dim, low, high, seed))
        if stored == "fp16":  # (training writes a new row's weights into fp16 storage: rounded)
            init = init.half().float()
        return self._encoded(init * (rows < self.defaults).unsqueeze(1))

    def _pool(self, dev_weights: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
              weights: torch.Tensor | None, mode: PoolingMode) -> torch.Tensor:
        """fbgemm's inference op over one table of served rows ``dev_weights`` (flat bytes)."""
        d = self.dim
        return torch.ops.fbgemm.int_nbit_split_embedding_codegen_lookup_function(
            dev_weights=dev_weights, uvm_weights=self._no_bytes,
            weights_placements=self._placements, weights_offsets=self._offsets, weights_tys=self._tys,
            D_offsets=self._d_offsets, total_D=d, max_int2_D=0, max_int4_D=0,
            max_int8_D=d if self.dtype == "int8" else 0, max_float16_D=d if self.dtype == "fp16" else 0,
            max_float32_D=d if self.dtype == "fp32" else 0, indices=indices,
            offsets=offsets, pooling_mode=int(mode), indice_weights=weights,
            output_dtype=SparseType.FP32.as_int(), lxu_cache_weights=self._no_cache[0],
            lxu_cache_locations=self._no_cache[1], row_alignment=self._alignment, max_float8_D=0,
            fp8_exponent_bits=-1, fp8_exponent_bias=-1)
