"""Checkpoint drill: save two checkpoints, corrupt the newer, restore — the restore must pick the older.

It runs the trainer's own `CheckpointManager` (hashing, signing, atomic publish, verified restore) and
the trainer's own `corrupt-checkpoint` fault (one byte flipped in the largest file), in a temporary run
directory on the checkpoint filesystem when one is given, with a throwaway signing key, so the user's
key and checkpoints are never touched. A restore that returns nothing, the wrong step, or different
tensors fails the drill with the manager's own reasons.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable

import structlog

from trainguard import event_types, rundir
from trainguard.runtime.preflight_result import FAIL, PASS, CheckResult

GOOD, BAD = 1, 2


def _state(step: int) -> dict:
    import torch

    generator = torch.Generator().manual_seed(step)
    return {"model": {"weight": torch.randn(256, 256, generator=generator)},
            "optim": {"step": step, "exp_avg": torch.randn(256, generator=generator)},
            "data": {"consumed": step * 8}}


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def run_drill(base: Path | None = None, corrupt_steps: Iterable[int] = (BAD,)) -> CheckResult:
    """`corrupt_steps`: which of the two checkpoints get a flipped byte (the good one too, to see it fail)."""
    from trainguard.runtime.checkpoint import CheckpointManager
    from trainguard.trainer.faults import FaultInjector

    events: list[dict] = []
    try:
        if base is not None:
            base.mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix=".preflight-drill-", dir=base))
    except OSError as exc:
        return CheckResult("checkpoint_drill", FAIL, f"drill could not run: cannot make its directory under "
                                                     f"{base}: {exc.strerror or exc}", {"directory": str(base)})

    def sink(event_type: str, /, **fields: Any) -> None:
        events.append({"type": event_type, **fields})

    try:
        # The drill's refusals are expected: they go to its result, not to the log as warnings.
        quiet = structlog.wrap_logger(structlog.ReturnLogger())
        manager = CheckpointManager(root, key_file=root / "drill.key", keep_last=2, on_event=sink, log=quiet)
        faults = FaultInjector([f"corrupt-checkpoint@{step}:0" for step in sorted(set(corrupt_steps))],
                               root, rank=0, emit=sink)
        for step in (GOOD, BAD):
            handle = manager.save(step, _state(step), stable=True)
            faults.after_checkpoint(step, handle.path, wait=handle.wait)
        restored = manager.load_latest()
        manager.close()
        corrupted = [e for e in events if e["type"] == event_types.FAULT_INJECTED]
        refused = [{"step": e.get("step"), "code": e.get("code"),
                    "reason": str(e.get("reason", "")).removeprefix(f"{e.get('path')}: ")}
                   for e in events if e["type"] == event_types.CHECKPOINT_INVALID]
        details = {"directory": str(root.parent), "corrupted": [{"step": e["step"], "file": Path(e["file"]).name,
                                                                  "offset": e["offset"]} for e in corrupted],
                   "refused": refused}
        return _verdict(restored, details)
    except Exception as exc:   # any failure of the machinery is the drill's finding, not a crash
        return CheckResult("checkpoint_drill", FAIL, f"drill could not run: {type(exc).__name__}: {exc}",
                           {"directory": str(root.parent)})
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _verdict(restored: Any, details: dict) -> CheckResult:
    reasons = "; ".join(f"{rundir.step_dir_name(r['step'])}: {r['reason']}" for r in details["refused"]) or "none given"
    if restored is None:
        return CheckResult("checkpoint_drill", FAIL, "restore found no verified checkpoint after corruption "
                                                     f"(refused: {reasons})", details)
    ckpt, state = restored
    details["restored_step"] = ckpt.step
    if ckpt.step != GOOD:
        return CheckResult("checkpoint_drill", FAIL, f"restore picked {rundir.step_dir_name(ckpt.step)}, expected the intact "
                                                     f"{rundir.step_dir_name(GOOD)} (refused: {reasons})", details)
    if not _same(state, _state(GOOD)):
        return CheckResult("checkpoint_drill", FAIL, f"restored {rundir.step_dir_name(GOOD)} loads, but its tensors differ from "
                                                     "what was saved", details)
    if not details["refused"]:
        return CheckResult("checkpoint_drill", FAIL, f"restore picked {rundir.step_dir_name(GOOD)} without refusing the corrupted "
                                                     f"{rundir.step_dir_name(BAD)}: corruption went unnoticed", details)
    return CheckResult("checkpoint_drill", PASS, f"corrupted {rundir.step_dir_name(BAD)} refused ({reasons}); restored {rundir.step_dir_name(GOOD)} "
                                                 "intact", details)
