"""Crashes and full disks while saving: the previous checkpoint stays intact and is the one chosen."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tests.checkpoint.crash_child import small_state
from tests.checkpoint.helpers import assert_same
from trainguard.runtime.checkpoint import CheckpointError, CheckpointManager, verify
from trainguard.runtime.checkpoint.manager import read_status

CHILD = Path(__file__).with_name("crash_child.py")
REPO = Path(__file__).resolve().parents[2]


def _run_child_until_paused(run_dir: Path, key_file: Path, point: str) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, str(CHILD), str(run_dir), str(key_file), point], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    lines = []
    timer = threading.Timer(60, child.kill)  # never hang the suite if the child never pauses
    timer.start()
    try:
        for line in child.stdout:
            lines.append(line)
            if line.strip() == "PAUSED":
                return child
    finally:
        timer.cancel()
    raise AssertionError(f"child never paused: rc={child.wait()} stdout={lines} stderr={child.stderr.read()}")


@pytest.mark.slow
@pytest.mark.parametrize("point", ["write", "manifest", "async"])
def test_kill_9_during_a_checkpoint_leaves_the_previous_one_verified_and_chosen(tmp_path, key_file, point):
    run_dir = tmp_path / "run"
    child = _run_child_until_paused(run_dir, key_file, point)
    root = run_dir / "checkpoints"
    partial = [p for p in root.iterdir() if p.name.startswith(".tmp-step_2-")]
    assert len(partial) == 1 and (partial[0] / "__0_0.distcp").stat().st_size >= 8 << 20
    if point == "manifest":
        assert (partial[0] / "manifest.json").exists()
        assert verify(partial[0], key_file=key_file).code == "step_mismatch"  # signed, but not a step_N dir
    child.send_signal(signal.SIGKILL)
    assert child.wait(timeout=30) == -signal.SIGKILL
    child.stdout.close()
    child.stderr.close()

    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["status.json", "step_1"]
    events = []
    manager = CheckpointManager(run_dir, key_file=key_file, on_event=lambda kind, **f: events.append(kind))
    assert not partial[0].exists()  # the restarted run removes the dead process's temporary
    ckpt, state = manager.load_latest()
    assert ckpt.step == 1 and verify(ckpt.path, key_file=key_file).ok
    assert_same(state, small_state())
    assert events == ["checkpoint_restored"]  # nothing was skipped: step_2 never existed


def _sizes(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.mark.parametrize("on_error", ["raise", "warn"])
def test_a_full_disk_keeps_the_previous_checkpoint_and_says_so(tmp_path, key_file, small_tmpfs, on_error):
    disk = small_tmpfs("2m")
    events = []
    manager = CheckpointManager(disk / "run", key_file=key_file, on_error=on_error,
                                on_event=lambda kind, **f: events.append((kind, f)))
    manager.save(1, {"model": {"w": torch.ones(10_000)}}, stable=True)
    free_before = os.statvfs(disk).f_bavail
    too_big = {"model": {"w": torch.ones(1 << 20)}}  # 4 MiB on a 2 MiB disk

    if on_error == "raise":
        with pytest.raises(CheckpointError) as info:
            manager.save(2, too_big, stable=False)
        error = info.value
    else:
        handle = manager.save(2, too_big, stable=False)
        assert handle.done()
        error = handle.error
    message = str(error)
    assert error.code == "write_failed" and "No space left on device" in message
    assert "step_2 was not saved" in message and "still step_1" in message
    assert "temporary files were removed" in message
    assert isinstance(error.__cause__, OSError)
    assert f"needs about {4 << 20} bytes" in message and "are free under" in message
    assert "the next checkpoint interval tries again" in message
    assert _sizes(disk / "run" / "checkpoints") == ["status.json", "step_1"]  # no tmp dir left behind
    assert os.statvfs(disk).f_bavail == free_before  # its space was given back
    assert verify(disk / "run" / "checkpoints" / "step_1", key_file=key_file).ok
    assert manager.latest_verified().step == 1
    status = read_status(disk / "run")   # what `trainguard status` shows, written on the full disk
    assert status["ok"] is False and status["step"] == 2 and status["bytes_needed"] == 4 << 20
    assert status["durable_step"] == 1 and "No space left" in status["error"]

    if on_error == "warn":   # the next interval fails again: counted, recorded, not reported again
        assert manager.save(4, too_big, stable=False).error is not None
        assert read_status(disk / "run")["failed_saves"] == 2
    failed = [f for kind, f in events if kind == "checkpoint_failed"]
    assert len(failed) == 1 and failed[0]["step"] == 2 and "No space left" in failed[0]["reason"]
    assert failed[0]["bytes_needed"] == 4 << 20

    manager.save(3, {"model": {"w": torch.zeros(10)}}, stable=False)  # the run can go on saving
    assert manager.latest_verified().step == 3 and manager.report.durable_step == 3
    assert read_status(disk / "run")["ok"] is True and manager.report.failures == 0


def test_a_full_disk_during_an_async_save_surfaces_on_wait(tmp_path, key_file, small_tmpfs):
    disk = small_tmpfs("2m")
    manager = CheckpointManager(disk / "run", key_file=key_file, async_save=True)
    manager.save(1, {"model": {"w": torch.ones(1000)}}, stable=True)
    handle = manager.save(2, {"model": {"w": torch.ones(1 << 20)}}, stable=False)  # returns before writing
    with pytest.raises(CheckpointError, match="No space left on device"):
        manager.wait()
    assert handle.error is not None and handle.done()
    manager.wait()  # surfaced once
    assert _sizes(disk / "run" / "checkpoints") == ["status.json", "step_1"]
    assert manager.latest_verified().step == 1


def test_an_async_failure_surfaces_on_the_next_save(tmp_path, key_file, small_tmpfs):
    disk = small_tmpfs("2m")
    manager = CheckpointManager(disk / "run", key_file=key_file, async_save=True)
    manager.save(2, {"model": {"w": torch.ones(1 << 20)}}, stable=False)
    with pytest.raises(CheckpointError, match="step_2 was not saved"):
        manager.save(3, {"model": {"w": torch.ones(10)}}, stable=False)
    manager.save(3, {"model": {"w": torch.ones(10)}}, stable=False)
    manager.wait()
    assert manager.steps() == [3]
