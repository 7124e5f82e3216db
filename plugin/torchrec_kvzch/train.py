"""Deprecated: the training job moved to ``torchrec_kvzch.job.train`` (0.2); this alias (also as
``python -m torchrec_kvzch.train``) goes in the next release. The console script
``torchrec-kvzch-train`` is unchanged."""

import sys
import warnings

from torchrec_kvzch.job.train import main, parse_args  # noqa: F401

warnings.warn("torchrec_kvzch.train is deprecated: use torchrec_kvzch.job.train "
              "(python -m torchrec_kvzch.job.train)", DeprecationWarning, stacklevel=2)

if __name__ == "__main__":
    sys.exit(main())
