"""Eviction: a table's ``EvictionPolicy`` and a rank's ``RankBudget`` (``table/eviction.py`` runs them)."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from torchrec_kvzch.params.checks import finite, member, positive_int


_BUDGETS = ("max_rows", "max_bytes", "table_max_rows", "table_max_bytes")


class EvictionKind(str, enum.Enum):
    NONE = "none"
    TTL = "ttl"  # drop rows not touched for more than ttl_steps steps (or ttl_minutes)
    LFU = "lfu"  # decay access counts, drop rows whose count falls below count_threshold
    LRU = "lru"  # under a budget, drop the least recently touched rows first
    L2 = "l2"  # drop rows whose weights' L2 norm is below l2_threshold
    FEATURE_SCORE = "feature_score"  # keep about keep_rows rows: those with the highest feature scores

    @property
    def has_pass(self) -> bool:
        """Whether the kind has a rule a pass runs (``lru`` only orders rows under a budget)."""
        return self not in (EvictionKind.NONE, EvictionKind.LRU)


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

    ``feature_score`` keeps a score per row, in its header's count field (a float, as upstream):
    each training lookup adds the scores of the id's occurrences - ``feature_scores[feature]``
    when given (TorchRec's automatic collection; ``default_feature_score`` for the features it
    lacks), else the batch's KJT weights, which then never scale an output. A pass drops the
    lowest scores, as fbgemm chooses them: scores fall into ``score_buckets`` buckets of
    ``score_bucket_width`` (bucket 0 holds the zeros), and the rows of the lowest buckets that
    leave at most ``keep_rows`` go (every zero-score row, when those alone are enough; a
    bucket's worth more than needed otherwise). The pass also decays every score by
    ``count_decay`` before comparing it with that cut: at every pass, or with
    ``decay_interval_minutes`` at most once in that much wall-clock time (fbgemm's
    ``interval_for_feature_statistics_decay_s``, a day under TorchRec).

    A budget (``max_rows`` and/or ``max_bytes`` per table shard) is enforced before every
    insert: the policy's least valuable rows go first (oldest timestamp for ``lru``, ``ttl`` and
    ``l2``, lowest count for ``lfu``, lowest score for ``feature_score``, then oldest). Rows of
    the batch being looked up are never evicted for it. ``table_max_rows`` /
    ``table_max_bytes`` give the budget of the whole table instead: each
    shard takes its share, in proportion to its buckets (``for_shard``), so the table's total
    holds at any world size. Given both, each shard keeps the smaller.

    Checked by ``validate(table)``, which ``KVZCHTableParams`` calls: a policy alone is a plain
    record until it is given to a table.
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
    table_max_rows: int | None = None
    table_max_bytes: int | None = None
    keep_rows: int | None = None
    feature_scores: dict[str, float] | tuple[tuple[str, float], ...] | None = None
    default_feature_score: float | None = None
    score_bucket_width: float = 0.2
    score_buckets: int = 1_000_000
    decay_interval_minutes: float | None = None

    def validate(self, table: str) -> "EvictionPolicy":
        def fail(problem: str):
            raise ValueError(f"KV-ZCH table '{table}': {problem}")

        kind = member(EvictionKind, self.kind, "eviction.kind", fail)
        trigger = member(EvictionTrigger, self.trigger, "eviction.trigger", fail)
        for name in ("ttl_steps", "count_threshold", "max_rows", "max_bytes", "interval_steps",
                     "trigger_rows", "trigger_bytes", "free_memory_bytes") + _BUDGETS[2:]:
            value = getattr(self, name)
            if value is not None and not positive_int(value):
                fail(f"eviction.{name} must be a positive integer, got {value!r}")
        for name in ("ttl_minutes", "l2_threshold"):
            value = getattr(self, name)
            if value is not None and not (finite(value) and value > 0):
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
        budget = any(getattr(self, name) is not None for name in _BUDGETS)
        if kind is EvictionKind.LRU and not budget:
            fail("eviction.kind 'lru' needs eviction.max_rows or eviction.max_bytes (per table shard), "
                 "or eviction.table_max_rows / table_max_bytes (per table), as a positive integer")
        if kind is EvictionKind.NONE and budget:
            given = ("max_rows / max_bytes" if self.max_rows or self.max_bytes
                     else "table_max_rows / table_max_bytes")
            fail(f"a budget (eviction.{given}) needs eviction.kind lru, ttl, lfu, l2 or feature_score, "
                 "which decides the rows that go first")
        need = {EvictionTrigger.ROWS: "trigger_rows", EvictionTrigger.BYTES: "trigger_bytes",
                EvictionTrigger.FREE_MEMORY: "free_memory_bytes"}
        for trig, name in need.items():
            if (trigger is trig) != (getattr(self, name) is not None):
                fail(f"eviction.{name} goes with eviction.trigger '{trig.value}' (and it needs it)")
        if trigger is not EvictionTrigger.INTERVAL and not kind.has_pass:
            fail(f"eviction.trigger '{trigger.value}' starts a pass of a ttl, lfu, l2 or feature_score policy; "
                 f"kind '{kind.value}' has none")
        if not (finite(self.count_decay) and 0.0 < self.count_decay <= 1.0):
            fail(f"eviction.count_decay must be in (0, 1], a number, got {self.count_decay!r}")
        self._unused(kind, trigger, fail)
        scores = self._scores(kind, fail)
        return dataclasses.replace(self, kind=kind, trigger=trigger, count_decay=float(self.count_decay), **scores)

    def _unused(self, kind: EvictionKind, trigger: EvictionTrigger, fail) -> None:
        """Refuse the fields set away from their defaults that the kind and trigger never read."""
        if self.count_decay != 1.0 and kind not in (EvictionKind.LFU, EvictionKind.FEATURE_SCORE):
            fail(f"eviction.count_decay has no effect with eviction.kind '{kind.value}' (it decays lfu counts "
                 "and feature scores); drop it")
        if self.interval_steps != 1 and not (kind.has_pass and trigger in (EvictionTrigger.INTERVAL,
                                                                     EvictionTrigger.FREE_MEMORY)):
            fail(f"eviction.interval_steps has no effect with eviction.kind '{kind.value}' and trigger "
                 f"'{trigger.value}' (it spaces the passes of the interval and free_memory triggers); drop it")
        if kind is not EvictionKind.FEATURE_SCORE:
            for name in ("score_bucket_width", "score_buckets", "decay_interval_minutes"):
                if getattr(self, name) != _DEFAULTS[name]:
                    fail(f"eviction.{name} has no effect with eviction.kind '{kind.value}'; drop it or "
                         "use kind 'feature_score'")
        minutes = self.decay_interval_minutes
        if minutes is not None:
            if not (finite(minutes) and minutes > 0):
                fail(f"eviction.decay_interval_minutes must be a positive number, got {minutes!r}")
            if self.count_decay == 1.0:
                fail("eviction.decay_interval_minutes spaces the decays of count_decay, which is 1.0 (none); "
                     "drop it or set count_decay below 1")

    def _scores(self, kind: EvictionKind, fail) -> dict:
        """The feature-score fields, checked (``feature_scores`` as sorted pairs)."""
        scored = kind is EvictionKind.FEATURE_SCORE
        given = [n for n in ("keep_rows", "feature_scores", "default_feature_score") if getattr(self, n) is not None]
        if not scored:
            if given:
                fail(f"eviction.{given[0]} has no effect with eviction.kind '{kind.value}'; drop it or "
                     "use kind 'feature_score'")
            return {}
        if not positive_int(self.keep_rows):
            fail(f"eviction.kind 'feature_score' needs eviction.keep_rows (the rows a pass keeps per table "
                 f"shard) as a positive integer, got {self.keep_rows!r}")
        if not positive_int(self.score_buckets) or self.score_buckets < 2:
            fail(f"eviction.score_buckets must be an integer >= 2, got {self.score_buckets!r}")
        if not finite(self.score_bucket_width) or self.score_bucket_width <= 0:
            fail(f"eviction.score_bucket_width must be a positive number, got {self.score_bucket_width!r}")
        pairs = self.feature_scores
        if pairs is not None:
            try:
                pairs = tuple(sorted(dict(pairs).items()))
            except (TypeError, ValueError):
                fail(f"eviction.feature_scores must map feature names to numbers, got {pairs!r}")
            for feature, score in pairs:
                if not isinstance(feature, str) or not finite(score) or score < 0:
                    fail(f"eviction.feature_scores maps feature names to numbers >= 0; got {feature!r}: {score!r}")
            pairs = tuple((f, float(v)) for f, v in pairs)
        default = self.default_feature_score
        if default is not None:
            if pairs is None:
                fail("eviction.default_feature_score goes with eviction.feature_scores (scores by feature); "
                     "without them the scores are the batch's KJT weights")
            if not finite(default) or default < 0:
                fail(f"eviction.default_feature_score must be a number >= 0, got {default!r}")
            default = float(default)
        return dict(feature_scores=pairs, default_feature_score=default,
                    score_bucket_width=float(self.score_bucket_width))

    def feature_score(self, feature: str, table: str) -> float:
        """The score each occurrence of ``feature`` adds (``feature_scores``, else the default)."""
        scores = dict(self.feature_scores or ())
        if feature in scores:
            return scores[feature]
        if self.default_feature_score is None:
            raise ValueError(f"KV-ZCH table '{table}': feature '{feature}' has no score in "
                             f"eviction.feature_scores {sorted(scores)} and there is no "
                             "eviction.default_feature_score; add it to one of them")
        return self.default_feature_score

    @property
    def scores_from_weights(self) -> bool:
        """Whether the table's feature scores are the batches' KJT weights."""
        return EvictionKind(self.kind) is EvictionKind.FEATURE_SCORE and self.feature_scores is None

    @property
    def enabled(self) -> bool:
        return EvictionKind(self.kind) is not EvictionKind.NONE

    @property
    def in_lookups(self) -> bool:
        """Whether training lookups may evict rows: under a budget, or by a pass on an automatic
        trigger (``manual`` passes run between steps)."""
        kind = EvictionKind(self.kind)
        budget = any(getattr(self, n) is not None for n in ("max_rows", "max_bytes", "table_max_rows", "table_max_bytes"))
        automatic = kind.has_pass and EvictionTrigger(self.trigger) is not EvictionTrigger.MANUAL
        return kind is not EvictionKind.NONE and (budget or automatic)

    def for_shard(self, start: int, end: int, total: int, table: str) -> "EvictionPolicy":
        """The policy of the shard owning buckets ``[start, end)`` of ``total``: a table budget
        becomes this shard's share, ``floor(B * end / total) - floor(B * start / total)``, so
        that the shares of all shards add up to ``B`` exactly, whatever the world size; with a
        per-shard budget too, the smaller holds. A share of no row is refused."""
        limits = {}
        for own, whole in (("max_rows", "table_max_rows"), ("max_bytes", "table_max_bytes")):
            budget = getattr(self, whole)
            if budget is None:
                continue
            share = budget * end // total - budget * start // total
            if share < 1:
                least = -(-total // (end - start))
                raise ValueError(
                    f"KV-ZCH table '{table}': eviction.{whole}={budget} leaves the shard of buckets "
                    f"[{start}, {end}) of {total} nothing (shares go by buckets); fix: set it to at "
                    f"least {least}, or give a budget per shard (eviction.{own})")
            limits[own] = share if getattr(self, own) is None else min(getattr(self, own), share)
        return dataclasses.replace(self, table_max_rows=None, table_max_bytes=None, **limits)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EvictionPolicy)}




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
            if value is not None and not positive_int(value):
                raise ValueError(f"rank budget: {name} must be a positive integer, got {value!r}")
        if self.max_rows is None and self.max_bytes is None:
            raise ValueError("rank budget: set max_rows and/or max_bytes (the limit over all "
                             "KV-ZCH table shards of a rank)")
        order = str(getattr(self.order, "value", self.order)).lower()
        if order not in (EvictionKind.LRU.value, EvictionKind.LFU.value):
            raise ValueError(f"rank budget: order {self.order!r} is unknown; use lru or lfu")
        object.__setattr__(self, "order", EvictionKind(order))
