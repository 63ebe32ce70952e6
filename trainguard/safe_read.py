"""The one way to read a file from the run directory: a regular file, opened without blocking, bounded.

Anyone who can write the run directory can put anything under a name trainguard reads: a FIFO (open() and
read() block until someone writes to it: an agent waiting on `incident.json` never gives its verdict), a
device or a link to one (`/dev/zero` is read until memory runs out), a file of gigabytes where a few
kilobytes are expected, a 2 GB line without a newline, a gzip of gigabytes of zeros, a YAML alias bomb.
Every reader of a run-directory file goes through here (tests/test_safe_read_callers.py holds the product
to it), so each of those is one refusal naming the file and the reason, never a hang and never a heap:

- `open_file`: O_NONBLOCK open (a FIFO opens at once, with no writer), then fstat on the descriptor (the
  file that was opened, not the name, which a stranger can swap): anything but a regular file is refused
  before a byte is read; a `limit` refuses a file larger than its kind may be before reading it.
- `read_bytes` / `read_text` / `read_json` / `read_yaml`: the whole of a small file, at most `limit` bytes
  (a file that grows while read is refused too, not cut in silence).
- `open_log`: a TLS log, plain, gzip or zstd, decompressed no further than `MAX_EXPANSION` times its size
  (at least `MIN_DECOMPRESSED`), and `lines`: its lines, none longer than `MAX_LINE_BYTES`.
- `load_yaml`: YAML text whose aliases may not expand past `MAX_YAML_NODES` nodes.

`RunFileError` is an OSError and a BadInput (exit 2 under any command) whose message names the file and
the reason. A missing file stays FileNotFoundError: callers treat "not there" apart.
"""

from __future__ import annotations

import fcntl
import io
import json
import os
import stat
from collections.abc import Iterator
from typing import IO, Any, cast

from trainguard.exits import BadInput

PathLike = str | os.PathLike[str]

KiB, MiB = 1 << 10, 1 << 20

# What each kind of run-directory file may hold. Generous against real files, small against memory: a
# refusal names the bound, so a real file that outgrows one says which to raise.
CONTROL_BYTES = 1 * MiB        # claims, cordons, rank registrations, launchers, stopped.json, a token
MANIFEST_BYTES = 64 * MiB      # a checkpoint manifest: ~200 bytes per file listed, 300k shards
STATUS_BYTES = 1 * MiB         # checkpoints/status.json, offsets, preflight.json
YAML_BYTES = 4 * MiB           # a policy, an --expect file, an agent or trainer config
LEDGER_BYTES = 256 * MiB       # an append-only control log (actions.jsonl, acked.jsonl, faults-fired.jsonl)
CONTROL_READ_BYTES = 16 * MiB  # ... read at most this much a call by a reader that follows it
JSON_DOCUMENT_BYTES = 256 * MiB   # another tool's whole-file log (a trainer_state.json)

MAX_LINE_BYTES = 64 * MiB      # a TLS line (the trainer's are ~300 bytes; a 50 MB line is read whole)
MAX_EXPANSION = 200            # a compressed log decompresses to at most this many times its size ...
MIN_DECOMPRESSED = 256 * MiB   # ... or this, whichever is more (JSON lines compress 5-20x, zeros 1000x)
MAX_YAML_NODES = 100_000       # nodes a YAML document may expand to through its aliases

COMPRESSED = (".gz", ".zst")


class RunFileError(OSError, BadInput):
    """A run-directory file refused: not a regular file, larger than its kind may be, a line too long, a
    compressed file that expands too far. The message names file and reason. An OSError (readers that
    skip an unreadable file skip it) and BadInput (a command that meets it exits 2, trainguard/exits.py),
    as io.UnsupportedOperation is both an OSError and a ValueError."""

    def __init__(self, path: PathLike | int, reason: str):
        where = str(path) if isinstance(path, int) else os.fsdecode(path)    # int: a descriptor's "name"
        super().__init__(f"{where}: {reason}")
        self.path, self.reason = where, reason

    def __str__(self) -> str:
        return str(self.args[0])


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _size(n: int) -> str:
    return f"{n / MiB:.1f} MiB" if n >= MiB else f"{n} bytes"


def open_fd(path: PathLike, limit: int | None = None, what: str = "file") -> tuple[int, os.stat_result]:
    """A read-only descriptor of the regular file at `path` (blocking again once it is known to be one), and
    its stat; RunFileError for anything else or a file over `limit` bytes; FileNotFoundError when missing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except IsADirectoryError:
        raise RunFileError(path, f"is a directory, not a {what}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RunFileError(path, f"is {_kind(st.st_mode)}, not a {what}")
        if limit is not None and st.st_size > limit:
            raise RunFileError(path, f"{_size(st.st_size)}, more than the {_size(limit)} a {what} may hold")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def open_file(path: PathLike, limit: int | None = None, what: str = "file", buffering: int = -1) -> IO[bytes]:
    """The regular file at `path`, opened for reading in binary (see `open_fd`)."""
    fd, _ = open_fd(path, limit, what)
    return cast(IO[bytes], os.fdopen(fd, "rb", buffering=buffering))


def open_rw_fd(path: PathLike, flags: int, what: str = "file", mode: int = 0o644) -> int:
    """A run-directory file opened read-write with `flags` (O_RDWR, O_APPEND, O_CREAT, ...): a regular file,
    or RunFileError. A FIFO opened read-write does not block, but reading it would, for ever, and a writer
    blocks once its 64 KiB are full: a log writer or a status file must not end up in either."""
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY, mode)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RunFileError(path, f"is {_kind(st.st_mode)}, not a {what}")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_append(path: PathLike, what: str = "file", mode: int = 0o644) -> IO[bytes]:
    """A run-directory file opened to read and append ("a+b"), created when missing (see `open_rw_fd`)."""
    fd = open_rw_fd(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, what, mode)
    return cast(IO[bytes], os.fdopen(fd, "a+b"))


def read_fd(fd: int, path: PathLike, limit: int, what: str = "file") -> bytes:
    """At most `limit` bytes of an open descriptor; RunFileError when there are more (it grew)."""
    parts, total = [], 0
    while chunk := os.read(fd, min(limit + 1 - total, 1 * MiB)):
        parts.append(chunk)
        total += len(chunk)
        if total > limit:
            raise RunFileError(path, f"more than the {_size(limit)} a {what} may hold")
    return b"".join(parts)


def read_bytes(path: PathLike, limit: int, what: str = "file") -> bytes:
    """The whole of a small regular file (see `open_fd`)."""
    fd, _ = open_fd(path, limit, what)
    try:
        return read_fd(fd, path, limit, what)
    finally:
        os.close(fd)


def read_text(path: PathLike, limit: int, what: str = "file", errors: str = "strict") -> str:
    """`read_bytes` as UTF-8 (UnicodeDecodeError, a ValueError, unless `errors` says otherwise)."""
    return read_bytes(path, limit, what).decode("utf-8", errors)


def read_json(path: PathLike, limit: int, what: str = "file") -> Any:
    """`read_bytes` decoded as JSON (ValueError when it is not, nested too deeply included)."""
    data = read_bytes(path, limit, what)
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError(f"{os.fspath(path)}: nested too deeply") from None


def read_yaml(path: PathLike, limit: int = YAML_BYTES, what: str = "YAML file") -> Any:
    """`read_text` decoded by `load_yaml` (yaml.YAMLError when it is not YAML or expands too far)."""
    return load_yaml(read_text(path, limit, what))


# ------------------------------------------------------------------------------------------- YAML

def load_yaml(text: str) -> Any:
    """yaml.safe_load, refusing a document whose aliases expand it past MAX_YAML_NODES nodes.

    A 1 KB "billion laughs" document is a few hundred nodes sharing each other: safe_load builds it
    cheaply, and the first str() of it (an error message, a log line) takes gigabytes. Each alias is charged
    the size of the node it repeats, so the refusal comes while composing, before anything is built."""
    import yaml

    class Loader(yaml.SafeLoader):  # type: ignore[misc]   # yaml has no types here
        expanded = 0
        sizes: dict[int, int] = {}

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                node = self.anchors.get(self.peek_event().anchor)
                self.expanded += 1 if node is None else _nodes(node, self.sizes)
            else:
                self.expanded += 1
            if self.expanded > MAX_YAML_NODES:
                raise yaml.YAMLError(f"it expands to more than {MAX_YAML_NODES} nodes through its aliases "
                                     f"(an alias bomb?)")
            return super().compose_node(parent, index)

    Loader.sizes = {}
    loader = Loader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _nodes(node: Any, sizes: dict[int, int], depth: int = 0) -> int:
    """The number of nodes under `node` as written out (aliases expanded), memoised per node."""
    import yaml

    known = sizes.get(id(node))
    if known is not None:
        if known < 0:
            raise yaml.YAMLError("an alias refers to a node that contains it (recursive)")
        return known
    if depth > 1000:
        raise yaml.YAMLError("nested too deeply")
    sizes[id(node)] = -1            # being counted: an alias met below it is recursive
    if isinstance(node, yaml.SequenceNode):
        total = 1 + sum(_nodes(child, sizes, depth + 1) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        total = 1 + sum(_nodes(key, sizes, depth + 1) + _nodes(value, sizes, depth + 1)
                        for key, value in node.value)
    else:
        total = 1
    sizes[id(node)] = total
    return total


# -------------------------------------------------------------------------------------------- logs

class _Bounded(io.RawIOBase):
    """A decompressing stream that refuses to give more than `limit` bytes (a decompression bomb)."""

    def __init__(self, inner: IO[bytes], path: PathLike, limit: int):
        self.inner, self.path, self.limit, self.given = inner, path, limit, 0
        # read1: what one decompression step gives, so the lines before a cut-off end are still handed on
        self._read = getattr(inner, "read1", inner.read)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._read(len(buffer))
        n = len(data)
        self.given += n
        if self.given > self.limit:
            raise RunFileError(self.path, f"decompresses to more than {_size(self.limit)} (over "
                                          f"{MAX_EXPANSION} times its size: a decompression bomb?)")
        buffer[:n] = data
        return n

    def close(self) -> None:
        try:
            self.inner.close()
        finally:
            super().close()


def decompressed_limit(compressed_bytes: int) -> int:
    return max(MIN_DECOMPRESSED, MAX_EXPANSION * compressed_bytes)


def open_log(path: PathLike) -> IO[bytes]:
    """A TLS log for reading: plain, gzip or zstd by its suffix, a regular file, decompression bounded."""
    name = os.fspath(path)
    raw = open_file(path, what="log file")
    if not name.endswith(COMPRESSED):
        return raw
    try:
        size = os.fstat(raw.fileno()).st_size
        if name.endswith(".gz"):
            import gzip
            inner = cast(IO[bytes], gzip.GzipFile(fileobj=raw, mode="rb"))
        else:
            import zstandard
            inner = cast(IO[bytes], zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    except BaseException:
        raw.close()
        raise
    if name.endswith(".gz"):
        inner = cast(IO[bytes], _ClosingBoth(inner, raw))
    return io.BufferedReader(_Bounded(inner, path, decompressed_limit(size)), buffer_size=64 * KiB)


class _ClosingBoth:
    """GzipFile given a file object does not close it: this closes both."""

    def __init__(self, inner: IO[bytes], raw: IO[bytes]):
        self.inner, self.raw = inner, raw

    def read(self, n: int = -1) -> bytes:
        return self.inner.read(n)

    def read1(self, n: int = -1) -> bytes:
        return cast(bytes, cast(Any, self.inner).read1(n))

    def close(self) -> None:
        try:
            self.inner.close()
        finally:
            self.raw.close()


def line_too_long(path: PathLike, lineno: int | None, limit: int = 0) -> RunFileError:
    """The refusal of a line longer than `limit` (MAX_LINE_BYTES); `lineno` None: counted here, from the
    start of the (plain) file to the first run of `limit` bytes without a newline."""
    limit = limit or MAX_LINE_BYTES
    if lineno is None:
        lineno = _number_of_long_line(path, limit)
    return RunFileError(path, f"line {lineno} longer than {_size(limit)} (a log line is at most that long)")


def _number_of_long_line(path: PathLike, limit: int) -> int:
    with open_file(path, what="log file") as handle:
        for number, raw in enumerate(iter(lambda: handle.readline(limit + 1), b""), 1):
            if len(raw) > limit:
                return number
    return 1


def lines(handle: IO[bytes], path: PathLike) -> Iterator[bytes]:
    """Each line of `handle` with its newline (the last may have none); RunFileError at a line longer than
    MAX_LINE_BYTES, before more than that is held.

    Read a block at a time and split in C (a readline per line costs twice the plain iteration); a block
    is never larger than the bound, so only a line that spans blocks needs its length checked."""
    limit = MAX_LINE_BYTES
    block_bytes = min(1 * MiB, limit)
    read = getattr(handle, "read1", handle.read)    # what is there: the lines before a cut-off .gz come out
    lineno = 0
    pieces: list[bytes] = []
    held = 0
    while block := read(block_bytes):
        cut = block.rfind(b"\n") + 1
        if cut == 0:
            pieces.append(block)
            held += len(block)
            if held > limit:
                raise line_too_long(path, lineno + 1, limit)
            continue
        start = 0
        if pieces:
            start = block.find(b"\n") + 1
            if held + start > limit:
                raise line_too_long(path, lineno + 1, limit)
            pieces.append(block[:start])
            lineno += 1
            yield b"".join(pieces)
        for raw in io.BytesIO(block[start:cut]):
            lineno += 1
            yield raw
        pieces = [block[cut:]] if cut < len(block) else []
        held = len(block) - cut
    if pieces:
        yield b"".join(pieces)


