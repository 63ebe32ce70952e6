"""Logs users already have, read as TLS records: TensorBoard event files, Hugging Face `trainer_state.json`,
Megatron-LM training log lines and torchtitan's metric lines. User guide: docs/replay.md ("Other formats").

`detect(path)` names a file's format by its content (never its name); `read(path, tag_map)` yields its
records as TLS dicts and `Unmapped` problems (a line, event or entry that could not be mapped, with file
and position: reported, never dropped silently). `trainguard.replay.source` opens every input through
`detect`, so `replay`, `report` and `diagnose` read these formats beside TLS, and all three find them in a
folder through `trainguard.formats.discover`; `trainguard convert` writes them out as TLS.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator, Union

TLS, TENSORBOARD, HF_STATE, MEGATRON, TORCHTITAN = "tls", "tensorboard", "hf_trainer_state", "megatron", "torchtitan"
HEAD_BYTES = 1 << 16


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


Item = Union[dict, Unmapped]


def detect(path: str | os.PathLike) -> str:
    """The format of a file by its first bytes: TLS unless it is recognisably one of the others."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(HEAD_BYTES)
    except OSError:
        return TLS
    if _first_line_is_a_record(head):
        return TLS          # a TLS line may quote another tool's log text in a field: it stays TLS
    for name, module in _readers().items():
        if module.looks_like(head):
            return name
    return TLS


def _first_line_is_a_record(head: bytes) -> bool:
    import json

    first = head.lstrip().split(b"\n", 1)[0]
    try:
        return isinstance(json.loads(first), dict)
    except ValueError:
        return False


def _readers() -> dict:
    from trainguard.formats import hf_state, megatron, tensorboard, torchtitan
    return {TENSORBOARD: tensorboard, HF_STATE: hf_state, MEGATRON: megatron, TORCHTITAN: torchtitan}


def read(path: str | os.PathLike, tag_map: dict[str, str] | None = None) -> Iterator[Item]:
    """The records of a non-TLS file, in file order, with the problems where they occur."""
    kind = detect(path)
    if kind == TLS:
        raise ValueError(f"{path}: a TLS file, not one of the other formats")
    reader = _readers()[kind]
    return reader.read(path, tag_map) if kind == TENSORBOARD else reader.read(path)


def write_tls(path: str | os.PathLike, out, tag_map: dict[str, str] | None = None,
              progress=None) -> tuple[int, list[Unmapped]]:
    """Every record of a non-TLS file as TLS lines on the binary stream `out`; returns the number written
    and the problems (each also a reason the file is not fully represented). `progress`: a
    trainguard.progress.Progress that counts the records."""
    from trainguard import tls

    written, problems = 0, []
    items = read(path, tag_map)
    for item in progress.counted(items) if progress is not None else items:
        if isinstance(item, Unmapped):
            problems.append(item)
        else:
            out.write(tls.encode(item))
            written += 1
    return written, problems


def parse_map(pairs: list[str]) -> dict[str, str]:
    """`TAG=FIELD` pairs (the last `=` splits: a tag may hold one)."""
    mapping = {}
    for pair in pairs:
        tag, sep, field = pair.rpartition("=")
        if not sep or not tag or not field:
            raise ValueError(f"--map {pair!r}: expected TAG=FIELD")
        mapping[tag] = field
    return mapping
