"""Checkpoints that are either complete or absent: a folder per step, committed by a rename.

Every rank writes into ``<root>/step-<N>.partial``; once DCP has finished the save (every rank's
data and the coordinator's ``.metadata`` are on disk), rank 0 renames the folder to
``<root>/step-<N>``. A rename within a filesystem is atomic, so a save killed at any moment
leaves at most a ``.partial`` folder, which ``latest()`` never returns and the next save of that
step replaces. Older complete checkpoints beyond ``keep`` are removed after each commit
(never one that a kept delta's chain needs).

Incremental checkpoints (``full_every`` > 1, or ``save(incremental=True)``): a delta holds only
the rows changed since the checkpoint before it and the ids deleted since (``torchrec/delta.py``),
so checkpoints form chains, each delta naming its base's step and unique id. ``load`` checks
every link of a chain (complete, the base it names, every checksum) before it changes anything,
then loads the full one and applies the deltas in order. ``keep`` counts restorable checkpoints:
the links their chains need are kept too.

The folder must be on a filesystem all ranks share (one machine, or a shared mount). DCP
reports a rank's failure as ``CheckpointException``, a ``BaseException`` that ``except
Exception`` misses and whose text starts with a traceback; the manager raises
``CheckpointError`` instead, an ``Exception`` whose first line is the first failing rank's own
message.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import threading
import time
import traceback
import warnings
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from torchrec_kvzch.checkpoint.load_planner import KVZCHLoadPlanner
from torchrec_kvzch.checkpoint.record import chain_link
from torchrec_kvzch.checkpoint.save_planner import KVZCHSavePlanner
from torchrec_kvzch.checkpoint.staging import KVZCHAsyncStager
from torchrec_kvzch.checkpoint.writer import KVZCHFileSystemWriter
from torchrec_kvzch.torchrec.delta import delta_state, table_snapshots

logger = logging.getLogger(__name__)
_STEP = re.compile(r"^step-(\d+)$")


class CheckpointError(Exception):
    """A save or load that failed on some ranks. The message starts with the first failing
    rank's own message; ``failures`` maps each failing rank to its exception."""

    def __init__(self, action: str, path: Path, failures: dict[int, BaseException]) -> None:
        first = min(failures)
        lines = [_text(failures[first]), f"({action} of {path} failed on rank {first}"
                 + (f"; also on ranks {sorted(set(failures) - {first})}" if len(failures) > 1 else "") + ")"]
        lines += [f"rank {r}: {_text(e)}" for r, e in sorted(failures.items())
                  if r != first and _text(e) != lines[0]]
        super().__init__("\n".join(lines))
        self.failures = failures

    @classmethod
    def of(cls, e: CheckpointException, action: str, path: Path) -> "CheckpointError":
        return cls(action, path, {rank: exc for rank, (exc, _) in e.failures.items()})


def _text(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()


@dataclass(frozen=True)
class _Base:
    """The checkpoint the next delta would build on: its step, the deltas between it and its
    full checkpoint, and each table store's mark at the moment it holds."""

    step: int
    depth: int
    marks: dict  # RowStore -> ChangeMark


class CheckpointManager:
    def __init__(self, root: str | os.PathLike, keep: int = 2, writer_threads: int = 2,
                 process_group: dist.ProcessGroup | None = None, full_every: int = 1) -> None:
        """``keep``: restorable checkpoints to keep (>= 1), with the links their chains need.
        ``process_group``: the group saves and loads run their collectives on; give async
        saves a gloo group of their own. ``full_every``: save every ``full_every``-th
        checkpoint in full and the ones between as deltas (1: every one in full)."""
        if keep < 1:
            raise ValueError(f"CheckpointManager: keep={keep}; keep at least 1 checkpoint")
        if full_every < 1:
            raise ValueError(f"CheckpointManager: full_every={full_every}; use 1 (every checkpoint "
                             "in full) or more (deltas between full checkpoints)")
        self.root = Path(root)
        self.keep, self.writer_threads, self.process_group = keep, writer_threads, process_group
        self.full_every = full_every
        self._stager: KVZCHAsyncStager | None = None
        self._pending: tuple[Future, int, _Base | None] | None = None
        self._commit_lock = threading.Lock()
        self._base: _Base | None = None  # the last checkpoint saved or loaded here
        self._tracking = full_every > 1  # deletes logged for deltas (on once one is asked for)
        self._links: dict[int, tuple] = {}  # step -> (.metadata's stat, (uid, base)), read once

    # -- finding checkpoints ------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, ascending."""
        if not self.root.is_dir():
            return []
        found = (_STEP.match(p.name) for p in self.root.iterdir() if (p / ".metadata").is_file())
        return sorted(int(m.group(1)) for m in found if m)

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def path(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    def retire_after(self, step: int) -> tuple[list[int], Path | None]:
        """Move the complete checkpoints after ``step`` into a ``retired-*`` folder of the root,
        for a run that starts at ``step`` below them (a fresh start, or a resume from an older
        one): they are another run's, which ``latest()`` would otherwise resume and ``keep``
        count. Moved, not deleted. Returns (their steps, the folder). Collective."""
        later = [s for s in self.steps() if s > step]
        aside = None
        if later and _rank() == 0:
            aside = Path(tempfile.mkdtemp(prefix=time.strftime("retired-%Y%m%d-%H%M%S-"), dir=self.root))
            for s in later:
                os.rename(self.path(s), aside / self.path(s).name)
        self._barrier()
        return later, aside

    def chain(self, step: int) -> list[int]:
        """The steps whose checkpoints restore ``step``: its full checkpoint first, ``step``
        last (just ``[step]`` for a full one). Refused, naming the link, when a base is missing
        or was saved again after the delta that names it."""
        chain, problem = self._walk(step)
        if problem is not None:
            restorable = [s for s in self.steps() if self._walk(s)[1] is None]
            raise (FileNotFoundError if "missing" in problem else ValueError)(
                f"{problem}, so step {step} cannot be restored; restorable checkpoints under "
                f"{self.root}: {restorable}")
        return chain

    def _walk(self, step: int) -> tuple[list[int], str | None]:
        """(the chain of ``step``, newest first, as far as it goes; what breaks it, or None)."""
        out, base = [step], self._link(step)[1]
        while base is not None:
            child, step = step, int(base["step"])
            if step in out or not (self.path(step) / ".metadata").is_file():
                return out, (f"{self.path(child)} is a delta of step {step}, whose checkpoint "
                             f"{self.path(step)} is missing or incomplete")
            uid, next_base = self._link(step)
            if uid != base["uid"]:
                return out, (f"{self.path(child)} is a delta of step {step}, but {self.path(step)} "
                             f"was saved again after it (checkpoint id {uid}; the delta's base "
                             f"was {base['uid']})")
            out.append(step)
            base = next_base
        return out[::-1], None

    def _link(self, step: int) -> tuple[str | None, dict | None]:
        """(uid, base) of a complete checkpoint, from its ``.metadata``."""
        meta = self.path(step) / ".metadata"
        stat = meta.stat()
        key = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        if self._links.get(step, (None,))[0] != key:
            try:
                link = chain_link(FileSystemReader(self.path(step)).read_metadata().planner_data)
            except Exception as e:
                raise ValueError(f"{meta} cannot be read ({type(e).__name__}: {e}); restore the "
                                 "file or load another checkpoint") from e
            self._links[step] = (key, link)
        return self._links[step][1]

    # -- saving -------------------------------------------------------------------------------
    def save(self, state: dict, step: int, asynchronous: bool = False,
             incremental: bool | None = None) -> Future | None:
        """Save ``state`` (e.g. ``{"model": model.state_dict(), "optim": ...}``) as ``step``.
        Asynchronous: returns once the state is staged; the checkpoint is committed when the
        returned future completes (``wait()`` before the next save). ``incremental``: save a
        delta of the last checkpoint saved or loaded here (True) or in full (False); default,
        as ``full_every`` says. A delta that cannot be saved (no such checkpoint, or a table
        changed in ways deltas cannot tell: a load or write from outside training, a delete
        before deletes were logged - from the first save with deltas on) is saved in full,
        with a warning. Collective."""
        self.wait()
        snapshots = table_snapshots(state)
        base = self._base
        self._tracking |= bool(incremental) or self.full_every > 1
        if self._tracking:  # deletes are logged from now on, those before the base dropped
            for store in snapshots:
                store.changes.start()
                if base is not None and store in base.marks:
                    store.changes.forget_before(base.marks[store])
        if incremental is None:
            incremental = base is not None and base.depth + 1 < self.full_every
        to_save, link, depth = state, None, 0
        if incremental:
            usable = (base is not None and base.step != step and (self.path(base.step) / ".metadata").is_file())
            delta, decays, why = delta_state(state, base.marks if usable else None, self.process_group)
            if delta is None and not usable:  # (the first save of a run, or a base gone)
                logger.info("step %d is saved in full: no checkpoint saved or loaded here to build on", step)
            elif delta is None:
                logger.warning("step %d is saved in full, not as a delta: %s", step, why)
            else:
                to_save, depth = delta, base.depth + 1
                link = {"step": base.step, "uid": self._link(base.step)[0], "decays": decays}
        marks = {store: snap.mark for store, snap in snapshots.items()}
        new_base = _Base(step, depth, marks)
        partial = self.path(step).with_suffix(".partial")
        if _rank() == 0 and partial.exists():
            shutil.rmtree(partial)  # an earlier attempt at this step that died
        self._barrier()
        writer = KVZCHFileSystemWriter(partial, thread_count=self.writer_threads)
        if not asynchronous:
            with _surfaced("save", partial):
                dcp.save(to_save, storage_writer=writer, planner=KVZCHSavePlanner(base=link),
                         process_group=self.process_group)
            self._commit(step, new_base)
            self._barrier()
            return None
        self._stager = self._stager or KVZCHAsyncStager()
        with _surfaced("save", partial):
            future = dcp.async_save(to_save, storage_writer=writer, planner=KVZCHSavePlanner(base=link),
                                    async_stager=self._stager, process_group=self.process_group)
        # DCP's future completes on each rank after the coordinator wrote the metadata: commit
        # then, without waiting for the trainer to ask.
        future.add_done_callback(lambda f: f.exception() is None and self._commit(step, new_base))
        self._pending = (future, step, new_base)
        return future

    def wait(self) -> None:
        """Block until a pending async save is committed on every rank (re-raises its error).
        Collective when a save is pending."""
        if self._pending is not None:
            (future, step, new_base), self._pending = self._pending, None
            with _surfaced("save", self.path(step).with_suffix(".partial")):
                future.result()
            self._commit(step, new_base)  # a no-op when the callback already did it
            self._barrier()  # rank 0's rename and pruning are done: every rank sees them

    def close(self) -> None:
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _commit(self, step: int, base: _Base | None) -> None:
        """Rank 0 renames the finished folder into place (once) and prunes old checkpoints;
        every rank builds its next delta on this one."""
        partial, final = self.path(step).with_suffix(".partial"), self.path(step)
        with self._commit_lock:
            self._base = base
            if _rank() != 0 or not partial.exists():
                return
            replaced = final.with_suffix(".replaced")
            if final.exists():  # the same step saved again: the new one wins, the old aside until then
                shutil.rmtree(replaced, ignore_errors=True)
                os.rename(final, replaced)
            os.rename(partial, final)
            shutil.rmtree(replaced, ignore_errors=True)
            steps = self.steps()
            needed = set()
            for kept in steps[-self.keep:] + [step]:  # (never the one just committed)
                needed.update(self._walk(kept)[0])  # (of a broken chain, what is left)
            for old in steps:
                if old not in needed:
                    shutil.rmtree(self.path(old), ignore_errors=True)

    # -- loading ------------------------------------------------------------------------------
    def load(self, state: dict, step: int | None = None, *, verify: bool = True,
             load_optimizer: bool = True) -> int | None:
        """Load the checkpoint of ``step`` (default: the latest complete one) into ``state`` in
        place; returns the step loaded, or None when there is none (with a warning when the
        root itself does not exist: a first run, or a mistyped path). A delta's chain is checked
        link by link (``verify``: every checksum too) before anything changes, then applied.
        Collective; a rank's failure raises ``CheckpointError``. ``verify`` and
        ``load_optimizer``: see ``KVZCHLoadPlanner``."""
        self.wait()  # a save still being written: committed first (it may be the one to load)
        if step is None and not self.root.is_dir():
            warnings.warn(f"CheckpointManager.load: {self.root} does not exist, so nothing was loaded; "
                          "expected on a first run, otherwise check the path", stacklevel=2)
            return None
        step = self.latest() if step is None else step
        if step is None:
            return None
        path = self.path(step)
        if not (path / ".metadata").is_file():
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no .metadata); "
                                    f"complete ones under {self.root}: {self.steps()}")
        chain = self.chain(step)
        links = [(s, i > 0, i < len(chain) - 1) for i, s in enumerate(chain)]
        if len(chain) > 1:  # every link checked before the first one changes anything
            for s, delta, tables_only in links:
                self._load_link(state, s, verify, load_optimizer, delta, tables_only, check_only=True)
            verify = False
        for s, delta, tables_only in links:
            self._load_link(state, s, verify, load_optimizer, delta, tables_only)
        stores = table_snapshots(state)  # the state is the checkpoint's: a base for deltas
        for store in stores if self._tracking else ():
            store.changes.start()
        marks = {store: store.mark() for store in stores}
        # (Fresh optimizer state is not the checkpoint's: the next save is a full one.)
        self._base = _Base(step, len(chain) - 1, marks) if load_optimizer else None
        return step

    def _load_link(self, state: dict, step: int, verify: bool, load_optimizer: bool, delta: bool,
                   tables_only: bool, check_only: bool = False) -> None:
        path = self.path(step)
        planner = KVZCHLoadPlanner(checkpoint_id=path, verify=verify, load_optimizer=load_optimizer,
                                   delta=delta, tables_only=tables_only, check_only=check_only)
        with _surfaced("load", path):
            dcp.load(state, checkpoint_id=path, planner=planner, process_group=self.process_group)

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier(group=self.process_group)


@contextmanager
def _surfaced(action: str, path: Path):
    """DCP's ``CheckpointException`` (a ``BaseException``) as a ``CheckpointError``."""
    try:
        yield
    except CheckpointException as e:
        raise CheckpointError.of(e, action, path) from e


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
