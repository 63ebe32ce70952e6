"""RUN/checkpoints/: which checkpoints are there, and whether each verifies under the key in use.

    step_<N>/            a checkpoint: its files and the signed manifest.json
    invalid/<name>-<ns>/  one that did not verify, moved aside with reason.json (retention, --start-over)
    superseded/<name>-<ns>/   one newer than a rollback, moved aside (`Retention.supersede_after`)
    status.json          the last save's outcome (`status.py`)
    .tmp-*, .trash-*     a save or a deletion in progress (`store.py`)

`CheckpointDirs` lists the step directories newest first and verifies one through `verification.verify_dir`
(the one verification); the other components (saving, retention, restore) see the directory only through it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from trainguard import rundir
from trainguard.runtime.checkpoint import keys, verification
from trainguard.runtime.checkpoint import manifest as mf
from trainguard.runtime.checkpoint.manifest import CheckpointError, VerifyResult

SUPERSEDED = "superseded"
INVALID = "invalid"          # checkpoints that did not verify, moved aside by retention (never deleted)
STATUS_FILE = rundir.CHECKPOINT_STATUS_FILE  # the last save's outcome, for `trainguard status`


class KeyMismatchError(CheckpointError):
    """The run directory holds checkpoints signed with another key and none with this one."""


class CheckpointDirs:
    def __init__(self, root: Path, key: bytes, key_id: str):
        self.root, self.key_id = root, key_id
        self._key = key

    def path_of(self, step: int) -> Path:
        return self.root / rundir.step_dir_name(step)

    def newest_first(self) -> Iterator[tuple[int, Path]]:
        """(step, path) of every step_<N> directory, newest first."""
        found = []
        for path in self.root.iterdir() if self.root.is_dir() else ():
            step = rundir.step_of_dir(path.name)
            if step is not None and path.is_dir():
                found.append((step, path))
        return iter(sorted(found, reverse=True))

    def newest_name(self) -> str | None:
        """The newest step directory's name, None when there is none or the directory cannot be read."""
        try:
            return next((path.name for _, path in self.newest_first()), None)
        except OSError:
            return None

    def verify(self, path: Path, *, deep: bool) -> VerifyResult:
        return verification.verify_dir(path, self._key, self.key_id, deep=deep)

    def verify_and_load(self, path: Path, **how: Any) -> tuple[VerifyResult, dict | None]:
        """`verify` in full, keeping the state it loaded (`verification.verify_and_load`: into=, map_location=,
        agree=, process_group=)."""
        return verification.verify_and_load(path, self._key, self.key_id, deep=True, **how)

    def foreign(self) -> list[tuple[Path, str]]:
        """(path, key id) of every checkpoint whose manifest names another signing key than ours."""
        found = []
        for _, path in self.newest_first():
            try:
                manifest = verification.read_manifest(path)
            except CheckpointError:
                continue
            if manifest["key_id"] != self.key_id:
                found.append((path, manifest["key_id"]))
        return found

    def check_key(self, key_path: Path) -> None:
        """Refuse to train on checkpoints signed under another key: a silent restart from step 0 would
        then let retention destroy them. Raises KeyMismatchError saying what to do."""
        foreign = self.foreign()
        if not foreign or any(self.verify(path, deep=False).ok for _, path in self.newest_first()):
            return
        ids = sorted({key for _, key in foreign})
        raise KeyMismatchError(
            f"{self.root}: its checkpoints ({', '.join(p.name for p, _ in foreign[:5])}) are signed with key "
            f"id {', '.join(ids)}, but the key in use ({key_path}) has id {self.key_id}. Point at the "
            f"key that signed them with --key-file or {keys.ENV_VAR} (its id is printed by "
            f"`trainguard checkpoint list`), or pass --start-over to set them aside under "
            f"{self.root / INVALID} and train from scratch", code=mf.WRONG_KEY, path=self.root)
