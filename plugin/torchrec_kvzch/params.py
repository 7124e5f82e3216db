"""The KV-ZCH parameter set: per-table options, their validation, and the bucket math.

Every check raises ``ValueError`` naming the table, the field and the fix (fbgemm's own
``KVZCHParams.validate`` uses ``assert``, which ``python -O`` strips). TorchRec's own KV-ZCH
declarations become these parameters in ``torchrec/declarations.py``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import zlib
from dataclasses import dataclass, field

import torch

_WEIGHT_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


class OptimizerKind(str, enum.Enum):
    """The fused optimizers of KV-ZCH tables; values are fbgemm's ``EmbOptimType`` names.

    Both keep their state in the store's rows and bind to fbgemm's TBE in place. Adam cannot:
    fbgemm has no CPU Adam, and its CUDA Adam wants the two moments as two flat tensors, where a
    row keeps them side by side; ``parse`` refuses it (and every other fbgemm optimizer) with
    that reason rather than accept a table no kernel can train."""

    EXACT_ROWWISE_ADAGRAD = "exact_row_wise_adagrad"
    EXACT_SGD = "exact_sgd"

    @classmethod
    def parse(cls, value: "OptimizerKind | str", table: str = "?") -> "OptimizerKind":
        if isinstance(value, cls):
            return value
        key = str(value).strip().lower()
        for kind in cls:
            if key in (kind.value, kind.name.lower()):
                return kind
        raise ValueError(f"KV-ZCH table '{table}': optimizer {cls.refusal(value)}")

    @classmethod
    def refusal(cls, value) -> str:
        """Why ``value`` is not an optimizer of KV-ZCH tables, and what to use instead."""
        why = (" (fbgemm has no CPU Adam, and its CUDA Adam needs the two moments apart, which "
               "the row store keeps together in each row)" if "adam" in str(value).lower() else "")
        return f"{value!r} is not supported{why}; use one of {', '.join(k.name.lower() for k in cls)}"

    def state_floats(self, embedding_dim: int) -> int:
        """fp32 optimizer values kept per row (rowwise Adagrad: one accumulator; SGD: none)."""
        return {OptimizerKind.EXACT_ROWWISE_ADAGRAD: 1, OptimizerKind.EXACT_SGD: 0}[self]

    def to_fbgemm(self):
        from fbgemm_gpu.split_embedding_configs import EmbOptimType

        return EmbOptimType(self.value)


class EvictionKind(str, enum.Enum):
    NONE = "none"
    TTL = "ttl"  # drop rows not touched for more than ttl_steps steps (or ttl_minutes)
    LFU = "lfu"  # decay access counts, drop rows whose count falls below count_threshold
    LRU = "lru"  # under a budget, drop the least recently touched rows first
    L2 = "l2"  # drop rows whose weights' L2 norm is below l2_threshold


class EvictionTrigger(str, enum.Enum):
    """When a ``ttl`` / ``lfu`` / ``l2`` pass runs (fbgemm's trigger modes, by name)."""

    INTERVAL = "interval"  # every interval_steps training steps
    ROWS = "rows"  # when the shard holds more than trigger_rows rows
    BYTES = "bytes"  # when the shard's memory passes trigger_bytes
    FREE_MEMORY = "free_memory"  # when the host's available memory falls below free_memory_bytes
    MANUAL = "manual"  # only when asked: ``store.evictor.run_pass()``


@dataclass(frozen=True)
class EvictionPolicy:
    """When rows leave a table shard. Timestamps (training steps) and access counts live in each
    row's metaheader.

    A pass of ``ttl``, ``lfu`` or ``l2`` drops the rows its rule condemns: ``ttl`` rows not
    touched for more than ``ttl_steps`` steps, or ``ttl_minutes`` of wall-clock time; ``lfu``
    first decays every access count (``count := floor(count * count_decay)``), then drops rows
    whose count is below ``count_threshold`` (and, with a TTL, only those also past it, as
    fbgemm's count-and-timestamp strategy); ``l2`` rows whose weights' L2 norm is below
    ``l2_threshold``. ``trigger`` says when a pass runs: every ``interval_steps`` steps (the
    default), past ``trigger_rows`` rows or ``trigger_bytes`` bytes in the shard, below
    ``free_memory_bytes`` of available host memory (checked every ``interval_steps``), or on
    request only (``manual``).

    A budget (``max_rows`` and/or ``max_bytes`` per table shard) is enforced before every
    insert: the policy's least valuable rows go first (oldest timestamp for ``lru``, ``ttl`` and
    ``l2``, lowest count for ``lfu``). Rows of the batch being looked up are never evicted for it.
    """

    kind: EvictionKind | str = EvictionKind.NONE
    ttl_steps: int | None = None
    count_threshold: int | None = None
    count_decay: float = 1.0
    max_rows: int | None = None
    max_bytes: int | None = None
    interval_steps: int = 1
    ttl_minutes: float | None = None
    l2_threshold: float | None = None
    trigger: EvictionTrigger | str = EvictionTrigger.INTERVAL
    trigger_rows: int | None = None
    trigger_bytes: int | None = None
    free_memory_bytes: int | None = None

    def validate(self, table: str) -> "EvictionPolicy":
        def fail(problem: str):
            raise ValueError(f"KV-ZCH table '{table}': {problem}")

        try:
            kind = EvictionKind(str(getattr(self.kind, "value", self.kind)).lower())
        except ValueError:
            fail(f"eviction.kind {self.kind!r} is unknown; use one of {', '.join(k.value for k in EvictionKind)}")
        try:
            trigger = EvictionTrigger(str(getattr(self.trigger, "value", self.trigger)).lower())
        except ValueError:
            fail(f"eviction.trigger {self.trigger!r} is unknown; use one of "
                 f"{', '.join(t.value for t in EvictionTrigger)}")
        for name in ("ttl_steps", "count_threshold", "max_rows", "max_bytes", "interval_steps",
                     "trigger_rows", "trigger_bytes", "free_memory_bytes"):
            value = getattr(self, name)
            if value is not None and not _positive_int(value):
                fail(f"eviction.{name} must be a positive integer, got {value!r}")
        for name in ("ttl_minutes", "l2_threshold"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                          and math.isfinite(value) and value > 0):
                fail(f"eviction.{name} must be a positive number, got {value!r}")
        if self.ttl_steps is not None and self.ttl_minutes is not None:
            fail("eviction.ttl_steps and eviction.ttl_minutes are two TTLs; give one")
        has_ttl = self.ttl_steps is not None or self.ttl_minutes is not None
        if kind is EvictionKind.TTL and not has_ttl:
            fail("eviction.kind 'ttl' needs eviction.ttl_steps (training steps) or "
                 "eviction.ttl_minutes (wall-clock time)")
        if kind is EvictionKind.LFU and self.count_threshold is None:
            fail("eviction.kind 'lfu' needs eviction.count_threshold as a positive integer, got None")
        if kind is EvictionKind.L2 and self.l2_threshold is None:
            fail("eviction.kind 'l2' needs eviction.l2_threshold as a positive number, got None")
        own = {EvictionKind.TTL: ("ttl_steps", "ttl_minutes"), EvictionKind.LFU: ("count_threshold",
               "ttl_steps", "ttl_minutes"), EvictionKind.L2: ("l2_threshold",)}.get(kind, ())
        for name in ("ttl_steps", "ttl_minutes", "count_threshold", "l2_threshold"):
            if getattr(self, name) is not None and name not in own:
                fail(f"eviction.{name} has no effect with eviction.kind '{kind.value}'; drop it or "
                     "choose the kind that uses it")
        budget = self.max_rows is not None or self.max_bytes is not None
        if kind is EvictionKind.LRU and not budget:
            fail("eviction.kind 'lru' needs eviction.max_rows or eviction.max_bytes as a positive integer")
        if kind is EvictionKind.NONE and budget:
            fail("a budget (eviction.max_rows / max_bytes) needs eviction.kind lru, ttl, lfu or l2, "
                 "which decides the rows that go first")
        need = {EvictionTrigger.ROWS: "trigger_rows", EvictionTrigger.BYTES: "trigger_bytes",
                EvictionTrigger.FREE_MEMORY: "free_memory_bytes"}
        for trig, name in need.items():
            if (trigger is trig) != (getattr(self, name) is not None):
                fail(f"eviction.{name} goes with eviction.trigger '{trig.value}' (and it needs it)")
        if trigger is not EvictionTrigger.INTERVAL and kind in (EvictionKind.NONE, EvictionKind.LRU):
            fail(f"eviction.trigger '{trigger.value}' starts a pass of a ttl, lfu or l2 policy; "
                 f"kind '{kind.value}' has none")
        if not 0.0 < float(self.count_decay) <= 1.0:
            fail(f"eviction.count_decay must be in (0, 1], got {self.count_decay!r}")
        return dataclasses.replace(self, kind=kind, trigger=trigger, count_decay=float(self.count_decay))

    @property
    def enabled(self) -> bool:
        return EvictionKind(self.kind) is not EvictionKind.NONE


@dataclass(frozen=True)
class RankBudget:
    """A memory budget shared by every KV-ZCH table shard of a rank (``max_rows`` and/or
    ``max_bytes`` over all of them). When a batch's new rows would take the rank past it, the
    least valuable rows of any table go first, by ``order``: ``lru`` (oldest timestamp) or
    ``lfu`` (lowest count, then oldest). Each table's own ``EvictionPolicy`` still applies.
    """

    max_rows: int | None = None
    max_bytes: int | None = None
    order: EvictionKind | str = EvictionKind.LRU

    def __post_init__(self) -> None:
        for name in ("max_rows", "max_bytes"):
            value = getattr(self, name)
            if value is not None and not _positive_int(value):
                raise ValueError(f"rank budget: {name} must be a positive integer, got {value!r}")
        if self.max_rows is None and self.max_bytes is None:
            raise ValueError("rank budget: set max_rows and/or max_bytes (the limit over all "
                             "KV-ZCH table shards of a rank)")
        order = str(getattr(self.order, "value", self.order)).lower()
        if order not in (EvictionKind.LRU.value, EvictionKind.LFU.value):
            raise ValueError(f"rank budget: order {self.order!r} is unknown; use lru or lfu")
        object.__setattr__(self, "order", EvictionKind(order))


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


OPTIMIZER_DEFAULTS = {"optimizer": OptimizerKind.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.01,
                      "eps": 1e-8, "stochastic_rounding": True}


@dataclass(frozen=True)
class KVZCHTableParams:
    """Options of one KV-ZCH table. Validated on construction."""

    name: str
    embedding_dim: int
    num_embeddings: int = 2**40
    total_num_buckets: int = 1024
    # None: the sharders' fused params decide, else exact_row_wise_adagrad, 0.01, 1e-8, True
    optimizer: OptimizerKind | str | None = None
    learning_rate: float | None = None
    eps: float | None = None
    stochastic_rounding: bool | None = None  # fp16 rows: round updates stochastically (fbgemm's default)
    init_range: tuple[float, float] = (-0.01, 0.01)
    init_seed: int | None = None  # None: derived from the table name
    weight_dtype: str = "fp32"
    enable_optimizer_offloading: bool = False
    backend_return_whole_row: bool = False
    eviction: EvictionPolicy = field(default_factory=EvictionPolicy)
    checkpoint_chunk_rows: int = 65536
    expected_rows: int = 1_000_000  # live rows over all ranks; sizes the planner's DRAM estimate
    # The optimizer fields left unset (filled with defaults): the sharders' fused params may set them.
    defaulted: frozenset[str] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"KV-ZCH table name must be a non-empty string, got {self.name!r}")
        fail = self._fail
        if self.defaulted is None:
            object.__setattr__(self, "defaulted", frozenset(
                name for name in OPTIMIZER_DEFAULTS if getattr(self, name) is None))
        for name, value in OPTIMIZER_DEFAULTS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        for name in ("embedding_dim", "num_embeddings", "total_num_buckets", "checkpoint_chunk_rows",
                     "expected_rows"):
            if not _positive_int(getattr(self, name)):
                fail(name, f"must be a positive integer, got {getattr(self, name)!r}",
                     "pass a value >= 1")
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
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                fail(name, f"must be a positive finite number, got {value!r}", "e.g. 0.01")
        low, high = _pair(self.init_range, "init_range", fail)
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
        if self.init_seed is None:
            object.__setattr__(self, "init_seed", zlib.crc32(self.name.encode()))
        elif not isinstance(self.init_seed, int):
            fail("init_seed", f"must be an integer or None, got {self.init_seed!r}", "e.g. 0")

    def _fail(self, field_name: str, problem: str, fix: str):
        raise ValueError(f"KV-ZCH table '{self.name}': {field_name} {problem}; fix: {fix}")

    # -- derived ------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return _WEIGHT_DTYPES[self.weight_dtype]

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
        if not _positive_int(world_size):
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


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _pair(value, name, fail) -> tuple[float, float]:
    try:
        a, b = (float(v) for v in value)
    except (TypeError, ValueError):
        fail(name, f"must be a pair of numbers, got {value!r}", "e.g. (low, high)")
    return a, b
