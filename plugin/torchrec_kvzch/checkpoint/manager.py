"""Checkpoints that are either complete or absent: a folder per step, committed by a rename.

Every rank writes into ``<root>/step-<N>.partial``; once DCP has finished the save (every rank's
data and the coordinator's ``.metadata`` are on disk), rank 0 renames the folder to
``<root>/step-<N>``. A rename within a filesystem is atomic, so a save killed at any moment
leaves at most a ``.partial`` folder, which ``latest()`` never returns and the next save of that
step replaces. Older complete checkpoints beyond ``keep`` are removed after each commit.

The folder must be on a filesystem all ranks share (one machine, or a shared mount).
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from concurrent.futures import Future
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from torchrec_kvzch.checkpoint.load_planner import KVZCHLoadPlanner
from torchrec_kvzch.checkpoint.save_planner import KVZCHSavePlanner
from torchrec_kvzch.checkpoint.staging import KVZCHAsyncStager
from torchrec_kvzch.checkpoint.writer import KVZCHFileSystemWriter

_STEP = re.compile(r"^step-(\d+)$")


class CheckpointManager:
    def __init__(self, root: str | os.PathLike, keep: int = 2, writer_threads: int = 2,
                 process_group: dist.ProcessGroup | None = None) -> None:
        """``keep``: complete checkpoints to keep (>= 1). ``process_group``: the group saves and
        loads run their collectives on; give async saves a gloo group of their own."""
        if keep < 1:
            raise ValueError(f"CheckpointManager: keep={keep}; keep at least 1 checkpoint")
        self.root = Path(root)
        self.keep, self.writer_threads, self.process_group = keep, writer_threads, process_group
        self._stager: KVZCHAsyncStager | None = None
        self._pending: tuple[Future, int] | None = None
        self._commit_lock = threading.Lock()

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

    # -- saving -------------------------------------------------------------------------------
    def save(self, state: dict, step: int, asynchronous: bool = False) -> Future | None:
        """Save ``state`` (e.g. ``{"model": model.state_dict(), "optim": ...}``) as ``step``.
        Asynchronous: returns once the state is staged; the checkpoint is committed when the
        returned future completes (``wait()`` before the next save). Collective."""
        self.wait()
        partial = self.path(step).with_suffix(".partial")
        if _rank() == 0 and partial.exists():
            shutil.rmtree(partial)  # an earlier attempt at this step that died
        self._barrier()
        writer = KVZCHFileSystemWriter(partial, thread_count=self.writer_threads)
        if not asynchronous:
            dcp.save(state, storage_writer=writer, planner=KVZCHSavePlanner(),
                     process_group=self.process_group)
            self._commit(step)
            self._barrier()
            return None
        self._stager = self._stager or KVZCHAsyncStager()
        future = dcp.async_save(state, storage_writer=writer, planner=KVZCHSavePlanner(),
                                async_stager=self._stager, process_group=self.process_group)
        # DCP's future completes on each rank after the coordinator wrote the metadata: commit
        # then, without waiting for the trainer to ask.
        future.add_done_callback(lambda f: f.exception() is None and self._commit(step))
        self._pending = (future, step)
        return future

    def wait(self) -> None:
        """Block until a pending async save is committed (re-raises its error)."""
        if self._pending is not None:
            (future, step), self._pending = self._pending, None
            future.result()
            self._commit(step)  # a no-op when the callback already did it

    def close(self) -> None:
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _commit(self, step: int) -> None:
        """Rank 0 renames the finished folder into place (once) and prunes old checkpoints."""
        partial, final = self.path(step).with_suffix(".partial"), self.path(step)
        with self._commit_lock:
            if _rank() != 0 or not partial.exists():
                return
            if final.exists():  # the same step saved again: the new one wins
                shutil.rmtree(final)
            os.rename(partial, final)
            for old in self.steps()[: -self.keep]:
                shutil.rmtree(self.path(old), ignore_errors=True)

    # -- loading ------------------------------------------------------------------------------
    def load(self, state: dict, step: int | None = None, *, verify: bool = True,
             load_optimizer: bool = True) -> int | None:
        """Load the checkpoint of ``step`` (default: the latest complete one) into ``state`` in
        place; returns the step loaded, or None when there is none. Collective. ``verify`` and
        ``load_optimizer``: see ``KVZCHLoadPlanner``."""
        step = self.latest() if step is None else step
        if step is None:
            return None
        path = self.path(step)
        if not (path / ".metadata").is_file():
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no .metadata); "
                                    f"complete ones under {self.root}: {self.steps()}")
        planner = KVZCHLoadPlanner(checkpoint_id=path, verify=verify, load_optimizer=load_optimizer)
        dcp.load(state, checkpoint_id=path, planner=planner,
                 process_group=self.process_group)
        return step

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier(group=self.process_group)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
