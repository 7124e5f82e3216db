"""Deprecated: ``torchrec_kvzch.config`` moved to ``torchrec_kvzch.torchrec.config`` (0.2); this alias goes
in the next release."""

import warnings

from torchrec_kvzch.torchrec.config import *  # noqa: F401,F403
from torchrec_kvzch.torchrec.config import __all__  # noqa: F401

warnings.warn("torchrec_kvzch.config is deprecated: import from torchrec_kvzch.torchrec.config (or torchrec_kvzch)",
              DeprecationWarning, stacklevel=2)
