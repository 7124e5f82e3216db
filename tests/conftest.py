import os

# Without an NVIDIA GPU, Triton's interpreter runs the GPU kernels on the CPU (test_id_map.py
# checks them against the torch twins). Triton reads this when a kernel is defined, and torch's
# imports can define Triton's own library functions, so it is set before anything imports torch.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Property runs sized for a 2-core CI machine; KVZCH_HYPOTHESIS_PROFILE=thorough for more examples.
settings.register_profile("ci", max_examples=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=400, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("KVZCH_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="module")
def pools():
    """Gloo ranks by world size (``_dist.RankPools``), each started once for every case of a
    module that runs on it: starting them costs seconds per process."""
    from _dist import RankPools

    started = RankPools(timeout=600)
    yield started
    started.close()
