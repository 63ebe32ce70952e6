"""Training data: one token stream, cut into contiguous per-rank shards read sequentially.

Sources:
- a directory of text files, read as bytes (vocabulary 256) in sorted path order; by default the Python
  standard library's own source, which every machine has offline. The tokens are cached once as a
  uint16 ``.bin`` file (under ``data.cache_dir`` or ``~/.cache/trainguard``), so later runs start at once;
- a glob of pre-tokenised uint16 ``.bin`` shards in nanoGPT's format (raw little-endian uint16, no
  header), memory-mapped and read in sorted order as one stream.

The last ``val_fraction`` of the stream is held out for validation. Each rank owns a contiguous share of
the rest and reads it window by window (``block_size + 1`` tokens, overlapping by one), so the position
is a single integer: the number of windows this rank has consumed. It is exact, cheap to save, and can
be advanced to skip a window of data (what a rollback does).
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import os
import sysconfig
import tempfile
from pathlib import Path

import numpy as np
import torch

from trainguard.exits import BadInput
from trainguard.trainer.config import DataConfig

SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class DataError(BadInput):
    pass


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def text_files(root: Path, pattern: str) -> list[Path]:
    """Files under `root` matching `pattern`, sorted, leaving out installed packages and caches.

    A pattern of file names is matched while walking, never descending into the skipped directories
    (every start of a rank lists the corpus to find its cache: rglob walked all of site-packages first,
    about 3 s of a restart under load); a pattern with a directory part goes through rglob."""
    if "/" in pattern:
        return sorted(p for p in root.rglob(pattern)
                      if p.is_file() and not SKIP_DIRS.intersection(p.relative_to(root).parts))
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [name for name in dirs if name not in SKIP_DIRS]
        found.extend(Path(folder, name) for name in fnmatch.filter(names, pattern))
    return sorted(p for p in found if p.is_file())


def _cache_key(root: Path, files: list[Path]) -> str:
    digest = hashlib.sha256(str(root).encode())
    for path in files:
        stat = path.stat()
        digest.update(f"{path.relative_to(root)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def tokenize_dir(root: Path, pattern: str, cache_dir: Path) -> Path:
    """Byte-level tokens of every matching file under `root`, cached as a uint16 .bin file."""
    files = text_files(root, pattern)
    if not files:
        raise DataError(f"{root}: no files matching {pattern!r}")
    target = cache_dir / f"corpus-{_cache_key(root, files)}.bin"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Several ranks may build the cache at once; each writes its own temporary file and the rename is atomic.
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".corpus-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            for path in files:
                out.write(np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.uint16).tobytes())
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
    return target


class TokenStream:
    """Several memory-mapped uint16 files read as one stream of tokens."""

    def __init__(self, paths: list[Path]):
        self.paths = paths
        self.arrays = [np.memmap(p, dtype=np.uint16, mode="r") for p in paths]
        self.offsets = np.cumsum([0] + [len(a) for a in self.arrays])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def read(self, start: int, end: int) -> np.ndarray:
        """Tokens [start, end) as a fresh array, across file boundaries when needed."""
        parts = []
        for i, array in enumerate(self.arrays):
            lo, hi = max(start, self.offsets[i]), min(end, self.offsets[i + 1])
            if lo < hi:
                parts.append(array[lo - self.offsets[i]:hi - self.offsets[i]])
        return np.concatenate(parts) if len(parts) != 1 else np.array(parts[0])


def open_stream(config: DataConfig) -> TokenStream:
    """The configured token stream: the stdlib source by default, a text directory, or .bin shards."""
    if not config.path:
        root = stdlib_dir()
    elif os.path.isdir(config.path):
        root = Path(config.path)
    else:
        paths = sorted(Path(p) for p in glob.glob(config.path))
        if not paths:
            raise DataError(f"data.path: {config.path!r} matches no directory or .bin files")
        bad = [p for p in paths if p.suffix != ".bin" or p.stat().st_size % 2]
        if bad:
            raise DataError(f"{bad[0]}: not a uint16 .bin shard (nanoGPT format: raw uint16, even size)")
        return TokenStream(paths)
    cache = Path(config.cache_dir) if config.cache_dir else Path.home() / ".cache" / "trainguard"
    return TokenStream([tokenize_dir(root, config.pattern, cache)])


def free_intervals(lo: int, hi: int, done: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[lo, hi) less the `done` token intervals, in order."""
    free, cursor = [], lo
    for a, b in sorted(done):
        if a > cursor:
            free.append((cursor, min(a, hi)))
        cursor = max(cursor, b)
    if cursor < hi:
        free.append((cursor, hi))
    return [(a, b) for a, b in free if a < b]


def rank_pieces(free: list[tuple[int, int]], rank: int, world_size: int) -> list[tuple[int, int]]:
    """This rank's contiguous share (by token count) of the free intervals, as pieces of them."""
    share = sum(b - a for a, b in free) // world_size
    begin, end = rank * share, (rank + 1) * share
    pieces, seen = [], 0
    for a, b in free:
        lo, hi = max(a, a + begin - seen), min(b, a + end - seen)
        if lo < hi:
            pieces.append((lo, hi))
        seen += b - a
    return pieces


def consumed_intervals(pieces: list[tuple[int, int]], windows: int, block_size: int) -> list[tuple[int, int]]:
    """The tokens the first `windows` windows of `pieces` read as inputs (window by window, in order)."""
    out = []
    for a, b in pieces:
        here = min(windows, max(0, (b - a - 1) // block_size))
        if here:
            out.append((a, a + here * block_size))
        windows -= here
    return out


class ShardLoader:
    """Sequential batches of (input, target) windows from this rank's share of a split.

    A rank's share is contiguous; after the world size changes (a node kept out and the job re-formed,
    agent/culprit.py) the data is re-cut: the windows every rank of the old layout had consumed become
    `done`, and the new ranks share what is left, so no window is read twice and none is skipped (but
    for the few tokens at a piece's end, shorter than a window).
    """

    def __init__(self, stream: TokenStream, *, block_size: int, rank: int, world_size: int,
                 split: str = "train", val_fraction: float = 0.02, device: str = "cpu"):
        total = len(stream)
        val_start = int(total * (1 - val_fraction))
        self.bounds = (0, val_start) if split == "train" else (val_start, total)
        self.split, self.rank, self.world_size = split, rank, world_size
        self.stream, self.block_size, self.device = stream, block_size, device
        self._cut([])
        if self.windows < 1:
            lo, hi = self.bounds
            raise DataError(f"{split} split has {hi - lo} tokens: too few for {world_size} ranks "
                            f"of {block_size + 1}-token windows")
        self.consumed = 0          # windows consumed since the start; the exact, resumable position
        self.delay_seconds = 0.0   # set by fault injection (slowio) to emulate a slow filesystem

    def _cut(self, done: list[tuple[int, int]]) -> None:
        """This rank's pieces of the split less `done`, and the windows in each."""
        self.done = sorted(done)
        self.pieces = rank_pieces(free_intervals(*self.bounds, self.done), self.rank, self.world_size)
        counts = [max(0, (b - a - 1) // self.block_size) for a, b in self.pieces]
        self.pieces = [p for p, n in zip(self.pieces, counts) if n]
        self.piece_windows = [n for n in counts if n]
        self.first_window = np.cumsum([0] + self.piece_windows)
        self.windows = int(self.first_window[-1])
        self.start = self.pieces[0][0] if self.pieces else self.bounds[0]

    def _window_start(self, index: int) -> int:
        piece = int(np.searchsorted(self.first_window, index, side="right")) - 1
        return self.pieces[piece][0] + (index - int(self.first_window[piece])) * self.block_size

    def next_batch(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next `n` windows as (x, y) of shape (n, block_size); wraps to the start of the share."""
        if self.delay_seconds:
            import time

            time.sleep(self.delay_seconds)
        T, first = self.block_size, self.consumed % self.windows
        if len(self.pieces) == 1 and first + n <= self.windows:   # the common case: one contiguous read
            begin = self.start + first * T
            tokens = self.stream.read(begin, begin + n * T + 1)
            x = np.lib.stride_tricks.sliding_window_view(tokens[:-1], T)[::T]
            y = np.lib.stride_tricks.sliding_window_view(tokens[1:], T)[::T]
        else:
            starts = [self._window_start((first + i) % self.windows) for i in range(n)]
            rows = [self.stream.read(b, b + T + 1) for b in starts]
            x, y = np.stack([r[:-1] for r in rows]), np.stack([r[1:] for r in rows])
        self.consumed += n
        return self._to_device(x), self._to_device(y)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array.astype(np.int64))
        if self.device == "cpu":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    @property
    def epoch(self) -> int:
        return self.consumed // self.windows

    def tokens_loaded(self) -> int:
        return self.consumed * self.block_size

    def skip(self, n_windows: int) -> None:
        """Advance past `n_windows` without reading them (a rollback skips the data that hurt)."""
        self.consumed += n_windows

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "world_size": self.world_size, "done": [list(d) for d in self.done]}

    def load_state_dict(self, state: dict) -> None:
        """Resume at a saved position; saved with another world size, re-cut the data first."""
        consumed = int(state["consumed"])
        world = int(state.get("world_size", self.world_size))
        done = [tuple(d) for d in state.get("done") or ()]
        if world == self.world_size and done == self.done:
            self.consumed = consumed
            return
        now_done = list(done)
        for old_rank in range(world):
            pieces = rank_pieces(free_intervals(*self.bounds, done), old_rank, world)
            now_done += consumed_intervals(pieces, consumed, self.block_size)
        self._cut(_merged(now_done))
        if self.windows < 1:               # every window read: the next epoch starts over
            self._cut([])
        self.consumed = 0


def _merged(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
