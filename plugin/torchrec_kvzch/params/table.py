"""``KVZCHTableParams``, the options of one KV-ZCH table, and the bucket math of its shards."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import torch

from torchrec_kvzch.params.admission import AdmissionPolicy
from torchrec_kvzch.params.checks import RENAME_TABLE, finite, module_key_problem, pair, positive_int
from torchrec_kvzch.params.eviction import EvictionPolicy
from torchrec_kvzch.params.optimizer import OPTIMIZER_DEFAULTS, OptimizerKind, WeightDecayMode
from torchrec_kvzch.params.storage import DeviceCache, DiskStorage

_WEIGHT_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
MAX_NUM_EMBEDDINGS = 2**63 - 1  # ids are int64 in TorchRec and fbgemm


@dataclass(frozen=True)
class BucketRange:
    """The contiguous buckets ``[start, end)`` one rank owns; ``size`` ids per bucket."""

    start: int
    end: int
    size: int

    @property
    def num_buckets(self) -> int:
        return self.end - self.start

    @property
    def id_start(self) -> int:
        return self.start * self.size

    @property
    def id_end(self) -> int:
        return self.end * self.size

    def local_buckets(self, ids):
        """The bucket of each of ``ids`` (a tensor of this range's ids), 0 = this range's first."""
        return ids.div(self.size, rounding_mode="floor") - self.start


@dataclass(frozen=True)
class KVZCHTableParams:
    """Options of one KV-ZCH table. Validated on construction."""

    name: str
    embedding_dim: int
    num_embeddings: int = 2**40
    total_num_buckets: int = 1024
    # None: the sharders' fused params decide, else OPTIMIZER_DEFAULTS (exact_row_wise_adagrad, lr 0.01, ...)
    optimizer: OptimizerKind | str | None = None
    learning_rate: float | None = None
    eps: float | None = None
    stochastic_rounding: bool | None = None  # fp16 rows: round updates stochastically (fbgemm's default)
    weight_decay: float | None = None
    weight_decay_mode: WeightDecayMode | str | None = None  # none, l2 or decouple (fbgemm's modes)
    beta1: float | None = None  # Adam's moment decays (fbgemm's defaults 0.9, 0.999); Adam tables only
    beta2: float | None = None
    init_range: tuple[float, float] = (-0.01, 0.01)
    init_seed: int | None = None  # None: derived from the table name
    weight_dtype: str = "fp32"
    enable_optimizer_offloading: bool = False
    backend_return_whole_row: bool = False
    eviction: EvictionPolicy = field(default_factory=EvictionPolicy)
    admission: AdmissionPolicy = field(default_factory=AdmissionPolicy)
    storage: DiskStorage = field(default_factory=DiskStorage)  # rows beyond a DRAM cache, on disk
    device_cache: DeviceCache = field(default_factory=DeviceCache)  # on CUDA: rows in host memory, a GPU cache
    checkpoint_chunk_rows: int = 65536
    expected_rows: int = 1_000_000  # live rows over all ranks; sizes the planner's DRAM estimate
    # The optimizer fields the table does not set itself (defaults; the sharders' fused params may set them).
    defaulted: frozenset[str] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"KV-ZCH table name must be a non-empty string, got {self.name!r}")
        fail = self._fail
        if problem := module_key_problem(self.name):
            fail("name", problem, RENAME_TABLE)
        if self.defaulted is None:
            object.__setattr__(self, "defaulted", frozenset(
                name for name in OPTIMIZER_DEFAULTS if getattr(self, name) is None))
        for name, value in OPTIMIZER_DEFAULTS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        for name in ("embedding_dim", "num_embeddings", "total_num_buckets", "checkpoint_chunk_rows",
                     "expected_rows"):
            if not positive_int(getattr(self, name)):
                fail(name, f"must be a positive integer, got {getattr(self, name)!r}",
                     "pass a value >= 1")
        if self.num_embeddings > MAX_NUM_EMBEDDINGS:
            fail("num_embeddings", f"{self.num_embeddings} ids do not fit int64 (TorchRec's and fbgemm's id type)",
                 "choose at most 2^62 (a multiple of total_num_buckets)")
        if self.num_embeddings % self.total_num_buckets:
            fail("num_embeddings",
                 f"{self.num_embeddings} is not a multiple of total_num_buckets={self.total_num_buckets}",
                 "choose num_embeddings = k * total_num_buckets (e.g. a power of two for both)")
        object.__setattr__(self, "optimizer", OptimizerKind.parse(self.optimizer, self.name))
        if not isinstance(self.stochastic_rounding, bool):
            fail("stochastic_rounding", f"must be True or False, got {self.stochastic_rounding!r}",
                 "pass a bool")
        for name in ("learning_rate", "eps"):
            value = getattr(self, name)
            if not (finite(value)
                    and value > 0):
                fail(name, f"must be a positive finite number, got {value!r}", "e.g. 0.01")
        object.__setattr__(self, "weight_decay_mode", WeightDecayMode.parse(self.weight_decay_mode, self.name))
        decay = self.weight_decay
        if not (finite(decay)
                and decay >= 0):
            fail("weight_decay", f"must be a finite number >= 0, got {decay!r}", "e.g. 1e-5, or 0 for none")
        if decay and self.weight_decay_mode is WeightDecayMode.NONE:
            fail("weight_decay", f"{decay} with weight_decay_mode none would be dropped (fbgemm ignores it so)",
                 "set weight_decay_mode to l2 or decouple, or weight_decay to 0")
        for name in ("beta1", "beta2"):
            beta = getattr(self, name)
            if not (isinstance(beta, (int, float)) and not isinstance(beta, bool) and 0 <= beta < 1):
                fail(name, f"must be a number in [0, 1), got {beta!r}", "e.g. 0.9 for beta1, 0.999 for beta2")
            if name not in self.defaulted and not self.optimizer.adam:
                fail(name, f"has no effect with optimizer {self.optimizer.value} (it is Adam's moment decay)",
                     "drop it, or use optimizer adam or partial_row_wise_adam")
        for name in ("enable_optimizer_offloading", "backend_return_whole_row"):
            if not isinstance(getattr(self, name), bool):
                fail(name, f"must be True or False, got {getattr(self, name)!r}", "pass a bool")
        low, high = pair(self.init_range, "init_range", fail)
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            fail("init_range", f"must be finite (low, high) with low < high, got {self.init_range!r}",
                 "e.g. (-0.01, 0.01)")
        if self.weight_dtype not in _WEIGHT_DTYPES:
            fail("weight_dtype", f"{self.weight_dtype!r} is not supported",
                 f"use one of {', '.join(_WEIGHT_DTYPES)}")
        if self.backend_return_whole_row and not self.enable_optimizer_offloading:
            fail("backend_return_whole_row",
                 "is only valid with enable_optimizer_offloading=True (whole rows carry the "
                 "optimizer state, which must then live in the store)",
                 "set enable_optimizer_offloading=True or backend_return_whole_row=False")
        if not isinstance(self.eviction, EvictionPolicy):
            fail("eviction", f"must be an EvictionPolicy, got {type(self.eviction).__name__}",
                 "pass EvictionPolicy(...)")
        object.__setattr__(self, "eviction", self.eviction.validate(self.name))
        if not isinstance(self.admission, AdmissionPolicy):
            fail("admission", f"must be an AdmissionPolicy, got {type(self.admission).__name__}",
                 "pass AdmissionPolicy(...)")
        object.__setattr__(self, "admission", self.admission.validate(self.name))
        if not isinstance(self.storage, DiskStorage):
            fail("storage", f"must be a DiskStorage, got {type(self.storage).__name__}", "pass DiskStorage(...)")
        object.__setattr__(self, "storage", self.storage.validate(self.name))
        if self.storage.enabled and (self.name in (".", "..") or "/" in self.name or "\0" in self.name):
            fail("name", "names the disk tier's folder under storage.path, so it must be one path component "
                 "(no '/', not '.' or '..')", "rename the table")
        if not isinstance(self.device_cache, DeviceCache):
            fail("device_cache", f"must be a DeviceCache, got {type(self.device_cache).__name__}",
                 "pass DeviceCache(...)")
        object.__setattr__(self, "device_cache", self.device_cache.validate(self.name))
        if self.device_cache.enabled and self.storage.enabled:
            fail("device_cache", "and storage (a disk tier) are both set: a disk tier serves CPU stores, a "
                 "device cache CUDA ones", "keep one: device_cache on GPUs, storage on CPU ranks")
        if self.device_cache.prefetch_pipeline and self.own_update:
            fail("device_cache", f"prefetch_pipeline with an update the table runs itself ({self.optimizer.value}, "
                 f"weight decay {self.weight_decay_mode.value}, {self.weight_dtype} rows), which fbgemm's prefetch "
                 "pipeline would leave its cache lines locked for",
                 "drop prefetch_pipeline, or train with exact_sgd or exact_rowwise_adagrad (with a weight decay: fp32 "
                 "rows, mode decouple)")
        if self.device_cache.prefetch_pipeline and self.eviction.in_lookups:
            fail("device_cache", "prefetch_pipeline with eviction in the lookups (a budget, or a pass on an automatic "
                 "trigger): a prefetch looks the next batch up before this one's backward, when no row may move",
                 "drop prefetch_pipeline, or evict with trigger 'manual' (store.evictor.run_pass() between steps)")
        if self.init_seed is None:
            object.__setattr__(self, "init_seed", zlib.crc32(self.name.encode()))
        elif not (isinstance(self.init_seed, int) and not isinstance(self.init_seed, bool)
                  and -(1 << 55) <= self.init_seed < 1 << 55):
            fail("init_seed", f"must be an integer in [-2^55, 2^55) or None, got {self.init_seed!r}", "e.g. 0")

    def _fail(self, field_name: str, problem: str, fix: str):
        raise ValueError(f"KV-ZCH table '{self.name}': {field_name} {problem}; fix: {fix}")

    # -- derived ------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return _WEIGHT_DTYPES[self.weight_dtype]

    @property
    def own_update(self) -> bool:
        """Whether the table runs its update itself rather than fbgemm's TBE (``table/row_optimizers.py``):
        Adam, row-wise Adagrad with L2 decay, fp16 rows with any decay."""
        decays = self.weight_decay > 0
        return self.optimizer.adam or (decays and self.weight_dtype == "fp16") or (
            self.optimizer is OptimizerKind.EXACT_ROWWISE_ADAGRAD and decays and self.weight_decay_mode is WeightDecayMode.L2)

    @property
    def bucket_size(self) -> int:
        return self.num_embeddings // self.total_num_buckets

    def bucket_range(self, rank: int, world_size: int) -> BucketRange:
        """Buckets of ``rank``: contiguous ranges, the first ``total % world`` ranks take one more.
        Identical to TorchRec's ``_get_sharded_local_buckets_for_zero_collision``."""
        self.check_world_size(world_size)
        if not (isinstance(rank, int) and 0 <= rank < world_size):
            self._fail("rank", f"{rank!r} is outside [0, {world_size})", "pass 0 <= rank < world_size")
        base, extra = divmod(self.total_num_buckets, world_size)
        start = rank * base + min(rank, extra)
        return BucketRange(start, start + base + (rank < extra), self.bucket_size)

    def check_world_size(self, world_size: int) -> None:
        if not positive_int(world_size):
            self._fail("world_size", f"must be a positive integer, got {world_size!r}", "pass >= 1")
        if self.total_num_buckets < world_size:
            self._fail("total_num_buckets",
                       f"({self.total_num_buckets}) is smaller than the world size ({world_size}), "
                       "so some ranks would own no bucket",
                       f"use at least {world_size} buckets (a multiple of the world size is best)")

    def expected_shard_rows(self, bucket_range: BucketRange) -> int:
        """Expected live rows of one shard: ``expected_rows`` in proportion to its buckets
        (ids spread evenly over buckets), at most the shard's id range."""
        share = -(-self.expected_rows * bucket_range.num_buckets // self.total_num_buckets)
        return min(share, bucket_range.num_buckets * bucket_range.size)
