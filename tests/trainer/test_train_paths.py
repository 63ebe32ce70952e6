"""`trainguard train --config` and `--key-file` look before they open (trainguard/paths.py): a FIFO, a
device or a directory is named for what it is, exit 2, no hang and no traceback.

Before: `--key-file FIFO` blocked for good in the key's open(), `--config /dev/zero` read forever, and a
directory as `--config` was a traceback (IsADirectoryError). A hang here is the 60 s timeout, not a pass.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainguard.cli", "train", "--steps", "1", "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=60)


def special(kind: str, tmp_path) -> tuple[str, str]:
    """(path, the words paths.what_is uses) for a FIFO, /dev/zero or a directory."""
    if kind == "fifo":
        path = tmp_path / "pipe.yaml"
        os.mkfifo(path)
        return str(path), "is a FIFO"
    if kind == "directory":
        path = tmp_path / "dir.yaml"
        path.mkdir()
        return str(path), "is a directory"
    return "/dev/zero", "is a device"


@pytest.mark.parametrize("flag, named", [("--config", "config file"), ("--key-file", "checkpoint key file")])
@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "directory"])
def test_a_config_or_key_that_is_not_a_regular_file_is_named_with_exit_2(kind, flag, named, tmp_path):
    path, what = special(kind, tmp_path)
    done = train("--run-dir", str(tmp_path / "run"), flag, path)
    assert done.returncode == 2, done.stderr
    assert f"{path}: {what}, not a {named}" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()          # refused before anything is written


def test_a_key_file_that_does_not_exist_yet_is_still_created(tmp_path):
    key = tmp_path / "keys" / "new.key"
    done = train("--run-dir", str(tmp_path / "run"), "--key-file", str(key), "--config", "tiny")
    assert done.returncode == 0, done.stderr
    assert key.is_file() and key.stat().st_mode & 0o077 == 0
