"""The training job (``python -m torchrec_kvzch.job.train``): a DLRM on a click log, trained on
N processes with checkpoints and resume at any world size; ``demo`` is ``make demo``."""

from pathlib import Path


def _shipped_configs() -> Path:
    """The shipped sharding configs: installed from a wheel, the package's ``configs/`` (package
    data); in a checkout (an editable install, the GPU kit), its top-level ``configs/``."""
    installed = Path(__file__).resolve().parents[1] / "configs"
    return installed if installed.is_dir() else Path(__file__).resolve().parents[3] / "configs"


# ``--config NAME`` picks one of these.
SHIPPED_CONFIGS = _shipped_configs()


def config_path(name_or_path: str | Path) -> Path:
    """The shipped config called ``name_or_path`` (``quickstart``, ``criteo``, ``eviction``,
    ``large``) if there is one, else ``name_or_path`` as a path."""
    shipped = SHIPPED_CONFIGS / f"{name_or_path}.yaml"
    return shipped if "/" not in str(name_or_path) and shipped.is_file() else Path(name_or_path)
