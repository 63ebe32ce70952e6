"""Hypothesis settings for the property tests, as named profiles.

- ``dev`` (default on a workstation): examples saved in ``.hypothesis/`` so a failure found once is tried
  first next time.
- ``ci`` (``CI=true``): no example database (a fresh clone has none, and nothing is written back), a new
  random seed each run so CI keeps exploring, and the failing example printed as a reproducible blob.
- ``thorough``: ten times the examples, for a long local run (``HYPOTHESIS_PROFILE=thorough``).

Every profile has ``deadline=None``: the machines these run on are shared, and a slow example is not a
wrong one. Each test sets its own ``max_examples`` so that tests/property stays under ~40 s in all.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

settings.register_profile("dev", **COMMON)
settings.register_profile("ci", database=None, derandomize=False, print_blob=True, **COMMON)
settings.register_profile("thorough", max_examples=1000, **COMMON)

_default = "ci" if os.environ.get("CI", "").lower() == "true" else "dev"
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", _default))


def examples(n: int) -> int:
    """`n` examples, times 10 under the thorough profile (per-test max_examples overrides the profile's)."""
    return n * 10 if settings.default.max_examples >= 1000 else n
