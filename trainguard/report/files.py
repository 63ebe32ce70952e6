"""Where a run directory keeps its logs and checkpoints: TLS files in reading order, checkpoint manifests."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from trainguard import rundir
from trainguard.formats import discover

_ROTATED = re.compile(r"^(?P<base>.+\.jsonl)(?:\.(?P<n>\d+))?(?:\.gz|\.zst)?$")


@dataclass
class Checkpoint:
    name: str
    step: int | None
    manifest: dict | None
    error: str | None = None


def log_files(run_dir: Path) -> tuple[list[Path], list[Path]]:
    """(node logs, rank logs) in reading order: a log's rotated parts oldest first, then the live file.

    The logs are those `trainguard.formats.discover.run_logs` finds (the one discovery replay and diagnose
    use): a folder without TLS logs that holds another tool's (TensorBoard, trainer_state.json, a Hugging
    Face output folder's checkpoints, Megatron or torchtitan lines) has those as its rank logs, one run as
    rank 0's steps (the readers turn them into TLS records line by line)."""
    found = discover.one_run_logs(run_dir)      # SeveralRuns for a folder of unrelated runs
    return [log.path for log in found if log.kind == "node"], [log.path for log in found if log.kind != "node"]


def rank_of(path: Path) -> int | None:
    match = re.match(r"rank-(\d+)\.jsonl", path.name)
    if match:
        return int(match.group(1))
    return None if _ROTATED.match(path.name) else 0     # another tool's log: the run's one rank


def host_of(path: Path) -> str:
    return _ROTATED.match(path.name).group("base")[len("node-"):-len(".jsonl")]


def read_checkpoints(run_dir: Path) -> list[Checkpoint]:
    root = rundir.checkpoints_dir(run_dir)
    found = []
    for path in sorted(root.glob(f"{rundir.STEP_DIR_PREFIX}*")) if root.is_dir() else []:
        step = rundir.step_of_dir(path.name)
        if step is None or not path.is_dir():
            continue
        manifest, error = None, None
        try:
            manifest = rundir.checkpoint_manifest(path)
        except FileNotFoundError:
            error = "no manifest.json (incomplete or not verified)"
        except (ValueError, OSError) as exc:     # a FIFO or a device named by safe_read, garbage, a wrong step
            error = f"unreadable manifest.json: {exc}"
        found.append(Checkpoint(path.name, step, manifest, error))
    return sorted(found, key=lambda c: c.step)
