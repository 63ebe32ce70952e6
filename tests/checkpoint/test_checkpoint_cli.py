"""`trainguard checkpoint list|verify|restore`: output and exit codes a script can rely on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainguard.cli import main
from trainguard.runtime.checkpoint import CheckpointManager


@pytest.fixture
def run_dir(tmp_path, key_file) -> Path:
    """step_1 (stable), step_2, step_3 (a flipped byte)."""
    manager = CheckpointManager(tmp_path / "run", key_file=key_file, keep_last=5)
    for step in (1, 2, 3):
        manager.save(step, {"model": {"w": torch.full((1000,), float(step))}}, stable=step == 1)
    model = tmp_path / "run" / "checkpoints" / "step_3" / "__0_0.distcp"
    data = bytearray(model.read_bytes())
    data[-200] ^= 0xFF
    model.write_bytes(bytes(data))
    return tmp_path / "run"


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(["checkpoint", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_list_prints_a_table_with_the_status_of_each(run_dir, key_file, capsys):
    code, out, _ = cli(capsys, "list", run_dir, "--key-file", key_file)
    assert code == 0
    key_line, header, *rows = out.strip().splitlines()
    assert key_line.startswith(f"key in use: {key_file} (id ") and key_line.endswith(")")   # what --key-file to pass
    assert header.split() == ["STEP", "STABLE", "SIZE", "AGE", "STATUS"]
    assert [r.split()[:2] for r in rows] == [["1", "yes"], ["2", "no"], ["3", "no"]]
    assert rows[0].endswith(" ok") and "hash mismatch: __0_0.distcp" in rows[2]
    code, out, _ = cli(capsys, "list", run_dir, "--key-file", key_file, "--json")
    assert len(json.loads(out)["key_id"]) == 16
    listed = json.loads(out)["checkpoints"]
    assert [(c["step"], c["ok"], c["code"]) for c in listed] == [(1, True, "ok"), (2, True, "ok"),
                                                                 (3, False, "hash_mismatch")]
    code, out, _ = cli(capsys, "list", run_dir, "--key-file", key_file, "--fast", "--json")
    assert [c["ok"] for c in json.loads(out)["checkpoints"]] == [True, True, True]  # sizes only: a flip hides


def test_verify_exit_codes(run_dir, key_file, tmp_path, capsys):
    code, out, _ = cli(capsys, "verify", run_dir, "--key-file", key_file)
    assert code == 1 and "step_1: ok" in out and "step_3: FAILED: hash mismatch" in out
    assert cli(capsys, "verify", run_dir, "--key-file", key_file, "--step", 2)[0] == 0
    code, out, _ = cli(capsys, "verify", run_dir, "--key-file", key_file, "--step", 3, "--json")
    assert code == 1 and json.loads(out)["ok"] is False
    code, _, err = cli(capsys, "verify", run_dir, "--key-file", key_file, "--step", 9)
    assert code == 2 and "no step_9" in err
    (tmp_path / "empty").mkdir()
    code, _, err = cli(capsys, "verify", tmp_path / "empty", "--key-file", key_file)
    assert code == 2 and "no checkpoints" in err
    code, _, err = cli(capsys, "verify", run_dir, "--key-file", tmp_path / "nokey")
    assert code == 2 and "no checkpoint key" in err and not (tmp_path / "nokey").exists()
    with pytest.raises(SystemExit) as usage:
        main(["checkpoint", "verify"])
    assert usage.value.code == 2


def test_restore_picks_the_newest_verified_and_sets_newer_ones_aside(run_dir, key_file, capsys):
    code, out, _ = cli(capsys, "restore", run_dir, "--key-file", key_file, "--json")
    report = json.loads(out)
    assert code == 0 and report["step"] == 2
    assert [s["code"] for s in report["skipped"]] == ["hash_mismatch"]
    assert len(report["superseded"]) == 1 and "superseded/step_3-" in report["superseded"][0]
    # a resumed run now finds step_2, and nothing is left that fails
    assert CheckpointManager(run_dir, key_file=key_file).latest_verified().step == 2
    assert cli(capsys, "verify", run_dir, "--key-file", key_file)[0] == 0


def test_restore_a_given_step_pins_it_or_exports_it(run_dir, key_file, tmp_path, capsys):
    assert cli(capsys, "restore", run_dir, "--key-file", key_file, "--step", 3)[0] == 1
    code, out, _ = cli(capsys, "restore", run_dir, "--key-file", key_file, "--step", 1, "--to", tmp_path / "new")
    assert code == 0 and f"a run resumed on {tmp_path / 'new'} starts from step_1" in out
    exported = CheckpointManager(tmp_path / "new", key_file=key_file)
    ckpt, state = exported.load_latest()
    assert ckpt.step == 1 and torch.equal(state["model"]["w"], torch.full((1000,), 1.0))
    assert CheckpointManager(run_dir, key_file=key_file).steps() == [1, 2, 3]  # --to leaves the source alone
    code, out, _ = cli(capsys, "restore", run_dir, "--key-file", key_file, "--step", 1)
    assert code == 0 and out.count("set aside") == 2
    assert CheckpointManager(run_dir, key_file=key_file).steps() == [1]


def test_restore_when_nothing_verifies_exits_1(run_dir, key_file, capsys):
    for step in (1, 2):
        (run_dir / "checkpoints" / f"step_{step}" / "optim.pt").write_bytes(b"")  # not in the manifest: fine
        (run_dir / "checkpoints" / f"step_{step}" / "manifest.json").write_text("[]")
    code, out, _ = cli(capsys, "restore", run_dir, "--key-file", key_file)
    assert code == 1 and "no checkpoint verifies" in out and out.count("skipped") == 3


def test_the_installed_command_uses_the_same_exit_codes(run_dir, key_file):
    trainguard = Path(sys.executable).with_name("trainguard")
    result = subprocess.run([str(trainguard), "checkpoint", "verify", str(run_dir), "--key-file", str(key_file)],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "TRAINGUARD_LOG_JSON": "1"})
    assert result.returncode == 1 and "step_3: FAILED" in result.stdout
