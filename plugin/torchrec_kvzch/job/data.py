"""Click logs for the training job: a synthetic one with realistic id skew, or Criteo TSV files.

Both are indexed by the global step: batch ``step`` is the same ``global_batch_size`` examples
at every world size, and rank ``r`` of ``W`` takes the ``r``-th of ``W`` equal slices. A run
resumed at another world size therefore trains on exactly the examples it would have seen, and
its loss curve continues where the checkpoint left it. ``heldout(i)`` is batch ``i`` of a slice
that training never reads, for evaluation.
"""

from __future__ import annotations

import csv
import itertools
import math
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torchrec.datasets.criteo import CAT_FEATURE_COUNT, DEFAULT_CAT_NAMES, INT_FEATURE_COUNT, BinaryCriteoUtils
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvzch.torchrec.config import ShardingConfig
from torchrec_kvzch.table.hashing import mix64, unit_uniform  # splitmix64: a cheap, well-spread hash

DENSE_FEATURES = INT_FEATURE_COUNT  # 13, as in Criteo
_PROBE_STEP = -1  # the fixed batch that predictions are compared on
_HELDOUT_STEP = -2  # held-out batch i is step -2 - i: training steps are >= 0
CRITEO_COLUMNS = 1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT  # label, 13 integer, 26 categorical
CRITEO_HEAD_LINES = 1000  # lines of each Criteo file the job checks before it starts
SEEDS = 2**23  # a seed goes 40 bits up in each draw's int64 key (``_uniform``): 23 bits are left


def _unit(x: torch.Tensor) -> torch.Tensor:
    """A hash mapped to [-1, 1)."""
    return unit_uniform(mix64(x)).mul(2.0).sub(1.0)  # exact: powers of two


def _rank_slice(n: int, rank: int, world_size: int) -> slice:
    if n % world_size:
        raise ValueError(f"global batch size {n} is not divisible by the world size {world_size}; "
                         f"pick a multiple of {world_size}")
    per = n // world_size
    return slice(rank * per, (rank + 1) * per)


def _batch(dense: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor, features: list[str]) -> Batch:
    """One id per example and feature; ``ids`` is [features, examples]."""
    return Batch(dense_features=dense.float(),
                 sparse_features=KeyedJaggedTensor(keys=features, values=ids.reshape(-1),
                                                   lengths=torch.ones(ids.numel(), dtype=torch.int32)),
                 labels=labels.float())


def criteo_line_problem(tsv: Path, lines: int | None = None) -> str | None:
    """The first of ``tsv``'s first ``lines`` lines (None: all) that TorchRec's converter cannot
    read, named by file and line with the fix, or None. (The converter says only ``IndexError``
    or ``ValueError``, from inside a datapipe: no file, no line.)"""
    with open(tsv, newline="", errors="replace") as f:
        for number, row in enumerate(itertools.islice(csv.reader(f, delimiter="\t"), lines), start=1):
            if problem := _criteo_row_problem(row):
                return (f"{tsv}: line {number}: {problem}; a Criteo line has {CRITEO_COLUMNS} tab-separated columns "
                        f"(a label, {INT_FEATURE_COUNT} integers, {CAT_FEATURE_COUNT} hexadecimal ids, any of them "
                        "empty); fix or drop the line")
    return None


def _criteo_row_problem(row: list[str]) -> str | None:
    if len(row) != CRITEO_COLUMNS:
        return f"{len(row)} tab-separated columns"
    decimal = 1 + INT_FEATURE_COUNT  # the label and the integer features; then the hexadecimal ids
    for column, value in enumerate(row):
        try:
            int(value or "0", 10 if column < decimal else 16)
        except ValueError:
            return f"column {column + 1} holds {value!r}, not {'a number' if column < decimal else 'a hexadecimal id'}"
    return None


class SyntheticClickLog:
    """Clicks on (user, item, ...) ids drawn from a huge id space, with a signal to learn.

    Per feature, 1 - ``new_id_fraction`` of the ids follow Zipf(``zipf_alpha``) over a population
    of ``population`` ids (scattered over the table's id space by a hash); the rest are ids never
    seen before, so live rows keep growing, as in a real log. The label is drawn from
    sigmoid(sum of per-id effects + a linear function of the 13 dense features), so the loss of a
    model that learns the popular ids' embeddings falls.
    """

    def __init__(self, config: ShardingConfig, global_batch_size: int, seed: int = 0,
                 population: int = 100_000, zipf_alpha: float = 1.05, new_id_fraction: float = 0.02) -> None:
        if not 0 <= new_id_fraction < 1:
            raise ValueError(f"new_id_fraction={new_id_fraction}: must be in [0, 1)")
        if not (1 < zipf_alpha < math.inf and population >= 1):  # (NaN fails the comparison, so is refused)
            raise ValueError(f"zipf_alpha={zipf_alpha}, population={population}: need a finite alpha > 1 and "
                             "population >= 1")
        self.features = [f for t in config.tables for f in t.features]
        self.id_space = torch.tensor([t.num_embeddings for t in config.tables for _ in t.features])
        self.global_batch_size, self.seed = global_batch_size, seed
        self.population, self.alpha, self.new_id_fraction = population, zipf_alpha, new_id_fraction
        gen = torch.Generator().manual_seed(seed)
        self.dense_weights = torch.randn(DENSE_FEATURES, generator=gen, dtype=torch.float64) * 0.3
        self.id_effect = 1.5 * math.sqrt(3.0 / len(self.features))  # sum of effects has variance ~2.25

    def batch(self, step: int, rank: int = 0, world_size: int = 1) -> Batch:
        part = _rank_slice(self.global_batch_size, rank, world_size)
        return self._examples(step, torch.arange(part.start, part.stop))

    def probe(self, size: int = 256) -> Batch:
        """A fixed batch, the same on every rank, for comparing predictions across runs."""
        return self._examples(_PROBE_STEP, torch.arange(size))

    def heldout(self, index: int, rank: int = 0, world_size: int = 1) -> Batch:
        """Held-out batch ``index``: drawn like the training batches (popular ids, and ids never
        seen before), from steps that training never reaches."""
        part = _rank_slice(self.global_batch_size, rank, world_size)
        return self._examples(_HELDOUT_STEP - index, torch.arange(part.start, part.stop))

    def _uniform(self, step: int, stream: int, index: torch.Tensor) -> torch.Tensor:
        """Counter-based uniforms in [0, 1): example ``index`` of ``step`` gets the same numbers
        whichever rank draws them, so a rank computes only its own slice."""
        key = int(mix64(torch.tensor([(self.seed << 40) + ((step + 2) << 8) + stream]))[0])
        return unit_uniform(mix64(index + key))

    def _examples(self, step: int, index: torch.Tensor) -> Batch:
        nf, n = len(self.features), index.numel()
        u = torch.stack([self._uniform(step, f, index) for f in range(nf)])
        # Inverse CDF of a continuous Zipf over [1, population + 1): popular ranks near 0.
        a, p = 1.0 - self.alpha, float(self.population + 1)
        ranks = (1.0 + u * (p**a - 1.0)).pow(1.0 / a).floor().long().clamp_(1, self.population) - 1
        # Fresh ids: numbered by their position in the whole log, hence never drawn twice.
        fresh = torch.stack([self._uniform(step, 64 + f, index) for f in range(nf)]) < self.new_id_fraction
        log_position = step + 2 if step > _HELDOUT_STEP else 2**36 - step  # held-out ids: far from training's
        position = self.population + log_position * self.global_batch_size + index
        ranks = torch.where(fresh, position.expand(nf, n), ranks)
        salt = (torch.arange(nf) + 1) * -7046029254386353131  # 0x9e3779b97f4a7c15
        ids = (mix64(ranks ^ salt[:, None]) & ((1 << 62) - 1)) % self.id_space[:, None]
        # Dense features: standard normals by Box-Muller.
        u1 = torch.stack([self._uniform(step, 128 + j, index) for j in range(DENSE_FEATURES)], 1)
        u2 = torch.stack([self._uniform(step, 192 + j, index) for j in range(DENSE_FEATURES)], 1)
        dense = (-2.0 * torch.log1p(-u1)).sqrt() * torch.cos(2.0 * math.pi * u2)
        logit = self.id_effect * _unit(ids ^ 0x5DEECE66D).sum(0) + dense @ self.dense_weights - 0.5
        labels = (self._uniform(step, 255, index) < torch.sigmoid(logit)).long()
        return _batch(dense, ids, labels, self.features)


class CriteoClickLog:
    """Criteo TSV files (label, 13 integer and 26 hex categorical columns), read in file order.

    Each TSV is converted once by TorchRec's ``BinaryCriteoUtils.tsv_to_npys`` into
    ``cache_dir`` and then memory-mapped. Categorical values are the raw 32-bit hashes: a KV-ZCH
    table gives each its own row (no modulo), so the config's tables read features
    ``cat_0`` .. ``cat_25`` with ``num_embeddings`` of at least 2^32 (the shipped ``criteo`` config).
    Training reads the log in order and wraps around at its end, short of the last
    ``heldout_batches`` global batches, which are held out for evaluation.
    """

    def __init__(self, config: ShardingConfig, paths: list[str], cache_dir: str | Path,
                 global_batch_size: int, heldout_batches: int = 0) -> None:
        self.features = [f for t in config.tables for f in t.features]
        unknown = [f for f in self.features if f not in DEFAULT_CAT_NAMES]
        if unknown:
            raise ValueError(f"{config.path}: features {unknown} are not Criteo columns; Criteo data has "
                             f"cat_0 .. cat_{CAT_FEATURE_COUNT - 1} (see the shipped config: --config criteo)")
        for t in config.tables:
            if t.num_embeddings < 2**32:
                raise ValueError(f"{config.path}: table '{t.name}' has num_embeddings={t.num_embeddings}, "
                                 f"but Criteo ids are 32-bit hashes; use at least 2^32")
        missing = [p for p in paths if not Path(p).is_file()]
        if missing:
            raise FileNotFoundError(f"Criteo files not found: {missing}")
        self.columns = [DEFAULT_CAT_NAMES.index(f) for f in self.features]
        self.global_batch_size = global_batch_size
        arrays = [self._converted(Path(p), Path(cache_dir)) for p in paths]
        self.dense = np.concatenate([a[0] for a in arrays])
        self.sparse = np.concatenate([a[1] for a in arrays])
        self.labels = np.concatenate([a[2] for a in arrays]).reshape(-1)
        self.heldout_start = len(self.labels) - heldout_batches * global_batch_size
        if self.heldout_start < global_batch_size:
            raise ValueError(f"Criteo files {paths} hold {len(self.labels)} examples, fewer than one global "
                             f"batch ({global_batch_size}) for training and {heldout_batches} held out for "
                             "evaluation; add data, or lower --global-batch-size or --eval-batches")

    @staticmethod
    def _converted(tsv: Path, cache_dir: Path) -> tuple[np.ndarray, ...]:
        """The TSV as (dense, sparse, labels) arrays; rank 0 converts, the others wait."""
        stem = cache_dir / f"{tsv.stem}-{tsv.stat().st_size}"
        files = [Path(f"{stem}_{kind}.npy") for kind in ("dense", "sparse", "labels")]
        if (not dist.is_initialized() or dist.get_rank() == 0) and not all(f.is_file() for f in files):
            cache_dir.mkdir(parents=True, exist_ok=True)
            tmp = [f.with_suffix(".tmp.npy") for f in files]
            try:
                BinaryCriteoUtils.tsv_to_npys(str(tsv), *map(str, tmp))
            except (IndexError, ValueError) as e:
                raise ValueError(criteo_line_problem(tsv) or f"{tsv}: TorchRec's conversion failed ({e})") from None
            for t, f in zip(tmp, files):
                t.rename(f)  # complete files only, for a rerun after a crash
        if dist.is_initialized():
            dist.barrier()
        return tuple(np.load(f, mmap_mode="r") for f in files)

    def batch(self, step: int, rank: int = 0, world_size: int = 1) -> Batch:
        part = _rank_slice(self.global_batch_size, rank, world_size)
        rows = (step * self.global_batch_size + np.arange(part.start, part.stop)) % self.heldout_start
        return self._rows(rows)

    def heldout(self, index: int, rank: int = 0, world_size: int = 1) -> Batch:
        part = _rank_slice(self.global_batch_size, rank, world_size)
        return self._rows(self.heldout_start + index * self.global_batch_size + np.arange(part.start, part.stop))

    def probe(self, size: int = 256) -> Batch:
        return self._rows(np.arange(min(size, len(self.labels))))

    def _rows(self, rows: np.ndarray) -> Batch:
        ids = torch.from_numpy(np.ascontiguousarray(self.sparse[rows][:, self.columns].T))
        return _batch(torch.from_numpy(np.asarray(self.dense[rows])), ids,
                      torch.from_numpy(np.asarray(self.labels[rows])), self.features)
