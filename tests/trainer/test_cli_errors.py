"""`trainguard train` answers bad input with a message and exit 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.servers import fill_disk, tmpfs


def train(*args, env=None):
    return subprocess.run([sys.executable, "-m", "trainguard.cli", "train", "--steps", "1", "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("content, mode, message", [
    (b"x" * 64, 0o644, "the checkpoint key is readable or writable by others (mode 0644)"),
    (b"abc", 0o600, "a checkpoint key needs at least"),
])
def test_a_loose_or_short_key_is_a_message_with_exit_2(tmp_path, content, mode, message):
    key = tmp_path / "key"
    key.write_bytes(content)
    key.chmod(mode)
    result = train("--run-dir", str(tmp_path / "run"), "--key-file", str(key))
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_a_run_dir_that_cannot_be_made_is_a_message_with_exit_2():
    result = train("--run-dir", "/proc/x")
    assert result.returncode == 2 and "--run-dir /proc/x: cannot create it" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_full_disk_when_writing_config_yaml_is_a_message_with_exit_2(tmp_path):
    with tmpfs(tmp_path / "disk", "64k") as disk:
        (disk / "run").mkdir()
        fill_disk(disk)
        result = train("--run-dir", str(disk / "run"))
        assert result.returncode == 2 and "config.yaml: cannot write: No space left on device" in result.stderr
        assert "bytes needed" in result.stderr and "Traceback" not in result.stderr
        assert list((disk / "run").iterdir()) == []             # no half-written file left
