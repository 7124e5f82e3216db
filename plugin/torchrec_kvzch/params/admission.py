"""Admission: which new ids of a training batch get a row (``table/admission.py`` decides).

In a click log most ids are seen once or twice; a row for each on first sight spends most of a
table's memory and checkpoint bytes on rows that never train. ``count`` admits an id once it
has been seen ``min_count`` times; ``probability`` admits each sighting with ``probability``.
Both count sightings in a count-min sketch of ``sketch_depth`` x ``sketch_width`` one-byte
counters per table shard (bounded memory whatever the id space; it may overcount, never
undercount, so a rare id can be admitted early but a frequent one is never held back; counts
stop at 255). Size it to the distinct new ids a shard sees: with ``n`` of them, an id seen once
is admitted at ``min_count`` 2 with a probability of about ``(1 - exp(-n / width)) ** depth``. Decisions depend on the
ids, the table's ``init_seed`` and the sketch only, so a run reproduces exactly.

An id not admitted yet still gets an output: ``default`` ``zeros``, or ``trainable``, one row
per table shard shared by all such ids and trained by fbgemm's fused optimizer like any row
(an "unknown id" embedding). It is never an error.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from torchrec_kvzch.params.checks import finite, member, positive_int


class AdmissionKind(str, enum.Enum):
    NONE = "none"  # every id gets a row on first sight
    COUNT = "count"  # after min_count sightings
    PROBABILITY = "probability"  # each sighting admits with the given probability


class AdmissionDefault(str, enum.Enum):
    ZEROS = "zeros"
    TRAINABLE = "trainable"


@dataclass(frozen=True)
class AdmissionPolicy:
    kind: AdmissionKind | str = AdmissionKind.NONE
    min_count: int | None = None
    probability: float | None = None
    default: AdmissionDefault | str = AdmissionDefault.ZEROS
    sketch_width: int = 2**20  # one-byte counters per sketch row, a power of two
    sketch_depth: int = 4

    def validate(self, table: str) -> "AdmissionPolicy":
        def fail(problem: str):
            raise ValueError(f"KV-ZCH table '{table}': admission.{problem}")

        kind = member(AdmissionKind, self.kind, "kind", fail)
        default = member(AdmissionDefault, self.default, "default", fail)
        if kind is AdmissionKind.COUNT and not (positive_int(self.min_count) and 2 <= self.min_count <= 255):
            fail(f"min_count must be an integer in [2, 255] with kind 'count' (1 admits every id: "
                 f"kind 'none'), got {self.min_count!r}")
        p = self.probability
        if kind is AdmissionKind.PROBABILITY and not (
                finite(p) and 0 < p < 1):
            fail(f"probability must be in (0, 1) with kind 'probability', got {p!r}")
        for name, kinds in (("min_count", (AdmissionKind.COUNT,)), ("probability", (AdmissionKind.PROBABILITY,))):
            if getattr(self, name) is not None and kind not in kinds:
                fail(f"{name} has no effect with admission.kind '{kind.value}'; drop it or choose "
                     "the kind that uses it")
        if kind is AdmissionKind.NONE:
            for f in dataclasses.fields(self):
                if f.name != "kind" and getattr(self, f.name) != f.default:
                    fail(f"{f.name} has no effect with admission.kind 'none'; drop it or choose "
                         "kind 'count' or 'probability'")
        if not (positive_int(self.sketch_width) and self.sketch_width & (self.sketch_width - 1) == 0):
            fail(f"sketch_width must be a power of two, got {self.sketch_width!r}")
        if not (positive_int(self.sketch_depth) and self.sketch_depth <= 16):
            fail(f"sketch_depth must be an integer in [1, 16], got {self.sketch_depth!r}")
        return dataclasses.replace(self, kind=kind, default=default,
                                   probability=None if p is None else float(p))

    @property
    def enabled(self) -> bool:
        return AdmissionKind(self.kind) is not AdmissionKind.NONE

    @property
    def sketch_bytes(self) -> int:
        return self.sketch_width * self.sketch_depth if self.enabled else 0
