"""A replica that follows training: new checkpoints are applied in the background and swapped
in atomically.

A ``Version`` is one served model at one checkpoint step; requests take ``follower.current``
(one reference read) and use it to the end, so a request sees the version before a swap or the
one after, never half of one. ``poll()`` looks for a newer complete checkpoint: a delta whose
base is the version served is applied to copies of the KV-ZCH tables (the ids it deleted
leave, its rows replace or join the others; the dense model and ordinary tables come from the
delta, which saves them whole); anything else - a full checkpoint, a delta of another base,
several steps at once - is built from its chain. The new version is swapped in only once
complete. A damaged, partial or out-of-chain checkpoint is refused (``last_error`` names the
file), logged, and the version served stays.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from torchrec_kvzch.serving.build import apply, default_rows, find_table
from torchrec_kvzch.serving.model import ServingOptions, assign, dense_entries, ordinary_table, served_model
from torchrec_kvzch.serving.modules import ServedModule
from torchrec_kvzch.serving.source import CheckpointSource

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Version:
    """One served model: the checkpoint step it restores, that checkpoint's unique id, and
    when it began to be served (``time.time()``)."""

    model: nn.Module
    step: int
    uid: str | None
    since: float = field(default_factory=time.time)


class Follower:
    """Serves the newest checkpoint under ``root`` and follows new ones. ``build_model``
    returns a fresh unsharded model as trained (``model.served_model`` serves it)."""

    def __init__(self, build_model: Callable[[], nn.Module], root: str | Path, *, prefix: str = "model",
                 options: ServingOptions = ServingOptions(), poll_s: float = 1.0) -> None:
        self.build_model, self.prefix, self.options, self.poll_s = build_model, prefix, options, poll_s
        self.source = CheckpointSource(root)
        self.last_error: str | None = None
        self.current = self._build(None)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one poll at a time

    # -- what is served -----------------------------------------------------------------------
    def status(self) -> dict:
        """The version served and how far behind the newest checkpoint it is."""
        latest = self.source.latest()
        v = self.current
        return {"step": v.step, "latest_step": latest, "behind_steps": (latest or v.step) - v.step,
                "served_for_s": time.time() - v.since, "last_error": self.last_error}

    # -- following ----------------------------------------------------------------------------
    def poll(self) -> bool:
        """Serve the newest complete checkpoint if it is newer; True when a new version was
        swapped in. Errors are kept in ``last_error`` (and logged); the version stays."""
        with self._lock:
            latest = self.source.latest()
            if latest is None or latest <= self.current.step:
                return False
            try:
                new = self._next(latest)
            except Exception as e:  # noqa: BLE001 - a replica keeps serving whatever went wrong
                self.last_error = f"step {latest} was not served: {e}"
                logger.error("%s", self.last_error)
                return False
            self.current, self.last_error = new, None
            logger.info("serving step %d", new.step)
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
        while not self._stop.wait(self.poll_s):
            self.poll()

    # -- building -----------------------------------------------------------------------------
    def _next(self, step: int) -> Version:
        """The version of ``step``: the deltas after the version served applied to it when
        ``step``'s chain goes through it, else ``step``'s chain built afresh."""
        chain = self.source.chain(step)
        at = next((i for i, link in enumerate(chain)
                   if link.step == self.current.step and link.uid == self.current.uid), None)
        new = self._apply_deltas(chain[at + 1:]) if at is not None else None
        return new or self._build(step)

    def _build(self, step: int | None) -> Version:
        model, step = served_model(self.build_model(), self.source.root, step=step, prefix=self.prefix,
                                   options=self.options)
        return Version(model, step, self.source.link(step).uid)

    def _apply_deltas(self, links: list) -> Version | None:
        """The version served with the deltas ``links`` applied, as a new model: each KV-ZCH
        table copied once and updated link by link, its default rows, ordinary tables and the
        dense part read from the last link (deltas save them whole); the version served is not
        touched. None when the default rows serve other id ranges now (a delta saved at
        another world size than its base): then the version is built afresh."""
        old, last = self.current.model, links[-1]
        served = [m for m in old.modules() if isinstance(m, ServedModule)]
        kv = [t for m in served for t in m.tables.values() if t.name in last.tables]
        for link in links:  # every file checked before any table is copied
            for t in kv:
                saved = find_table(link, t.name)
                link.check(link.chunks(saved, *t.id_range) + link.chunks(saved, *t.id_range, "deleted_id"))
        dense = dense_entries(old, set(), self.prefix, last)  # (served modules hold no parameters)
        memo = {}
        for m in served:
            for name, t in m.tables.items():
                if t.name in last.tables:
                    new = t.copy()
                    for link in links:
                        apply(link, new, name)
                    saved = find_table(last, name)
                    if not new.set_defaults(*default_rows(last, saved, *t.id_range, self.options.default)):
                        return None
                else:
                    new = ordinary_table(last, m.saved_as[name], t.empty_like())
                memo[id(t)] = new
        model = copy.deepcopy(old, memo)  # new modules over the new tables; the old ones untouched
        for name, value in dense.items():
            assign(model, name, value)
        return Version(model, last.step, last.uid)
