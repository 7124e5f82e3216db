"""A replica that follows training: new checkpoints are applied in the background and swapped
in atomically.

A ``Version`` is one served model at one checkpoint step. A request takes one with
``with follower.serving() as version:`` and uses it to the end, so it sees the version before a
swap or the one after, never half of one. ``poll()`` looks for a newer complete checkpoint:
when its chain runs through the version served, its deltas are applied (the ids they deleted
leave, their rows replace or join the others; ordinary tables, default rows and the dense part
come from the last delta, which saves them whole); anything else - a full checkpoint, a chain
that does not pass through the version served - is built from its chain. The new version is
swapped in only once complete. A damaged, partial or out-of-chain checkpoint is refused
(``last_error`` names the file), logged, and the version served stays.

Double buffering: the follower keeps a spare copy of the version served. A delta is applied to
the spare (a few rows: no copy of the tables on the way to serving it), which is then swapped
in; once the requests still on the old version have finished, the old version catches up with
the same deltas and becomes the next spare. KV-ZCH tables are held twice; ``spare=False``
holds them once and copies them for each new version instead (slower to follow: a copy is a
pass over every row).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from torchrec_kvzch.serving.build import apply, check_link, default_rows, find_table
from torchrec_kvzch.serving.model import ServingOptions, assign, dense_entries, ordinary_table, served_model
from torchrec_kvzch.serving.modules import ServedModule
from torchrec_kvzch.serving.source import CheckpointSource, Link

logger = logging.getLogger(__name__)


class Version:
    """One served model: the checkpoint step it restores, that checkpoint's unique id, when it
    began to be served (``time.time()``), and the requests using it now."""

    def __init__(self, model: nn.Module, step: int, uid: str | None) -> None:
        self.model, self.step, self.uid, self.since = model, step, uid, time.time()
        self._readers = 0
        self._retired = False
        self._idle = threading.Condition()

    def enter(self) -> bool:
        """Count a request in; False once the version is retired (take the current one)."""
        with self._idle:
            if self._retired:
                return False
            self._readers += 1
            return True

    def leave(self) -> None:
        with self._idle:
            self._readers -= 1
            self._idle.notify_all()

    def retire(self, timeout: float) -> bool:
        """Take no new requests; True once those using it have finished (within ``timeout``)."""
        with self._idle:
            self._retired = True
            return self._idle.wait_for(lambda: self._readers == 0, timeout)


class Follower:
    """Serves the newest checkpoint under ``root`` and follows new ones. ``build_model``
    returns a fresh unsharded model as trained (``model.served_model`` serves it)."""

    def __init__(self, build_model: Callable[[], nn.Module], root: str | Path, *, prefix: str = "model",
                 options: ServingOptions = ServingOptions(), poll_s: float = 1.0, spare: bool = True) -> None:
        if not 0 < poll_s < math.inf:  # (0 or less polled in a busy loop, a core at idle; NaN fails too)
            raise ValueError(f"Follower: poll_s={poll_s}; poll every positive, finite number of seconds")
        self.build_model, self.prefix, self.options, self.poll_s = build_model, prefix, options, poll_s
        self.source = CheckpointSource(root)
        self.last_error: str | None = None
        self.current = self._build(None)
        self._keep_spare = spare
        self._spare = self._copy(self.current) if spare else None  # the current version's twin
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one poll at a time

    # -- what is served -----------------------------------------------------------------------
    @contextmanager
    def serving(self):
        """The version to answer one request with, kept unchanged until the block ends."""
        while True:
            version = self.current
            if version.enter():
                break
        try:
            yield version
        finally:
            version.leave()

    def status(self) -> dict:
        """The version served and how far behind the newest checkpoint it is: in steps, and in
        seconds since that checkpoint was committed (0 when it is the one served)."""
        latest = self.source.latest()
        v = self.current
        behind = latest is not None and latest > v.step
        committed = (self.source.path(latest) / ".metadata").stat().st_mtime if behind else time.time()
        return {"step": v.step, "latest_step": latest, "behind_steps": (latest or v.step) - v.step,
                "lag_s": max(0.0, time.time() - committed), "served_for_s": time.time() - v.since,
                "last_error": self.last_error}

    # -- following ----------------------------------------------------------------------------
    def poll(self) -> bool:
        """Serve the newest complete checkpoint if it is newer; True when a new version was
        swapped in. Errors are kept in ``last_error`` (and logged); the version stays."""
        with self._lock:
            latest = self.source.latest()
            if latest is None or latest <= self.current.step:
                return False
            try:
                new, deltas = self._next(latest)
            except Exception as e:  # noqa: BLE001 - a replica keeps serving whatever went wrong
                self.last_error = f"step {latest} was not served: {e}"
                logger.error("%s", self.last_error)
                return False
            old, self.current, self.last_error = self.current, new, None
            logger.info("serving step %d", new.step)
            self._renew_spare(old, deltas)
            return True

    def start(self) -> "Follower":
        """Poll every ``poll_s`` seconds in a background thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvzch-follower", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        # Building the next version must not slow the requests served meanwhile: one torch
        # thread (the setting is per thread), at a lower CPU priority where the OS has one per
        # thread (Linux), so a request's parallel work never waits for a core the build holds.
        torch.set_num_threads(1)
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass
        while not self._stop.wait(self.poll_s):
            self.poll()

    # -- building -----------------------------------------------------------------------------
    def _next(self, step: int) -> tuple[Version, list[Link] | None]:
        """(the version of ``step``, the deltas applied to reach it from the version served, or
        None when it was built from its chain)."""
        chain = self.source.chain(step)
        at = next((i for i, link in enumerate(chain)
                   if link.step == self.current.step and link.uid == self.current.uid), None)
        if at is not None:
            deltas = chain[at + 1:]
            spare, self._spare = self._spare, None  # (a failure below leaves no half-updated spare)
            model = self._apply(spare.model if spare is not None else self._copy(self.current).model, deltas)
            if model is not None:
                return Version(model, deltas[-1].step, deltas[-1].uid), deltas
        return self._build(step), None

    def _renew_spare(self, old: Version, deltas: list[Link] | None) -> None:
        """The version just retired becomes the spare: once its requests are done, the same
        deltas bring it level with the one served; else a copy of the one served."""
        if not self._keep_spare:
            return
        try:
            if deltas is not None and old.retire(timeout=60.0) and self._apply(old.model, deltas) is not None:
                self._spare = Version(old.model, self.current.step, self.current.uid)
            else:
                self._spare = self._copy(self.current)
        except Exception as e:  # noqa: BLE001 - the next delta copies the version served instead
            logger.warning("no spare version (%s); the next delta is applied to a copy", e)
            self._spare = None

    def _build(self, step: int | None) -> Version:
        model, step = served_model(self.build_model(), self.source.root, step=step, prefix=self.prefix,
                                   options=self.options)
        return Version(model, step, self.source.link(step).uid)

    @staticmethod
    def _copy(version: Version) -> Version:
        """An independent copy of ``version`` (its tables copied, the rest deep-copied)."""
        memo = {id(t): t.copy() for m in version.model.modules() if isinstance(m, ServedModule)
                for t in m.tables.values()}
        return Version(copy.deepcopy(version.model, memo), version.step, version.uid)

    def _apply(self, model: nn.Module, links: list[Link]) -> nn.Module | None:
        """``links`` (deltas, in order) applied to ``model`` in place, which nothing serves:
        KV-ZCH tables link by link; ordinary tables, default rows and the dense part from the
        last link. None when the default rows serve other id ranges now (a delta saved at
        another world size than its base): then the version is built from its chain."""
        last = links[-1]
        served = [m for m in model.modules() if isinstance(m, ServedModule)]
        kv = [t for m in served for t in m.tables.values() if t.name in last.tables]
        for link in links:  # every file checked before any table changes
            for t in kv:
                check_link(link, find_table(link, t.name), *t.id_range)
        dense = dense_entries(model, set(), self.prefix, last, self.options.device)  # (served modules hold none)
        defaults = {t.name: default_rows(last, find_table(last, t.name), *t.id_range, self.options.default)
                    for t in kv}
        if not all(t.default_starts_match(defaults[t.name][1]) for t in kv):
            return None
        for m in served:
            for name, t in list(m.tables.items()):
                if t.name in last.tables:
                    for link in links:
                        apply(link, t, name)
                    t.set_defaults(*defaults[name])
                else:
                    m.replace(ordinary_table(last, m.saved_as[name], t.empty_like()))
        for name, value in dense.items():
            assign(model, name, value)
        return model
