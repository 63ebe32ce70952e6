"""Follows the lines appended to a set of files, as `tail -F` does, without losing or repeating one.

- Only complete lines are returned; a partial last line (a writer mid-write) is read again next time.
- Rotation by rename (the inode at the path changes): the rest of the old file is read first, found by its
  inode among the files beside it, then the new file from its start.
- Truncation (the file is shorter than what was read, or its first bytes changed): read again from 0.
- New files matching the pattern are picked up on the next poll; the directory is listed again only when
  it changed (its mtime), or every `rescan_seconds`, so a directory shared by a thousand nodes costs one
  stat per poll, not a listing of eight thousand names.
- `select` (optional) narrows the listing to the files this follower reads (the training collector's
  `NodeFiles`: this node's ranks only). It is handed the matching directory entries one at a time while
  the directory is listed and returns the ones to read, so nothing is held of the others (on a shared run
  directory, the other nodes' thousands of files). A file left out keeps its position and is not read.
  `select.version()`, when it has one, is asked each poll: a new value lists the directory again (its
  choice may have changed: the ranks were registered again).
- Restarts: `state()` is a JSON-able position per file (inode, offset, line number, a checksum of the
  first bytes); `restore()` it, and reading resumes exactly where it stopped. Persist it together with
  whatever was derived from the lines (one atomic file), and no line is counted twice or lost.

Memory is bounded: a poll reads at most `max_read_bytes` per file, and a line longer than
`max_line_bytes` is returned as overlong (the caller reports it) and skipped to its end.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from trainguard import safe_read

HEAD_BYTES = 256   # the prefix checksummed to tell a file from a new one that reused its inode


@dataclass
class Position:
    inode: int
    device: int
    offset: int = 0        # bytes of complete lines consumed
    lineno: int = 0        # lines consumed (for file:line in error messages)
    head_crc: int = 0      # crc32 of the first min(offset, HEAD_BYTES) bytes
    head_len: int = 0
    skipping: bool = False  # inside an overlong line: discard up to its newline


@dataclass(frozen=True, slots=True)
class Chunk:
    """One complete line (without its newline), or an overlong line's first bytes (`overlong` True)."""

    source: str
    lineno: int
    data: bytes
    overlong: bool = False


class Follower:
    """Follows every file in `directory` whose name matches `pattern` (a glob)."""

    RACY_SECONDS = 2.0        # a directory changed this recently is listed again next poll (git's rule)

    def __init__(self, directory: str | os.PathLike, pattern: str, *, max_read_bytes: int = 4 << 20,
                 max_line_bytes: int = 1 << 20, select=None, rescan_seconds: float = 30.0, clock=time.monotonic):
        if max_read_bytes < max_line_bytes:
            raise ValueError("max_read_bytes must be at least max_line_bytes")
        self.directory = Path(directory)
        self.pattern = pattern
        self.select = select              # callable(matching entries) -> {name: path} of those to read
        self.rescan_seconds, self.clock = rescan_seconds, clock
        self._match = re.compile(fnmatch.translate(pattern)).match
        self._listing: dict[str, str] = {}  # the files to read: every matching one, or those `select` kept
        self._present: set[str] = set()     # followed names the last listing held (left out or not)
        self._listed: tuple | None = None   # (inode, mtime_ns) of the directory when listed
        self._listed_at: float | None = None
        self._select_version = None
        self.max_read_bytes, self.max_line_bytes = max_read_bytes, max_line_bytes
        self.positions: dict[str, Position] = {}
        self.events: list[str] = []      # "rotated rank-0.jsonl", "truncated ..." since last read; for logs
        self.more = False                # the last poll stopped at max_read_bytes in some file

    # ---------------------------------------------------------------------------------- persistence

    def state(self) -> dict:
        return {name: dict(vars(pos)) for name, pos in self.positions.items()}   # flat: no need for asdict's deep copy

    def restore(self, state: dict) -> None:
        self.positions = {name: Position(**values) for name, values in state.items()}

    # -------------------------------------------------------------------------------------- reading

    def poll(self) -> Iterator[Chunk]:
        """The complete lines appended since the last poll, file by file, in order within each file.

        Reads at most `max_read_bytes` per file; `more` is then True, and another poll reads on.
        """
        self.more = False
        listing = self._files_to_read()
        for name in sorted(set(self.positions) - set(listing) - self._present):
            # Renamed away with no successor yet: finish the old file, then forget it.
            yield from self._drain_moved(name)
            del self.positions[name]
        for name, path in sorted(listing.items()):
            yield from self._poll_file(name, path)

    def _files_to_read(self) -> dict[str, str]:
        """The files to read, listed again only when the directory or the selection changed (or is stale)."""
        try:
            st = os.stat(self.directory)
        except OSError:
            self._listing, self._present, self._listed = {}, set(), None
            return self._listing
        version, now = (st.st_ino, st.st_mtime_ns), self.clock()
        select_version = getattr(self.select, "version", None)
        select_version = select_version() if select_version is not None else None
        stale = self._listed_at is None or now - self._listed_at >= self.rescan_seconds
        if version != self._listed or stale or select_version != self._select_version:
            self._listing = self._scan()
            settled = time.time() - st.st_mtime > self.RACY_SECONDS
            self._listed, self._listed_at, self._select_version = (version if settled else None), now, select_version
        return self._listing

    def _scan(self) -> dict[str, str]:
        """The matching files ({name: path}, paths as strings: Path objects cost more than the syscalls
        here), or those of them `select` keeps; streamed, so the directory's listing is never held."""
        self._present = set()
        try:
            with os.scandir(self.directory) as entries:
                matching = self._matching(entries)
                return {e.name: e.path for e in matching} if self.select is None else self.select(matching)
        except FileNotFoundError:
            return {}

    def _matching(self, entries) -> Iterator[os.DirEntry]:
        for entry in entries:
            if self._match(entry.name) and entry.is_file():
                if entry.name in self.positions:
                    self._present.add(entry.name)
                yield entry

    def _poll_file(self, name: str, path: str) -> Iterator[Chunk]:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return
        pos = self.positions.get(name)
        if pos is None:
            pos = self.positions[name] = Position(st.st_ino, st.st_dev)
        elif (pos.inode, pos.device) != (st.st_ino, st.st_dev):
            yield from self._drain_moved(name)
            self.events.append(f"rotated {path}")
            pos = self.positions[name] = Position(st.st_ino, st.st_dev)
        elif st.st_size < pos.offset:
            self.events.append(f"truncated {path} (had read {pos.offset} bytes, now {st.st_size})")
            pos = self.positions[name] = Position(st.st_ino, st.st_dev)
        if st.st_size > pos.offset:
            chunks = self._read(path, pos)
            if chunks is None:   # same inode, other first bytes: rewritten in place, longer than before
                self.events.append(f"truncated {path} (rewritten from the start)")
                pos = self.positions[name] = Position(st.st_ino, st.st_dev)
                chunks = self._read(path, pos) or []
            yield from chunks

    def _drain_moved(self, name: str) -> Iterator[Chunk]:
        """Read the rest of the file `name` was before it was renamed, found beside it by its inode."""
        pos = self.positions[name]
        path = self._path_of_inode(pos)
        while path is not None:   # to its end, a bounded read at a time
            before = pos.offset
            chunks = self._read(path, pos)
            if not chunks and pos.offset == before:   # None (not the same file) or nothing left
                return
            yield from chunks

    def _path_of_inode(self, pos: Position) -> str | None:
        """Where the file `pos` follows is now, looked for in the directory (streamed: not held)."""
        try:
            with os.scandir(self.directory) as scan:
                for entry in scan:
                    try:
                        if entry.inode() == pos.inode and entry.is_file() and entry.stat().st_dev == pos.device:
                            return entry.path
                    except OSError:
                        continue
        except OSError:
            return None
        return None

    def _read(self, path: str, pos: Position) -> list[Chunk] | None:
        """Complete lines from `pos` on (one open, positioned reads); None if the file's first bytes changed."""
        try:
            fd, _ = safe_read.open_fd(path, what="log file")    # a FIFO in a log's place: refused, never waited on
        except OSError:
            return []
        try:
            if pos.head_len:
                head = os.pread(fd, pos.head_len, 0)
                if len(head) != pos.head_len or zlib.crc32(head) != pos.head_crc:
                    return None
            data = os.pread(fd, self.max_read_bytes, pos.offset)
            if pos.head_len < HEAD_BYTES and pos.offset + len(data) > pos.head_len:
                head = os.pread(fd, HEAD_BYTES, 0)
        except OSError:
            return []
        finally:
            os.close(fd)
        if len(data) == self.max_read_bytes:
            self.more = True
        chunks = self._split(path, pos, data)
        if pos.head_len < HEAD_BYTES:
            usable = min(HEAD_BYTES, pos.offset)
            if usable > pos.head_len:
                pos.head_len, pos.head_crc = usable, zlib.crc32(head[:usable])
        return chunks

    def _split(self, source: str, pos: Position, data: bytes) -> list[Chunk]:
        """The complete lines of `data` (read at `pos.offset`), advancing `pos` past them."""
        chunks: list[Chunk] = []
        end = data.rfind(b"\n")
        if end < 0:
            if pos.skipping:                          # still inside an overlong line already reported
                pos.offset += len(data)
            elif len(data) >= self.max_line_bytes:    # a line that will not fit: report it, skip to its end
                pos.lineno += 1
                chunks.append(Chunk(source, pos.lineno, data[: self.max_line_bytes], True))
                pos.offset += len(data)
                pos.skipping = True
            return chunks
        for line in data[:end].split(b"\n"):
            if pos.skipping:
                pos.skipping = False
                continue
            pos.lineno += 1
            if len(line) > self.max_line_bytes:
                chunks.append(Chunk(source, pos.lineno, line[: self.max_line_bytes], True))
            elif line.strip():
                chunks.append(Chunk(source, pos.lineno, line))
        pos.offset += end + 1
        return chunks


def save_json_atomic(path: str | os.PathLike, payload: dict) -> None:
    """Write JSON to `path` so a reader (or a restart after a kill) sees the old file or the new, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as handle:
        handle.write(json.dumps(payload, separators=(",", ":")))   # dumps: the C encoder, one write
    os.replace(tmp, path)


def load_json(path: str | os.PathLike) -> dict | None:
    """The JSON at `path`, or None when there is none; a damaged file raises ValueError naming it."""
    try:
        text = safe_read.read_text(path, safe_read.STATUS_BYTES, "offsets file")
    except FileNotFoundError:
        return None
    except OSError as exc:      # a FIFO, a device, too large: refused as damaged, naming it
        raise ValueError(str(exc)) from None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
