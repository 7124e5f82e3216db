"""Admission of new ids into one table shard (``params/admission.py`` says what the policy means).

A count-min sketch counts sightings: ``depth`` rows of ``width`` uint8 counters, saturating at
255 (admission needs counts up to ``min_count`` only); an id's count is the smallest of its
``depth`` counters, one per row, picked by a salted splitmix64 hash. Updates are conservative
(only counters below the id's new count are raised), which keeps overcounts small. A batch is counted at once: each distinct new id adds its occurrences in the batch, and
counters shared by ids of the same batch take the largest new count (an order-free form of the
conservative update, so the result does not depend on how the batch is ordered).

Decisions, per distinct id of a batch that has no row yet, with ``c`` its sightings in the batch
and ``n`` its count after them:

* ``count``: admitted when ``n >= min_count``;
* ``probability``: admitted when ``u(id, step) < 1 - (1 - p)^c``, ``u`` a uniform in [0, 1)
  hashed from the id, the training step (the store's clock) and the seed: one fresh draw per
  batch standing for the batch's ``c`` sightings (not keyed on ``n``, which stops at 255).

Ids with a row are never filtered. Everything is a function of the ids seen so far, in order,
and the seed: the plain-Python model in ``tests/test_admission.py`` reproduces every decision.
"""

from __future__ import annotations

import torch

from torchrec_kvzch.params import AdmissionKind, AdmissionPolicy
from torchrec_kvzch.table.hashing import mix64, unit_uniform

COUNT_MAX = 255  # counters are uint8


class Admission:
    def __init__(self, policy: AdmissionPolicy, seed: int, device: torch.device) -> None:
        self.policy = policy
        self.kind = AdmissionKind(policy.kind)
        self.counts = torch.zeros(policy.sketch_depth, policy.sketch_width, dtype=torch.uint8, device=device)
        salts = mix64(torch.arange(policy.sketch_depth + 1, dtype=torch.long) + (int(seed) << 8))
        self._row_salts = salts[:-1].to(device).unsqueeze(1)  # [depth, 1]
        self._draw_salt = int(salts[-1])
        # distinct new ids admitted and rejected, summed over batches (a tensor: checkpoints
        # hold it, with ``counts``, as state-dict entries that are views of these)
        self.totals = torch.zeros(2, dtype=torch.long)

    @property
    def admitted(self) -> int:
        return int(self.totals[0])

    @property
    def rejected(self) -> int:
        return int(self.totals[1])

    def positions(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's counter in each sketch row, ``[depth, len(ids)]``."""
        return mix64(ids.unsqueeze(0) ^ self._row_salts) & (self.policy.sketch_width - 1)

    def estimate(self, ids: torch.Tensor) -> torch.Tensor:
        """Sightings counted for each id (never fewer than the true count)."""
        return self._counted(self.positions(ids)) if ids.numel() else ids

    def _counted(self, pos: torch.Tensor) -> torch.Tensor:
        """The count at the sketch positions ``pos`` of ids: their smallest counter."""
        return torch.gather(self.counts, 1, pos).amin(0).long()

    def admit(self, ids: torch.Tensor, has_row: torch.Tensor, step: int) -> torch.Tensor | None:
        """Count the sightings of the batch ``ids`` of training step ``step`` that have no row yet
        (``has_row`` False) and return, per position, whether the id may use a row: it has one,
        or is admitted now (None: every id may)."""
        new = ids[~has_row]
        if new.numel() == 0:
            return None
        uniq, inverse, seen = torch.unique(new, return_inverse=True, return_counts=True)
        pos = self.positions(uniq)
        after = (self._counted(pos) + seen).clamp_(max=COUNT_MAX)
        raised = after.to(torch.uint8).unsqueeze(0).expand_as(pos)
        self.counts.scatter_reduce_(1, pos, raised, reduce="amax")
        if self.kind is AdmissionKind.COUNT:
            ok = after >= self.policy.min_count
        else:
            chance = 1.0 - (1.0 - self.policy.probability) ** seen.double()
            ok = unit_uniform(mix64(mix64(uniq ^ self._draw_salt) + int(step))) < chance
        admitted = int(ok.sum())
        self.totals += torch.tensor([admitted, uniq.numel() - admitted])
        if bool(ok.all()):
            return None
        out = has_row.clone()
        out[~has_row] = ok[inverse]
        return out

    def restore(self, counts: torch.Tensor, totals: torch.Tensor) -> None:
        """Take saved state: a sketch of this geometry and the two totals."""
        if counts.shape != self.counts.shape:
            raise ValueError(f"the saved admission sketch is {list(counts.shape)}, this table's "
                             f"{list(self.counts.shape)} (sketch_depth x sketch_width): load it into "
                             "a table with the admission sketch it was saved with")
        self.counts.copy_(counts)
        self.totals.copy_(totals.reshape(2))
