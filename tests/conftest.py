import os

import pytest
from hypothesis import HealthCheck, settings

# Property runs sized for a 2-core CI machine; KVZCH_HYPOTHESIS_PROFILE=thorough for more examples.
settings.register_profile("ci", max_examples=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=400, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("KVZCH_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="module")
def pools():
    """Gloo ranks for world sizes 1-3 (``_dist.RankPool``), started once for every case of a
    module: starting them costs seconds per process."""
    from _dist import RankPool

    started = {w: RankPool(w, timeout=600) for w in (1, 2, 3)}
    yield started
    for pool in started.values():
        pool.close()
