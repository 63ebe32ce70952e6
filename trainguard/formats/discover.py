"""What a folder given to `replay`, `report` or `diagnose` stands for: its logs, found here once for all three.

In order, the first that finds any:

1. **TLS logs** by name (`tls.run_logs`): ``RUN/tls/`` of a run directory, else the folder's own
   ``rank-*.jsonl*`` / ``node-*.jsonl*``.
2. **Any other** ``*.jsonl*`` file in that folder (TLS under another name, e.g. what `convert` wrote).
3. **Other tools' logs, detected by content** (trainguard.formats.detect; a file that is TLS is not one):
   the folder's own TensorBoard event files, ``trainer_state.json`` (``*trainer_state*.json``), ``*.log``,
   SLURM's ``*.out`` / ``*.err`` and ``*.txt`` files (several rank files of one run among them: replay
   keeps one copy of each step); else the layout
   a Hugging Face Trainer leaves in its ``output_dir``: the newest ``checkpoint-N/trainer_state.json`` (each
   holds the whole ``log_history`` so far: the older ones would repeat its steps); else TensorBoard event
   files under ``runs/*/`` (the Trainer's default ``logging_dir``). The Trainer's ``runs/`` events beside a
   checkpoint's state are the same steps again, so they are read only where there is no state.

Other tools' logs are one run here, as rank 0's steps (the readers turn them into TLS records line by line).
`replay` looks further (`within`): a folder of exports may hold several runs, and its subfolders (a run
directory each, a Trainer's output folder each) theirs; `trainguard.formats.identity` then says which of
them are one run.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from trainguard import formats, rundir, tls

LOG_PATTERNS = ("*.jsonl", "*.jsonl.*")   # rank-0.jsonl, node-a.jsonl.3.gz, x.jsonl.zst
OTHER_PATTERNS = ("events.out.tfevents.*", "trainer_state.json", "*trainer_state*.json", "*.log", "*.out",
                  "*.err", "*.txt")
HF_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
HF_STATE = "trainer_state.json"
TENSORBOARD_RUNS = "runs/*/events.out.tfevents.*"
FILE = "file"       # the kind of a *.jsonl file without a rank-/node- name


def logs_folder(folder: str | os.PathLike) -> Path:
    """Where a folder keeps its logs: ``RUN/tls/`` of a run directory, else the folder itself."""
    root = Path(folder)
    return rundir.tls_dir(root) if rundir.tls_dir(root).is_dir() else root


def run_logs(folder: str | os.PathLike) -> list[tls.LogFile]:
    """The logs `folder` stands for, in reading order (see the module's doc); empty when it holds none."""
    where = logs_folder(folder)
    return tls_logs(where) or [tls.LogFile("rank", "0", 0, path) for path in other_logs(where)]


class SeveralRuns(ValueError):
    """A folder given to `report` or `diagnose` holds other tools' logs of unrelated runs: drawn as one run
    they would be one loss curve jumping between fine-tunes (`replay` reads them apart)."""


def one_run_logs(folder: str | os.PathLike) -> list[tls.LogFile]:
    """`run_logs`, for a command that shows one run: SeveralRuns when other tools' logs there are several
    runs by `trainguard.formats.identity` (its files named, by run)."""
    where = logs_folder(folder)
    found = tls_logs(where)
    if found:
        return found                  # TLS names its ranks and nodes: one run directory, one run
    others = other_logs(where)
    if len(others) > 1:
        from trainguard.formats import identity

        runs = identity.split(others)
        if len(runs) > 1:
            listed = "; ".join(identity.describe(runs))
            raise SeveralRuns(f"{folder}: holds the logs of {len(runs)} runs ({listed}): give a folder that holds "
                              f"one run's logs (`trainguard replay {folder}` reads each run apart)")
    return [tls.LogFile("rank", "0", 0, path) for path in others]


def tls_logs(folder: str | os.PathLike) -> list[tls.LogFile]:
    """The TLS logs of a folder (steps 1 and 2 of the module's doc): a run directory's, else its own."""
    where = logs_folder(folder)
    return tls.run_logs(where) or _jsonl_files(where)


# The subfolders a folder's own layout already accounts for (a Trainer's checkpoints and logging_dir, a run
# directory's parts): not separate exports.
OWN_LAYOUT = re.compile(r"^(checkpoint-\d+|runs|tls|checkpoints|control|incidents|agent)$")


def within(folder: str | os.PathLike) -> tuple[list[Path], list[Path]]:
    """What a folder without TLS logs of its own holds, one level down too (a folder of exports):
    (its subfolders that are run directories or hold TLS logs, other tools' logs here and in its other
    subfolders, each subfolder as `other_logs` reads it: a Trainer output folder's newest state).
    Subfolders in name order; one level only."""
    root = Path(folder)
    tls_folders, others = [], list(other_logs(root))
    for sub in sorted(p for p in root.iterdir() if p.is_dir() and not OWN_LAYOUT.match(p.name)) \
            if root.is_dir() else ():
        if tls_logs(sub):
            tls_folders.append(sub)
        else:
            others += other_logs(sub)
    return tls_folders, others


def other_logs(folder: str | os.PathLike) -> list[Path]:
    """Other tools' logs in `folder`: its own, else a Hugging Face output folder's (the module's doc)."""
    root = Path(folder)
    if not root.is_dir():
        return []
    return (_detected(p for pattern in OTHER_PATTERNS for p in root.glob(pattern))
            or _newest_checkpoint_state(root) or _detected(root.glob(TENSORBOARD_RUNS)))


def _jsonl_files(folder: Path) -> list[tls.LogFile]:
    found = sorted({p for pattern in LOG_PATTERNS for p in folder.glob(pattern) if p.is_file()})
    return [tls.LogFile(FILE, path.name, 0, path) for path in found]


def _newest_checkpoint_state(root: Path) -> list[Path]:
    steps = sorted((int(match.group(1)), path) for path in root.iterdir()
                   if (match := HF_CHECKPOINT.match(path.name)) and path.is_dir())
    for _, checkpoint in reversed(steps):
        state = _detected([checkpoint / HF_STATE])
        if state:
            return state
    return []


def _detected(paths) -> list[Path]:
    return sorted({p for p in paths if p.is_file() and formats.detect(p) != formats.TLS})
