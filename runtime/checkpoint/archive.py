"""What the commands do with a run's checkpoints beside training: set aside the checkpoints signed with
another key (`trainguard train --start-over`), import a verified checkpoint of another run, export one
(`trainguard checkpoint restore --to`, `trainguard checkpoint export`). Each verifies what it wrote."""

from __future__ import annotations

from pathlib import Path

from trainguard.runtime.checkpoint import compress as compress_mod
from trainguard.runtime.checkpoint import manifest as mf
from trainguard.runtime.checkpoint import saving, store
from trainguard.runtime.checkpoint.manager import CheckpointManager
from trainguard.runtime.checkpoint.manifest import CheckpointError
from trainguard.runtime.checkpoint.restore import Checkpoint


def set_aside_foreign(manager: CheckpointManager) -> list[Path]:
    """--start-over: move the checkpoints signed with another key to checkpoints/invalid/ (kept)."""
    return [manager._retention.quarantine(path, mf.WRONG_KEY, f"signed with key id {key}, not {manager.key_id}")
            for path, key in manager._dirs.foreign()]


def import_checkpoint(manager: CheckpointManager, ckpt: Checkpoint) -> Checkpoint:
    """Copy a verified checkpoint (of another run) into `manager`'s run as its newest, and verify the copy:
    a run started on that run directory resumes from it."""
    manager.wait()
    with manager._lock:
        final = manager.root / ckpt.path.name
        store.copy_dir(ckpt.path, [mf.MANIFEST_NAME, *ckpt.manifest["files"]], final)
        manager.supersede_after(ckpt.step, pinned=True)
        result = manager._dirs.verify(final, deep=True)
    if not result.ok:
        raise CheckpointError(f"{final}: the copy does not verify: {result.reason}", code=result.code, path=final)
    return Checkpoint.of(result)


def export_checkpoint(manager: CheckpointManager, ckpt: Checkpoint, target: Path, *,
                      compress: str = compress_mod.FP16_ZLIB) -> Checkpoint:
    """Write a verified checkpoint's state as an *export* under `target` (a run directory) with `compress`
    (fp16-zlib: lossy, its largest absolute and relative error in the manifest). A resume never picks an
    export."""
    state = manager.load(ckpt)
    out = CheckpointManager(target, key_file=manager.key_path, log=manager.events.log)
    final = out.root / ckpt.path.name
    meta = {**ckpt.manifest.get("meta", {}), "exported_from": str(ckpt.path)}
    saving.write_export(ckpt.step, ckpt.stable, state, meta, final, out._key, out.key_id, compress=compress)
    result = out._dirs.verify(final, deep=True)
    if not result.ok:
        raise CheckpointError(f"{final}: the export does not verify: {result.reason}", code=result.code)
    return Checkpoint.of(result)
