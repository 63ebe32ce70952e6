"""Which of several other tools' logs are one run: ranks' copies and checkpoint copies of one run are read
together (or the newest alone), logs of unrelated runs apart. User guide: docs/replay.md ("Several runs in
one folder").

A folder of exports (five `trainer_state.json` of five fine-tunes, the SLURM outputs of several jobs) is a
normal thing to point `replay` at, and reading such files as the ranks of one run merges unrelated loss
curves into one: the guard then sees one run's loss against another's and reports spikes that never
happened. TLS names its ranks (``rank-<r>.jsonl``, a ``rank`` in every record); other tools' logs do not in
any one way (SLURM's ``%t``, ``[default7]:`` tags, ``attempt_0/<rank>/stdout.log``, an event file per
process), so what they are is read from what they hold:

- **A `trainer_state.json` is one run's whole history.** The Trainer saves it into every
  ``checkpoint-N/``, each a prefix of the next: a state whose ``log_history`` is the first entries of
  another's is an earlier copy of that run, passed over (`Copy`) for the longest; any other two states
  are two runs (two fine-tunes resumed from the same checkpoint diverge after it: two runs). So is a state
  that `trainguard convert` wrote as TLS (its first line says ``"clock": "none"``), line for entry.
- **Text logs and event files of one run carry the same steps with the same losses**: the loss is
  global, every rank prints the same number for a step. Two files of one format are one run when
  they share at least one training step and agree on the loss at every step they share (`same_losses`:
  equal to float32's precision, NaN equal to NaN); files with no step in common, or one step that
  disagrees, are two runs. Two runs of the same model and data agree on their first steps and part at a
  later one: every shared step is compared, never a sample.
- **One TensorBoard writer's files are one run** whatever they hold: ``events.out.tfevents.<time>.
  <host>.<pid>.<n>`` from the same host and process (the Trainer's training events and the evaluation
  file it writes after training share no step).
- Logs of different formats are different runs: they would be one run written twice (a Trainer's
  state and its event file), which is read best once, and a clockless state merged with a timed log has no
  common clock.

What a run that stopped and was requeued writes (a second SLURM output that resumes from a checkpoint)
shares no step with the first or re-does steps with other losses: two runs here, each replayed alone, as
the live guard starts afresh after a restart; `replay --one-run` reads every input as one run.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from trainguard import formats, safe_read

# A trainer_state.json as `trainguard convert` wrote it (TLS whose first line says "clock": "none"): still one
# run's whole history, so a folder of converted states is told apart as the states are.
CONVERTED_STATE = "tls_converted_trainer_state"
# A float32 loss (TensorBoard) beside its float64 print agrees to ~6e-8; a printed `%.6E` to 5e-7.
LOSS_RELATIVE_TOLERANCE = 1e-6
# torch's and TensorFlow's SummaryWriter: events.out.tfevents.<time>.<hostname>.<pid>.<uid>[.v2]; a host
# name may hold dots, so the pid and uid are taken from the end.
EVENT_FILE = re.compile(r"^events\.out\.tfevents\.(?P<time>\d+)\.(?P<host>.+)\.(?P<pid>\d+)\.(?P<uid>\d+)(?:\.v2)?$")


@dataclass(frozen=True)
class Copy:
    """A `trainer_state.json` passed over: its history is the first `entries` of `of`'s `of_entries`."""
    path: Path
    of: Path
    entries: int
    of_entries: int
    unit: str = "log_history entries"      # "records" for a converted state's lines

    def __str__(self) -> str:
        same = "the same history as" if self.entries == self.of_entries else "an earlier copy of the run in"
        return (f"{self.path}: passed over, {same} {self.of} (its {self.entries:,} {self.unit} are the "
                f"first of {self.of_entries:,} there): the run is read once, from the longest")


@dataclass(frozen=True)
class Run:
    """Files read together as one run, in the order given; `copies`: files passed over for them."""
    files: tuple[Path, ...]
    kind: str
    why: str = ""                       # why several files are one run ("" for one file)
    copies: tuple[Copy, ...] = field(default=())

    @property
    def name(self) -> str:
        return str(self.files[0]) + (f" (+{len(self.files) - 1} more)" if len(self.files) > 1 else "")


def split(files: list[Path], losses: Callable[[Path], dict[int, float]] | None = None) -> list[Run]:
    """`files` (other tools' logs, by content not TLS) as runs, in the order of each run's first file.

    Reads every `trainer_state.json` among them, and the training losses of the text logs and event files of
    a format that holds several (one file of a format is its own run, never read here) through `losses`
    (path -> {step: loss}; default `training_losses`, the format's reader: replay passes its conversions,
    so a file is read once)."""
    kinds = {path: kind_of(path) for path in files}
    groups = _Groups(files)
    copies: dict[Path, Copy] = {}
    for kind in dict.fromkeys(kinds.values()):
        same = [path for path in files if kinds[path] == kind]
        if len(same) < 2:
            continue
        if kind in HISTORIES:
            copies.update(_state_copies(same, HISTORIES[kind], "records" if kind == CONVERTED_STATE
                                        else "log_history entries"))
        elif kind != formats.LFS_POINTER:
            _join_by_content(same, groups, losses or training_losses)
    runs = []
    for members, why in groups.runs(skip=copies):
        runs.append(Run(tuple(members), kinds[members[0]], why,
                        tuple(copy for copy in copies.values() if copy.of in members)))
    return runs


# ------------------------------------------------------------------------------- trainer_state.json

def kind_of(path: Path) -> str:
    """The format of a log (formats.detect), a converted trainer_state.json told apart from other TLS."""
    kind = formats.detect(path)
    return CONVERTED_STATE if kind == formats.TLS and formats.says_no_clock(path) else kind


def _state_copies(states: list[Path], history_of: Callable[[Path], list[int] | None],
                  unit: str) -> dict[Path, Copy]:
    """Each state whose history is a prefix of a longer (or, for the later of two equal, an earlier
    given) state's, as a copy of the longest state that holds it. Only states that open with the same
    entry are compared (a folder of a thousand unrelated exports is not a million comparisons)."""
    histories = {path: history_of(path) for path in states}
    by_opening: dict[int, list[Path]] = {}
    for path in sorted((path for path in states if histories[path]), key=lambda path: -len(histories[path])):
        by_opening.setdefault(histories[path][0], []).append(path)      # stable: equal ones in the order given
    copies: dict[Path, Copy] = {}
    for by_length in by_opening.values():
        for index, path in enumerate(by_length):
            mine = histories[path]
            holder = next((other for other in by_length[:index] if histories[other][:len(mine)] == mine), None)
            if holder is not None:
                root = copies[holder].of if holder in copies else holder
                copies[path] = Copy(path, root, len(mine), len(histories[root]), unit)
    return copies


def _history(path: Path) -> list[int] | None:
    """A state's `log_history` entries, each as the hash of its canonical JSON text (so a NaN loss equals
    itself, and a 1 GiB state is held as a number an entry); None for a file that is not a readable state or
    holds no entry (an empty history is a prefix of every other: it names no run), which stays a run of its
    own (its reader names what is wrong)."""
    from trainguard.formats import hf_state

    try:
        state = json.loads(safe_read.read_bytes(path, hf_state.MAX_BYTES, "trainer_state.json"))
    except (OSError, ValueError, RecursionError):
        return None
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list) or not history:
        return None
    return [hash(json.dumps(entry, sort_keys=True)) for entry in history]


def _converted_history(path: Path) -> list[int] | None:
    """A converted state's records, each as the hash of its line (`convert` writes an entry's records the
    same way every time: a checkpoint's conversion is the first lines of the newest's); None as above."""
    from trainguard.formats import hf_state

    try:
        lines = safe_read.read_bytes(path, hf_state.MAX_BYTES, "TLS log").splitlines()
    except OSError:
        return None
    return [hash(line) for line in lines if line.strip()] or None


HISTORIES = {formats.HF_STATE: _history, CONVERTED_STATE: _converted_history}


# --------------------------------------------------------------------- text logs and event files

def _join_by_content(paths: list[Path], groups: "_Groups", losses_of: Callable[[Path], dict[int, float]]) -> None:
    writers: dict[tuple[str, str], Path] = {}
    for path in paths:
        match = EVENT_FILE.match(path.name)
        if match:
            writer = (match["host"], match["pid"])
            if writer in writers:
                groups.join(writers[writer], path, f"one TensorBoard writer's files (host {writer[0]}, "
                                                   f"pid {writer[1]})")
            writers.setdefault(writer, path)
    if len({groups.root(path) for path in paths}) < 2:
        return          # one writer's files, all of them: nothing left to tell apart
    losses = {path: losses_of(path) for path in paths}
    spans = {path: (min(found), max(found)) for path, found in losses.items() if found}
    for index, first in enumerate(paths):
        for second in paths[index + 1:]:
            if first not in spans or second not in spans or spans[first][1] < spans[second][0] \
                    or spans[second][1] < spans[first][0]:
                continue            # no step in common
            common = same_losses(losses[first], losses[second])
            if common:
                groups.join(first, second, f"the same loss at each of the {common:,} steps they share "
                                           "(ranks' copies of one run's steps)")


def training_losses(path: Path) -> dict[int, float]:
    """{step: loss} of a log's training records (as its reader maps them; problems are its replay's to name)."""
    losses: dict[int, float] = {}
    for item in formats.read(path):
        if isinstance(item, dict):
            metrics = item.get("metrics")
            step = item.get("step")
            if isinstance(metrics, dict) and isinstance(metrics.get("loss"), (int, float)) and step is not None:
                losses.setdefault(step, float(metrics["loss"]))
    return losses


def same_losses(first: dict[int, float], second: dict[int, float]) -> int:
    """How many steps the two share when they agree on the loss at every one of them; 0 when they share
    none or disagree at one (two runs)."""
    common = first.keys() & second.keys()
    for step in common:
        a, b = first[step], second[step]
        if not (a == b or (math.isnan(a) and math.isnan(b))
                or math.isclose(a, b, rel_tol=LOSS_RELATIVE_TOLERANCE)):
            return 0
    return len(common)


class _Groups:
    """Union-find over the files, with why each join was made (the first reason of a group is said)."""

    def __init__(self, files: list[Path]) -> None:
        self.files = list(files)
        self.parent = {path: path for path in files}
        self.why: dict[Path, str] = {}

    def root(self, path: Path) -> Path:
        while self.parent[path] != path:
            self.parent[path] = self.parent[self.parent[path]]
            path = self.parent[path]
        return path

    def join(self, first: Path, second: Path, why: str) -> None:
        a, b = self.root(first), self.root(second)
        if a == b:
            return
        keep, other = (a, b) if self.files.index(a) < self.files.index(b) else (b, a)
        self.parent[other] = keep
        self.why.setdefault(keep, self.why.pop(other, why))

    def runs(self, skip: dict) -> list[tuple[list[Path], str]]:
        members: dict[Path, list[Path]] = {}
        for path in self.files:
            if path not in skip:
                members.setdefault(self.root(path), []).append(path)
        return [(group, self.why.get(root, "") if len(group) > 1 else "") for root, group in members.items()]


def describe(runs: list[Run]) -> list[str]:
    """One line per run: its files and, for several, why they are one run."""
    return [f"run {number}: " + ", ".join(map(str, run.files)) + (f" ({run.why})" if run.why else "")
            for number, run in enumerate(runs, 1)]

