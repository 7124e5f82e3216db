"""The old home of the DCP planners, kept for two reasons.

* Checkpoints written before the plain record (``record.py``) pickled ``CheckpointMappings`` and
  ``SavedTable`` under this module's path; they unpickle through these names for as long as
  such checkpoints load.
* ``from torchrec_kvzch.checkpoint.planner import KVZCHSavePlanner, KVZCHLoadPlanner`` still
  works, with a ``DeprecationWarning``, until the next release: import them from
  ``torchrec_kvzch`` (or ``torchrec_kvzch.checkpoint``).
"""

import importlib
import warnings

from torchrec_kvzch.checkpoint.record import CheckpointMappings, SavedTable  # noqa: F401

_MOVED = {"KVZCHSavePlanner": "save_planner", "KVZCHLoadPlanner": "load_planner"}


def __getattr__(name: str):
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"torchrec_kvzch.checkpoint.planner.{name} is deprecated: import it from "
                  "torchrec_kvzch (or torchrec_kvzch.checkpoint)", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(f"torchrec_kvzch.checkpoint.{_MOVED[name]}"), name)
