"""Logs users already have, read as TLS records: TensorBoard event files, Hugging Face `trainer_state.json`,
Megatron-LM (and Megatron-DeepSpeed) training logs and torchtitan's metric lines; and the Git LFS pointer a
clone without git-lfs leaves in a log's place, read as the one problem it is. User guide: docs/replay.md
("Other tools' logs").

`detect(path)` names a file's format by its content (never its name), scanning at most `SCAN_BYTES` for a
text format's record line: a whole SLURM output holds hundreds of KB of arguments and NCCL lines before its
first iteration. `read(path, tag_map, notes)` yields the file's records as TLS dicts and `Unmapped` problems
(a line, event or entry that is broken or cannot be mapped, with file and position: reported, never dropped
silently); what a reader passes over on purpose (a Megatron field TLS has no name for, TensorBoard text
summaries, copies of a step printed by other ranks) is counted in `notes` (`Notes.skipped`: once per kind,
with counts), and `notes.clock` says whether the records' times are times at all (`NO_CLOCK`: a
trainer_state.json has no clock; its records are stamped with their step for order only and carry
``"clock": "none"``, so replay runs no rule that needs time on them).

`trainguard.replay.source` opens every input through `detect`, so `replay`, `report` and `diagnose` read
these formats beside TLS, and all three find them in a folder through `trainguard.formats.discover`
(replay then tells a folder's unrelated runs apart through `trainguard.formats.identity`);
`trainguard convert` writes them out as TLS.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterator, Union

from trainguard import safe_read

TLS, TENSORBOARD, HF_STATE, MEGATRON, TORCHTITAN = "tls", "tensorboard", "hf_trainer_state", "megatron", "torchtitan"
LFS_POINTER = "git_lfs_pointer"    # not a log: what a clone without git-lfs leaves in its place (lfs_pointer.py)
HEAD_BYTES = 1 << 16            # the binary and JSON formats say what they are in their first bytes
SCAN_BYTES = 64 << 20           # a text log's first record line is looked for this far (bounded: never the whole file)
SCAN_BLOCK = 1 << 20
CLOCK_KEY, NO_CLOCK = "clock", "none"   # the TLS envelope key of a record whose `timestamp` is its step, not a time
MAX_STEP = (1 << 63) - 1        # TLS steps are int64 (replay's typed reader, the Prometheus series)


@dataclass(frozen=True)
class Unmapped:
    """What could not be mapped: `position` counts `unit`s from 1 (line) or 0 (event, log_history entry)."""
    file: str
    position: int
    error: str
    unit: str = "line"

    @property
    def where(self) -> str:
        return f"log_history[{self.position}]" if self.unit == "entry" else f"{self.unit} {self.position}"

    def __str__(self) -> str:
        return f"{self.file}: {self.where}: {self.error}"


@dataclass
class Notes:
    """What a reader passed over on purpose, once per kind with its count, and what its records' time is."""
    clock: str = "wall"                                       # "wall" | "elapsed" | NO_CLOCK
    skipped: dict[str, list] = field(default_factory=dict)   # what -> [count, first position, unit]
    limit: int = 200                                          # distinct kinds kept, then one for the rest

    def skip(self, what: str, position: int, unit: str = "line", count: int = 1) -> None:
        if what not in self.skipped and len(self.skipped) >= self.limit:
            what = f"other kinds (past the first {self.limit})"
        self.skipped.setdefault(what, [0, position, unit])[0] += count

    def lines(self, source: str) -> list[str]:
        """One sentence per kind: `FILE: skipped N <what> (first at <unit> P)`."""
        return [f"{source}: passed over {count:,} {what} (first at {unit} {first})"
                for what, (count, first, unit) in self.skipped.items()]


Item = Union[dict, Unmapped]


def detect(path: str | os.PathLike) -> str:
    """The format of a file by its content: TLS unless it is recognisably one of the others."""
    try:
        with safe_read.open_file(path, what="log file") as handle:
            head = handle.read(HEAD_BYTES)
            if _first_line_is_a_record(head):
                return TLS      # a TLS line may quote another tool's log text in a field: it stays TLS
            for name, module in _readers().items():
                if module.looks_like(head):
                    return name
            return _scanned(handle, head)
    except OSError:
        return TLS


CLOCKLESS_MARK = b'"' + CLOCK_KEY.encode() + b'":"' + NO_CLOCK.encode() + b'"'


def says_no_clock(path: str | os.PathLike) -> bool:
    """Whether a TLS file's first line carries ``"clock":"none"``: what `trainguard convert` wrote of a
    trainer_state.json. Convert writes plain files, and the trainer's and the agent's logs (rotated ones
    compressed) never carry it: one 4 KiB read, no decompression."""
    if str(path).endswith((".gz", ".zst")):
        return False
    try:
        with safe_read.open_file(path, what="log file") as handle:
            return CLOCKLESS_MARK in handle.read(4096).split(b"\n", 1)[0]
    except OSError:
        return False


def _scanned(handle, head: bytes) -> str:
    """A text format's record line anywhere in the first SCAN_BYTES (the overlap keeps a line cut between
    two blocks whole in one of them)."""
    from trainguard.formats import megatron, torchtitan

    text_formats = ((MEGATRON, megatron), (TORCHTITAN, torchtitan))
    block, read = head, len(head)
    while block:
        for name, module in text_formats:
            if module.looks_like_text(block):
                return name
        if read >= SCAN_BYTES:
            break
        more = handle.read(SCAN_BLOCK)
        if not more:
            break
        read += len(more)
        block = block[-4096:] + more
    return TLS


def _first_line_is_a_record(head: bytes) -> bool:
    """One of the first lines is a JSON object (the first may be torn: a process killed mid-write)."""
    import json

    for line in head.lstrip().split(b"\n", 3)[:3]:
        try:
            value = json.loads(line)
            if isinstance(value, dict):
                return "log_history" not in value or "timestamp" in value   # a compact trainer_state.json is not TLS
        except (ValueError, RecursionError):
            continue
    return False


def _readers() -> dict:
    from trainguard.formats import hf_state, lfs_pointer, tensorboard
    return {TENSORBOARD: tensorboard, HF_STATE: hf_state, LFS_POINTER: lfs_pointer}


def _all_readers() -> dict:
    from trainguard.formats import megatron, torchtitan
    return {**_readers(), MEGATRON: megatron, TORCHTITAN: torchtitan}


def read(path: str | os.PathLike, tag_map: dict[str, str] | None = None,
         notes: Notes | None = None) -> Iterator[Item]:
    """The records of a non-TLS file, in file order, with the problems where they occur; what was passed
    over on purpose, and the records' clock, into `notes`."""
    kind = detect(path)
    if kind == TLS:
        raise ValueError(f"{path}: a TLS file, not one of the other formats")
    reader = _all_readers()[kind]
    notes = notes if notes is not None else Notes()
    return reader.read(path, notes, tag_map) if kind == TENSORBOARD else reader.read(path, notes)


def write_tls(path: str | os.PathLike, out, tag_map: dict[str, str] | None = None,
              notes: Notes | None = None, progress=None) -> tuple[int, list[Unmapped]]:
    """Every record of a non-TLS file as TLS lines on the binary stream `out`; returns the number written
    and the problems (each also a reason the file is not fully represented). `progress`: a
    trainguard.progress.Progress that counts the records."""
    from trainguard import tls

    written, problems = 0, []
    items = read(path, tag_map, notes)
    for item in progress.counted(items) if progress is not None else items:
        if isinstance(item, Unmapped):
            problems.append(item)
        else:
            out.write(tls.encode(item))
            written += 1
    return written, problems


def step_of(value) -> int | None:
    """A step as TLS holds it (an int64 >= 0), from a JSON or parsed number; None when it is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if isinstance(value, int) and 0 <= value <= MAX_STEP else None


def parse_map(pairs: list[str]) -> dict[str, str]:
    """`TAG=FIELD` pairs (the last `=` splits: a tag may hold one)."""
    mapping = {}
    for pair in pairs:
        tag, sep, field_name = pair.rpartition("=")
        if not sep or not tag or not field_name:
            raise ValueError(f"--map {pair!r}: expected TAG=FIELD")
        mapping[tag] = field_name
    return mapping
