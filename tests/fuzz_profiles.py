"""The hypothesis profiles every fuzz test runs under.

``make test`` runs the fixed-seed ``ci`` profile (derandomized, 200 examples unless a
test asks for fewer); ``make fuzz`` runs the ``fuzz`` profile (``HFTC_FUZZ_EXAMPLES``
examples per test, default 5000, random seeds) by setting ``HFTC_FUZZ_PROFILE=fuzz``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=200, derandomize=True, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "fuzz", max_examples=int(os.environ.get("HFTC_FUZZ_EXAMPLES", "5000")), deadline=None,
    print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PROFILE = os.environ.get("HFTC_FUZZ_PROFILE", "ci")
FUZZ = settings.get_profile(PROFILE)


def examples(ci: int) -> settings:
    """The active profile, with ``ci`` examples under the ci profile (a slower test's
    share of ``make test``); the fuzz profile keeps its own count."""
    return settings(FUZZ, max_examples=ci if PROFILE == "ci" else FUZZ.max_examples)
