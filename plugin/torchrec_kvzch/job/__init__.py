"""The training job (``python -m torchrec_kvzch.job.train``): a DLRM on a click log, trained on
N processes with checkpoints and resume at any world size; ``demo`` is ``make demo``."""

import difflib
from pathlib import Path

from torchrec_kvzch.torchrec.config import ConfigError


def _shipped_configs() -> Path:
    """The shipped sharding configs: installed from a wheel, the package's ``configs/`` (package
    data); in a checkout (an editable install, the GPU kit), its top-level ``configs/``."""
    installed = Path(__file__).resolve().parents[1] / "configs"
    return installed if installed.is_dir() else Path(__file__).resolve().parents[3] / "configs"


# ``--config NAME`` picks one of these.
SHIPPED_CONFIGS = _shipped_configs()


def shipped_config_names() -> list[str]:
    """The names ``--config`` takes, read from the folder: the one list, for help and errors."""
    return sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.yaml"))


def config_path(name_or_path: str | Path) -> Path:
    """The shipped config called ``name_or_path`` if there is one, else ``name_or_path`` as a
    path. A bare name that is neither (no '/', no YAML suffix, no such file) is refused with
    the close shipped names: a typo of one."""
    text = str(name_or_path)
    shipped = SHIPPED_CONFIGS / f"{text}.yaml"
    if "/" not in text and shipped.is_file():
        return shipped
    path = Path(name_or_path)
    if "/" in text or path.exists() or path.suffix in (".yaml", ".yml"):
        return path  # (a path: load_config says if it does not exist)
    names = shipped_config_names()
    close = difflib.get_close_matches(text, names, n=3)
    raise ConfigError(f"{text}: no such sharding config; " + (f"did you mean {' or '.join(map(repr, close))}? "
                                                              if close else "")
                      + f"shipped: {', '.join(names)}; or give the path of a YAML file")
