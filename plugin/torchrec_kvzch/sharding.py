"""Deprecated: ``torchrec_kvzch.sharding`` moved to ``torchrec_kvzch.torchrec`` (0.2); this alias goes
in the next release."""

import warnings

from torchrec_kvzch.torchrec import *  # noqa: F401,F403
from torchrec_kvzch.torchrec import __all__  # noqa: F401

warnings.warn("torchrec_kvzch.sharding is deprecated: import from torchrec_kvzch.torchrec (or torchrec_kvzch)",
              DeprecationWarning, stacklevel=2)
