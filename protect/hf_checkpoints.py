"""The Trainer's own `checkpoint-N` folders, signed and verified with the run's checkpoint key.

After the Trainer writes a folder (`on_save`), `sign_folder` puts a trainguard manifest into it
(`manifest.json`: every file's SHA-256 and size, the step, HMAC-SHA256 signed, the format of
trainguard.runtime.checkpoint.manifest). `verify_folder` checks it before the folder is trusted, and
`latest_verified` picks the newest folder that passes, for `trainer.train(resume_from_checkpoint=...)`.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from pathlib import Path

from trainguard import safe_read
from trainguard.tls import format_timestamp
from trainguard.runtime.checkpoint import keys
from trainguard.runtime.checkpoint import manifest as mf
from trainguard.runtime.checkpoint.manager import versions
from trainguard.runtime.checkpoint.manifest import CheckpointError, FileEntry, VerifyResult
from trainguard.runtime.checkpoint.verification import check_file, read_manifest

FOLDER = re.compile(r"\Acheckpoint-([0-9]+)\Z")
HASH_CHUNK = 1 << 20


def step_of(folder: Path) -> int | None:
    match = FOLDER.match(folder.name)
    return int(match.group(1)) if match else None


def _entry(path: Path, name: str) -> FileEntry:
    sha = hashlib.sha256()
    with safe_read.open_file(path, what="checkpoint file") as handle:
        for chunk in iter(lambda: handle.read(HASH_CHUNK), b""):
            sha.update(chunk)
    return FileEntry(name, sha.hexdigest(), path.stat().st_size)


def sign_folder(folder: str | os.PathLike, key_file: str | None = None) -> Path:
    """Sign every file of a Trainer checkpoint folder (sub-folders included, by relative path)."""
    folder = Path(folder)
    key = keys.load_key(keys.resolve_key_path(key_file))
    files = [_entry(path, path.relative_to(folder).as_posix()) for path in sorted(folder.rglob("*"))
             if path.is_file() and path.name != mf.MANIFEST_NAME]
    body = mf.build(step=step_of(folder) or 0, files=files, stable=True, world_size=1,
                    created_at=format_timestamp(time.time()), versions=versions(), meta={"source": "transformers"})
    target = folder / mf.MANIFEST_NAME
    partial = target.with_name(target.name + ".partial")
    partial.write_bytes(mf.encode(mf.sign(body, key, keys.key_id(key))))
    os.replace(partial, target)
    return target


def verify_folder(folder: str | os.PathLike, key_file: str | None = None) -> VerifyResult:
    """Manifest, signature, the step in the folder's name, every file's size and SHA-256."""
    folder = Path(folder)
    step = step_of(folder)
    try:
        manifest = read_manifest(folder)
    except CheckpointError as exc:
        return VerifyResult.refused(folder, exc.code, str(exc), step)
    key = keys.load_key(keys.resolve_key_path(key_file), create=False)
    problem = mf.check_signature(manifest, key, keys.key_id(key))
    if problem is None and manifest["step"] != step:
        problem = mf.STEP_MISMATCH, f"folder {folder.name} holds a manifest for step {manifest['step']}"
    for entry in mf.entries(manifest) if problem is None else ():
        problem = check_file(folder / entry.name, entry, True)
        if problem:
            break
    if problem:
        return VerifyResult.refused(folder, *problem, step)
    return VerifyResult(folder, True, mf.OK, "ok", step, manifest)


def latest_verified(output_dir: str | os.PathLike, key_file: str | None = None) -> Path | None:
    """The newest `checkpoint-N` under `output_dir` that verifies, or None."""
    folders = sorted((p for p in Path(output_dir).glob("checkpoint-*") if step_of(p) is not None),
                     key=step_of, reverse=True)
    return next((folder for folder in folders if verify_folder(folder, key_file).ok), None)
