"""Text from the run directory made safe to print: terminal control sequences are shown, never obeyed.

Anyone who can write the run directory writes the text that `status`, `replay`, `incidents` and the other
commands print (event fields, alert names, incident reasons, host names). A terminal obeys what it is sent:
ESC c or CSI 2J clears the screen (and with it the "restore NOT done, a human is paged" line printed
above), OSC 52 writes the clipboard, OSC 8 hides a link, a carriage return overwrites the line, and the
bidirectional overrides (U+202E ...) show text in another order than it is. `escape` replaces every such
character with its `\\uXXXX` spelling, which reads plainly and is also a valid escape inside a JSON string,
so `--json` output stays valid whatever its encoder let through.

One function, applied at one place: `safe_streams` (entered by `trainguard.cli.main`) wraps stdout and
stderr, so every command's text output goes through `escape` however it was printed.
"""

from __future__ import annotations

import contextlib
import re
import sys
from typing import Any, Iterator, Mapping, MutableMapping, TextIO

# C0 controls but tab and newline (ESC, CR, BEL, backspace, ...), DEL, the C1 controls (0x80-0x9f:
# a single U+009B is a CSI on many terminals), the bidirectional marks, embeddings, overrides and isolates,
# and the line/paragraph separators that some terminals break lines at.
UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")


def _spelled(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def escape(text: object) -> str:
    """`text` as a string in which no character can act on a terminal: each control character, C1
    character or bidirectional control is written as `\\uXXXX`; newlines and tabs are kept."""
    return UNSAFE.sub(_spelled, text if isinstance(text, str) else str(text))


class SafeStream:
    """A text stream whose writes go through `escape`; everything else (isatty, fileno, buffer, flush,
    encoding) is the wrapped stream's."""

    def __init__(self, stream: TextIO):
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(escape(text))
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def unwrapped(stream: Any) -> Any:
    """The stream under a `SafeStream`, for the two writers of their own control sequences: the trainer's
    progress bar (a carriage return; it prints numbers only) and the log's console renderer (colours; its
    string values go through `escape_values` first)."""
    return stream._stream if isinstance(stream, SafeStream) else stream


def escape_values(logger: Any, method: str, event_dict: MutableMapping[str, Any]) -> Mapping[str, Any]:
    """A structlog processor: every string value escaped (nested values are rendered with repr(), which
    escapes non-printable characters itself)."""
    return {key: escape(value) if isinstance(value, str) else value for key, value in event_dict.items()}


@contextlib.contextmanager
def safe_streams() -> Iterator[None]:
    """stdout and stderr escaped for the block (nested entries wrap once); put back afterwards."""
    saved = sys.stdout, sys.stderr
    if not isinstance(sys.stdout, SafeStream):
        sys.stdout = SafeStream(sys.stdout)
    if not isinstance(sys.stderr, SafeStream):
        sys.stderr = SafeStream(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
