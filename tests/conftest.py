import os

from hypothesis import HealthCheck, settings

# Accounting calls take milliseconds to seconds; no per-example deadline, few examples.
settings.register_profile(
    "hsa",
    deadline=None,
    max_examples=int(os.environ.get("HSA_HYPOTHESIS_EXAMPLES", "25")),
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("hsa")
