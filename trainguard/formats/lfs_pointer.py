"""A Git LFS pointer where a log should be: the three lines a clone without git-lfs leaves in place of a file
its repository stores with Git LFS.

The Hugging Face Hub's default `.gitattributes` stores `*tfevents*` with LFS, and so do many GitHub copies of
a Trainer's `output_dir`: cloned without `git lfs`, every `runs/*/events.out.tfevents.*` is a pointer like

    version https://git-lfs.github.com/spec/v1
    oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393
    size 12345

Read as TLS it would be three malformed lines, and a folder of them "no logs". It is read here as what it
is: one `Unmapped` for the file, naming the size of the file it stands for and how to fetch it. The
pointer's shape is git-lfs's `docs/spec.md`: `key value` lines, `version` first, under 1024 bytes; the
version string of git-lfs 0.x (`hawser`) is a pointer too.
"""

from __future__ import annotations

import os
import re
from typing import Iterator

from trainguard import safe_read
from trainguard.formats import Item, Notes, Unmapped

VERSIONS = (b"https://git-lfs.github.com/spec/v1", b"https://hawser.github.com/spec/v1")
MAX_BYTES = 1024
_LINE = re.compile(rb"^([a-z0-9.-]+) (\S[^\r\n]*)$")


def looks_like(head: bytes) -> bool:
    return len(head) < MAX_BYTES and _fields(head) is not None


def _fields(data: bytes) -> dict[bytes, bytes] | None:
    """The pointer's `key value` pairs, or None when `data` is not one (version first, an oid and a size)."""
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    pairs = [_LINE.match(line) for line in lines]
    if not pairs or any(pair is None for pair in pairs):
        return None
    fields = {pair.group(1): pair.group(2) for pair in pairs if pair is not None}
    version = pairs[0].group(2) if pairs[0] is not None and pairs[0].group(1) == b"version" else None
    if version not in VERSIONS or b"oid" not in fields or not fields.get(b"size", b"").isdigit():
        return None
    return fields


def read(path: str | os.PathLike, notes: Notes | None = None) -> Iterator[Item]:
    source = str(path)
    try:
        data = safe_read.read_bytes(path, MAX_BYTES, "Git LFS pointer")
    except (OSError, ValueError) as exc:
        yield Unmapped(source, 1, f"unreadable: {exc}")
        return
    fields = _fields(data)
    if fields is None:      # changed since it was detected
        yield Unmapped(source, 1, "not a Git LFS pointer any more")
        return
    size = int(fields[b"size"])
    oid = fields[b"oid"].decode("ascii", "replace")
    yield Unmapped(source, 1, f"a Git LFS pointer to a {size:,}-byte file ({oid[:19]}...), not the log itself: "
                              "its repository stores it with Git LFS; fetch it with `git lfs pull` in the clone")
