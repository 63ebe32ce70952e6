"""Shared pieces of the preflight tests: real mounts when root may make them, a fresh log pipeline."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.servers import mount_or_skip



@pytest.fixture(autouse=True)
def _key_in_tmp(tmp_path, monkeypatch):
    """No test may read or create the user's real checkpoint key."""
    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_KEY", str(tmp_path / "env" / "checkpoint.key"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def mounts(tmp_path):
    """`mounts.tmpfs(size)` and `mounts.read_only(source)`: real mounts, unmounted after the test."""
    made: list[Path] = []

    class Mounts:
        @staticmethod
        def tmpfs(size: str) -> Path:
            target = tmp_path / f"tmpfs{len(made)}"
            target.mkdir()
            mount_or_skip(["-t", "tmpfs", "-o", f"size={size}", "tmpfs"], target)
            made.append(target)
            return target

        @staticmethod
        def read_only(source: Path) -> Path:
            """A read-only bind mount of `source`: even root cannot write there."""
            target = tmp_path / f"ro{len(made)}"
            target.mkdir()
            mount_or_skip(["--bind", str(source)], target)
            made.append(target)
            mount_or_skip(["-o", "remount,bind,ro"], target)
            return target

    yield Mounts
    for target in reversed(made):
        subprocess.run(["umount", "-l", str(target)], capture_output=True, timeout=30)
