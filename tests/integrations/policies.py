"""The policy the Transformers and Lightning integration runs train with."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.library.test_plain_loop import GUARD


def recovery_policy(tmp_path: Path) -> Path:
    """The guard's thresholds of the plain loop's test, and the in-memory snapshots (docs/library.md
    "Recovery") in a private directory of the test's, not the host's /dev/shm."""
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump({"guard": GUARD, "recovery": {"snapshot_dir": str(shm)}}))
    return path
