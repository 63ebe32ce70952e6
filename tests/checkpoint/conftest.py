"""Shared pieces of the checkpoint tests: a real training state, a key of its own, a small real tmpfs."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.servers import mount_or_skip


@pytest.fixture(autouse=True)
def _key_in_tmp(tmp_path, monkeypatch):
    """No test may read or create the user's real key (~/.config/trainguard/checkpoint.key)."""
    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_KEY", str(tmp_path / "env" / "checkpoint.key"))



@pytest.fixture
def key_file(tmp_path) -> Path:
    return tmp_path / "keys" / "checkpoint.key"


@pytest.fixture
def small_tmpfs(tmp_path):
    """Mount a real tmpfs of the given size (a full disk on demand). Needs root: skipped where mount is
    not permitted, but a failure under CI=true when running as root, where it must work."""
    mounted: list[Path] = []

    def mount(size: str = "2m") -> Path:
        target = tmp_path / f"tmpfs{len(mounted)}"
        target.mkdir()
        mount_or_skip(["-t", "tmpfs", "-o", f"size={size}", "tmpfs"], target)
        mounted.append(target)
        return target

    yield mount
    for target in mounted:
        subprocess.run(["umount", "-l", str(target)], capture_output=True, timeout=30)
