"""Which runs the inputs of one `trainguard replay` are, and the output of several: one section per run.

`plan(inputs)` cuts the inputs into runs before anything is replayed:

- TLS logs are one run per folder that holds them (a run directory's ranks and nodes, told apart by their
  records' `rank` and `node`; rank files named on the command line from one `tls/` folder), so two run
  directories given together are two runs; except the trainer_state.json files `trainguard convert`
  wrote, each still a whole run's history;
- a folder without TLS logs of its own is looked into one level down (`discover.within`): a subfolder that
  is a run directory is a run of its own, other tools' logs here and in the subfolders are cut into runs by
  `trainguard.formats.identity` (checkpoint copies of a `trainer_state.json` passed over for the longest,
  ranks' copies of one run's steps read together, unrelated runs apart).

One run replays as it always did (`--json` the design's document). Several runs replay one after the other,
each alone, with the same policy and options: the human form prints a section per run, headed by its
files; `--json` prints one document whose design keys sum or list the runs' (`combined`: every listed
item names its `run`) and whose `runs` holds each run's own document.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainguard import formats
from trainguard.formats import discover, identity
from trainguard.replay import source


@dataclass(frozen=True)
class Section:
    """What one replay reads: `inputs` as `replay_logs` takes them, and the run other tools' logs make."""
    inputs: tuple[str, ...]
    run: identity.Run | None = None      # None: TLS logs, as given

    @property
    def name(self) -> str:
        return self.run.name if self.run is not None else ", ".join(self.inputs)

    @property
    def format(self) -> str:
        """The run's format: formats.detect's name (``tls`` for TLS logs as given)."""
        return self.run.kind if self.run is not None else formats.TLS

    @property
    def why(self) -> str:
        return self.run.why if self.run is not None else ""

    @property
    def passed_over(self) -> list[str]:
        """The checkpoint copies passed over for this run's files, said as replay's notes say things."""
        return [str(copy) for copy in self.run.copies] if self.run is not None else []

    @property
    def copies(self) -> list[dict]:
        """The same, for --json: each copy's file, the file read instead, and their log_history lengths."""
        return [{"file": str(copy.path), "copy_of": str(copy.of), "entries": copy.entries,
                 "copy_of_entries": copy.of_entries} for copy in self.run.copies] if self.run is not None else []


def plan(inputs: list[str], one_run: bool = False, conversions: source.Conversions | None = None) -> list[Section]:
    """The runs of `inputs`: the TLS logs given, the run directories found in folders, then other tools'
    runs in the order of their first file. Raises source.InputError for an input that
    is missing, not a regular file, or a folder without any log (here or one level down). Other tools' logs
    whose losses are compared are converted through `conversions` (pass the replay's, so each is read once)."""
    if one_run:
        source.expand(inputs)          # the same refusals, before anything is read
        return [Section(tuple(inputs))]
    given_tls: list[str] = []
    folders: list[Path] = []
    others: list[Path] = []
    for given in inputs:
        path = Path(given)
        if path.is_dir() and _converted_states(path):
            others += _converted_states(path)
            continue
        if path.is_dir() and not discover.tls_logs(path):
            found_folders, found_others = discover.within(path)
            if not found_folders and not found_others:
                raise source.InputError(f"{path}: no TLS logs (*.jsonl, *.jsonl.gz, *.jsonl.zst) or other "
                                        f"tools' logs in {discover.logs_folder(path)} or its subfolders")
            folders += found_folders
            others += found_others
            continue
        source.expand([given])         # a missing path, a FIFO: refused with the reader's words
        if path.is_dir() or identity.kind_of(path) == formats.TLS:
            given_tls.append(given)
        else:
            others.append(path)
    sections = [Section(tuple(group)) for group in _by_folder(given_tls)]
    sections += [Section((str(folder),)) for folder in dict.fromkeys(folders)]
    sections += [Section(tuple(map(str, run.files)), run) for run in identity.split(
        list(dict.fromkeys(others)), losses=conversions.training_losses if conversions is not None else None)]
    return sections


def _by_folder(given_tls: list[str]) -> list[list[str]]:
    """TLS inputs by the folder that holds their logs, in the order given: a run directory is one run, and
    so are the rank and node files named from one `tls/` folder (a run's ranks, nodes and rotated parts live
    together); two run directories given together are two runs, replayed apart as two folders of exports
    are (read as one, one run's loss was checked against the other's). `--one-run` reads them together."""
    groups: dict[Path, list[str]] = {}
    for given in given_tls:
        path = Path(given)
        folder = discover.logs_folder(path) if path.is_dir() else path.parent
        groups.setdefault(folder.resolve(), []).append(given)
    return list(groups.values())


def _converted_states(folder: Path) -> list[Path]:
    """A folder's TLS logs when they are several trainer_state.json files `trainguard convert` wrote (each a
    whole run's history, told apart as the states are); [] for any other TLS folder (a run's logs)."""
    logs = discover.tls_logs(folder)
    if len(logs) < 2 or any(log.kind != discover.FILE for log in logs):
        return []
    paths = [log.path for log in logs]
    return paths if all(formats.says_no_clock(path) for path in paths) else []


HEADING_FILES = 8      # a run of many files (a run's ranks) names this many in the heading, then a count


def heading(sections: list[Section]) -> list[str]:
    """The human form's opening of several runs: how many, why apart, and each by its files (a run of
    several files: why they are one, and each file on a line of its own)."""
    lines = [f"replay: {len(sections)} runs: these logs are not the ranks or copies of one run, so each is "
             "replayed alone (docs/replay.md, \"Several runs in one folder\"; --one-run reads them as one)"]
    for number, section in enumerate(sections, 1):
        copies = section.run.copies if section.run is not None else ()
        files = section.run.files if section.run is not None else section.inputs
        lines.append(f"  run {number}: {files[0]}" + (f" and {len(files) - 1} more, one run: {section.why}"
                                                        if len(files) > 1 else ""))
        lines += [f"           {path}" for path in files[1:HEADING_FILES]]
        if len(files) > HEADING_FILES:
            lines.append(f"           ... and {len(files) - HEADING_FILES} more")
        lines += [f"           read instead of its earlier copy {copy.path}" for copy in copies]
    return lines


def title(number: int, count: int, section: Section) -> str:
    return f"=== run {number} of {count}: {section.name}"


# ------------------------------------------------------------------------------------------ --json

def combined(documents: list[dict], sections: list[Section]) -> dict:
    """One `--json` document for several runs, in the keys and order of one run's: counts summed, the first
    and last timestamps the earliest and latest, every listed item (action, alert, malformed line, ledger
    verdict, node-health finding) with the `run` it is of, numbered from 1 as in `runs`; the run-wide keys
    that do not add up (`lead_rank`, `cost`) empty, as for a log that has none; and `runs`: each run's own
    document with its `run` number, its `format`, `why` its files are one run, and the `copies` passed over
    for it."""
    def total(key: str) -> int:
        return sum(document[key] for document in documents)

    def listed(key: str) -> list:
        return [{**item, "run": number} for number, document in enumerate(documents, 1) for item in document[key]]

    def flat(key: str) -> list:
        return [item for document in documents for item in document[key]]

    firsts = [d["first_timestamp"] for d in documents if d["first_timestamp"] is not None]
    lasts = [d["last_timestamp"] for d in documents if d["last_timestamp"] is not None]
    return {
        "records": total("records"), "malformed": total("malformed"),
        "first_timestamp": min(firsts, default=None), "last_timestamp": max(lasts, default=None),
        "actions": listed("actions"), "alerts": listed("alerts"),
        "malformed_lines": listed("malformed_lines"), "files": flat("files"),
        "steps": total("steps"), "duplicate_steps": total("duplicate_steps"), "partial_steps": total("partial_steps"),
        "lead_rank": None,
        "recorded_actions": listed("recorded_actions"), "recorded_alerts": listed("recorded_alerts"),
        "ledger": listed("ledger"), "cost": {},
        "node_health": {"findings": [{**finding, "run": number} for number, document in enumerate(documents, 1)
                                     for finding in document["node_health"]["findings"]],
                        "total": sum(document["node_health"]["total"] for document in documents)},
        "rules": documents[0]["rules"],
        "without_clock": flat("without_clock"), "passed_over": flat("passed_over"),
        "runs": [{"run": number, "format": section.format, "why": section.why, "copies": section.copies, **document}
                 for number, (section, document) in enumerate(zip(sections, documents), 1)],
    }
