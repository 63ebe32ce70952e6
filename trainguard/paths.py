"""User-named paths checked before they are opened, so a typo, a device or a FIFO is named for what it is.

Opening a FIFO blocks until someone writes to it and reading /dev/zero never ends: every command that takes
a file or a run directory from the user asks here first, and the message it raises names what was found.
Each raises FileNotFoundError (the commands already turn that into a message and exit 2).
"""

from __future__ import annotations

import os
from pathlib import Path


def what_is(path: Path) -> str:
    """A few words for what is at `path`: "no such file or directory", "is a directory", "is a FIFO", ..."""
    if not path.exists():
        return "no such file or directory"
    if path.is_dir():
        return "is a directory"
    if path.is_file():
        return "is a regular file"
    if path.is_fifo():
        return "is a FIFO"
    if path.is_char_device() or path.is_block_device():
        return "is a device"
    if path.is_socket():
        return "is a socket"
    return "is not a regular file"


def run_dir(path: str | os.PathLike[str], what: str = "run directory") -> Path:
    """`path` as a Path when it is a directory; FileNotFoundError naming what it is instead."""
    root = Path(path)
    if root.is_dir():
        return root
    if not root.exists():
        raise FileNotFoundError(f"{root}: no such {what}")
    raise FileNotFoundError(f"{root}: {what_is(root)}, not a {what}")


def regular_file(path: str | os.PathLike[str], what: str = "file") -> Path:
    """`path` as a Path when it is a regular file (or a link to one); FileNotFoundError otherwise."""
    file = Path(path)
    if file.is_file():
        return file
    if not file.exists():
        raise FileNotFoundError(f"{file}: no such {what}")
    raise FileNotFoundError(f"{file}: {what_is(file)}, not a {what}")
