"""Storage check: writable, big and fast enough — judged by real writes, not by mode bits root ignores."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path


from trainguard.policy import Policy, PreflightPolicy
from trainguard.preflight.storage import BYTES_PER_PARAMETER, check_storage
from trainguard.trainer.config import TrainConfig

SETTINGS = Policy().preflight


def write_config(run_dir: Path) -> int:
    """RUN/config.yaml of the tiny trainer preset; returns the checkpoint size preflight should estimate."""
    import torch

    from trainguard.trainer.config import load_file
    from trainguard.trainer.model import GPT

    config = load_file(TrainConfig(), "tiny")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config.dump())
    with torch.device("meta"):
        return GPT(config.model).num_params(non_embedding=False) * BYTES_PER_PARAMETER


def test_passes_and_sizes_the_checkpoint_from_the_model_config(tmp_path):
    expected = write_config(tmp_path)
    result = check_storage(tmp_path / "checkpoints", tmp_path, SETTINGS)
    assert result.status == "pass", result.message
    assert result.details["checkpoint_bytes"] == expected
    assert "parameters in config.yaml" in result.details["checkpoint_size_from"]
    assert result.details["write_bytes_per_second"] > 0 and (tmp_path / "checkpoints").is_dir()
    assert list((tmp_path / "checkpoints").iterdir()) == []       # the probe is gone


def test_sizes_from_the_newest_checkpoint_when_there_is_one(tmp_path):
    write_config(tmp_path)
    for step, size in ((5, 1000), (40, 3000), (7, 2000)):
        (tmp_path / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"step_{step}" / "model.pt").write_bytes(b"x" * size)
    result = check_storage(tmp_path / "checkpoints", tmp_path, SETTINGS)
    assert result.details["checkpoint_bytes"] == 3000
    assert result.details["checkpoint_size_from"] == "newest checkpoint step_40"


def test_a_file_where_the_directory_should_be_fails(tmp_path):
    (tmp_path / "checkpoints").write_text("not a directory")
    result = check_storage(tmp_path / "checkpoints", tmp_path, SETTINGS)
    assert result.status == "fail"
    assert result.message == f"checkpoint directory unusable: {tmp_path / 'checkpoints'} exists and is not a directory"


def test_a_read_only_checkpoint_directory_fails_even_for_root(tmp_path, mounts):
    source = tmp_path / "disk"
    source.mkdir()
    read_only = mounts.read_only(source)
    result = check_storage(read_only, None, SETTINGS)
    assert result.status == "fail"
    assert result.message == f"cannot write to the checkpoint directory {read_only}: Read-only file system"
    missing = check_storage(read_only / "run" / "checkpoints", None, SETTINGS)
    assert missing.status == "fail" and "cannot create" in missing.message and "Read-only" in missing.message


def _check_as_nobody(directory: Path) -> dict:
    """check_storage in a child process that dropped root for uid/gid 65534, as a normal user runs it."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:   # child: no return from here
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            result = check_storage(directory, None, SETTINGS)
            os.write(write_end, json.dumps([result.status, result.message]).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as reader:
        answer = reader.read()
    os.waitpid(pid, 0)
    status, message = json.loads(answer)
    return {"status": status, "message": message}


def test_a_directory_without_write_permission_fails(tmp_path):
    base = Path(tempfile.mkdtemp(prefix="preflight-perm-"))   # /tmp itself: reachable by an unprivileged user
    try:
        base.chmod(0o755)
        locked = base / "checkpoints"
        locked.mkdir()
        locked.chmod(0o000)
        if os.geteuid() == 0:
            # root writes through mode 000, so the honest answer for root is a pass ...
            assert check_storage(locked, None, SETTINGS).status == "pass"
            # ... and the permission is judged as the unprivileged user a job would run as
            result = _check_as_nobody(locked)
        else:
            result = check_storage(locked, None, SETTINGS).__dict__
        assert result["status"] == "fail"
        assert result["message"] == f"cannot write to the checkpoint directory {locked}: Permission denied"
    finally:
        (base / "checkpoints").chmod(0o700)
        shutil.rmtree(base)


def test_too_little_free_space_for_the_checkpoints_fails(tmp_path, mounts):
    disk = mounts.tmpfs("4m")
    expected = write_config(disk / "run")          # ~1.4 MB of checkpoint, 4 of them do not fit in 4 MB
    result = check_storage(disk / "run" / "checkpoints", disk / "run", SETTINGS)
    assert result.status == "fail"
    assert f"needs {4 * expected / 2**20:.1f} MiB ({SETTINGS.checkpoints_of_headroom:g} checkpoints of " \
           f"{expected / 2**20:.1f} MiB" in result.message
    assert result.details["probe_bytes"] <= 0.1 * result.details["free_bytes"]   # the probe never fills the disk


def test_a_checkpoint_too_slow_to_write_fails():
    slow = dataclasses.replace(SETTINGS, checkpoint_write_seconds_max=1e-9)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        write_config(run)
        result = check_storage(run / "checkpoints", run, slow)
    assert result.status == "fail" and "MB/s (limit 1e-09 s)" in result.message


def test_no_directory_given_is_a_skip():
    assert check_storage(None, None, PreflightPolicy()).status == "skip"
