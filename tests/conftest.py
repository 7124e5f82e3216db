import os

from hypothesis import HealthCheck, settings

# Property runs sized for a 2-core CI machine; KVZCH_HYPOTHESIS_PROFILE=thorough for more examples.
settings.register_profile("ci", max_examples=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=400, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("KVZCH_HYPOTHESIS_PROFILE", "ci"))
