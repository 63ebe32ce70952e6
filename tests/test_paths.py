"""A device or a FIFO where a file or run directory is expected is named for what it is: exit 2, no hang.

Opening a FIFO blocks until a writer comes and /dev/zero never ends, so each command must look before
it opens (trainguard/paths.py); a hang here is a 30 s timeout, not a pass.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

TRAINGUARD = [sys.executable, "-m", "trainguard.cli"]

RUN_DIR_COMMANDS = [["status"], ["report"], ["diagnose"], ["goodput"], ["checkpoint", "verify"]]


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


def _run(args: list[str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run(TRAINGUARD + args, capture_output=True, text=True, timeout=30, cwd=cwd)


@pytest.mark.parametrize("command", RUN_DIR_COMMANDS, ids=" ".join)
def test_a_fifo_given_as_run_directory_is_named_a_fifo(command, fifo, tmp_path):
    done = _run(command + [str(fifo)], tmp_path)
    assert done.returncode == 2, done.stderr
    assert f"{fifo}: is a FIFO, not a run directory" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("command", [["status"], ["checkpoint", "verify"]], ids=" ".join)
def test_dev_zero_given_as_run_directory_is_named_a_device(command, tmp_path):
    done = _run(command + ["/dev/zero"], tmp_path)
    assert done.returncode == 2 and "/dev/zero: is a device, not a run directory" in done.stderr


@pytest.mark.parametrize("special", ["fifo", "/dev/zero"])
def test_a_policy_that_is_a_fifo_or_dev_zero_is_refused_without_reading_it(special, fifo, tmp_path):
    path = str(fifo) if special == "fifo" else special
    kind = "FIFO" if special == "fifo" else "device"
    (tmp_path / "tls").mkdir()
    done = _run(["replay", "--policy", path, str(tmp_path)], tmp_path)
    assert done.returncode == 2 and f"{path}: is a {kind}, not a policy file" in done.stderr


def test_an_agent_config_that_is_a_fifo_is_refused(fifo, tmp_path):
    done = _run(["agent", "--config", str(fifo)], tmp_path)
    assert done.returncode == 2 and f"{fifo}: is a FIFO, not a config file" in done.stdout + done.stderr
