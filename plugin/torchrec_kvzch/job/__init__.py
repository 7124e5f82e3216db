"""The training job (``python -m torchrec_kvzch.job.train``): a DLRM on a click log, trained on
N processes with checkpoints and resume at any world size; ``demo`` is ``make demo``."""

from pathlib import Path

# The sharding configs shipped with the package (package data); ``--config NAME`` picks one.
SHIPPED_CONFIGS = Path(__file__).resolve().parent / "configs"


def config_path(name_or_path: str | Path) -> Path:
    """The shipped config called ``name_or_path`` (``quickstart``, ``criteo``, ``eviction``,
    ``large``) if there is one, else ``name_or_path`` as a path."""
    shipped = SHIPPED_CONFIGS / f"{name_or_path}.yaml"
    return shipped if "/" not in str(name_or_path) and shipped.is_file() else Path(name_or_path)
