"""`checkpoint list`/`verify` beside a live run's retention, and what retention may delete after a
`checkpoint restore` (docs/checkpoints.md: "Nothing is deleted")."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from trainguard.cli import main
from trainguard.runtime.checkpoint import CheckpointManager
from trainguard.runtime.checkpoint.directory import SUPERSEDED
from trainguard.runtime.checkpoint.restore import Restorer


def _save(manager: CheckpointManager, *steps: int, stable: tuple = ()) -> None:
    for step in steps:
        manager.save(step, {"model": {"w": torch.full((100,), float(step))}}, stable=step in stable)


def test_a_checkpoint_removed_while_listed_is_gone_not_a_traceback(tmp_path, key_file, monkeypatch, capsys):
    """Retention of a running save removes a checkpoint between the listing and the look: list and verify
    raised FileNotFoundError (exit 1, "a checkpoint failed"); now the row says `gone` and verify passes."""
    run = tmp_path / "run"
    _save(CheckpointManager(run, key_file=key_file, keep_last=5), 1, 2, 3)
    verify = Restorer.list.__globals__["info_of"]

    def retention_meanwhile(step, path, result):
        if path.name == "step_2":
            shutil.rmtree(path)           # as the live run's retention does, in another process
        return verify(step, path, result)

    monkeypatch.setitem(Restorer.list.__globals__, "info_of", retention_meanwhile)
    code = main(["checkpoint", "verify", str(run), "--key-file", str(key_file)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "step_1: ok" in out and "step_2: gone: removed while listed" in out and "step_3: ok" in out
    monkeypatch.setitem(Restorer.list.__globals__, "info_of",
                        lambda step, path, result: (_ for _ in ()).throw(FileNotFoundError(path)))
    code = main(["checkpoint", "list", str(run), "--key-file", str(key_file), "--json"])
    rows = json.loads(capsys.readouterr().out)["checkpoints"]
    assert code == 0 and {row["code"] for row in rows} == {"gone"}


def test_what_a_restore_sets_aside_is_never_deleted_and_every_pruning_is_logged(tmp_path, key_file, capsys):
    """After `checkpoint restore`, the next runs deleted the superseded, verified checkpoints with no event
    and no log line. Now a restore's are kept for good; a rollback's past keep_last are deleted, each with
    a `checkpoint_deleted` event (reason "superseded")."""
    run = tmp_path / "run"
    manager = CheckpointManager(run, key_file=key_file, keep_last=1)
    _save(manager, 1, 2, 3, stable=(1,))
    set_aside = []
    for _ in range(2):              # a person restores step_1 twice, the run saving in between
        capsys.readouterr()         # the saves' log lines
        assert main(["checkpoint", "restore", str(run), "--key-file", str(key_file), "--step", "1", "--json"]) == 0
        set_aside += json.loads(capsys.readouterr().out)["superseded"]
        _save(CheckpointManager(run, key_file=key_file, keep_last=1), 2, 3)
    assert len(set_aside) == 2                                  # step_3 each time (retention took step_2)
    events: list[dict] = []
    manager = CheckpointManager(run, key_file=key_file, keep_last=1, on_event=lambda kind, **f: events.append(
        {"type": kind, **f}))
    _save(manager, 2, 3, 4)                                     # the next run saves (and retention runs)
    assert [path for path in set_aside if not Path(path).is_dir()] == []      # the restore's, all kept
    for step in (5, 6, 7):                                      # rollbacks set aside what a run saved
        _save(manager, step)
        manager.supersede_after(step - 1)
    _save(manager, 8)
    superseded = list((run / "checkpoints" / SUPERSEDED).iterdir())
    by_rollback = [p for p in superseded if str(p) not in set_aside]
    assert len(by_rollback) == 1                                # keep_last of a rollback's
    deleted = [e for e in events if e["type"] == "checkpoint_deleted" and e.get("reason") == "superseded"]
    assert len(deleted) == 2 and all(Path(e["path"]).parent.name == SUPERSEDED for e in deleted)
    assert all(Path(path).is_dir() and path.endswith("-restore") for path in set_aside)
