"""The exit statuses of every `trainguard` command, and the one place that enforces them.

    0   success: the command did what was asked and found nothing wrong
    1   an answer that means "found something", as each command documents it (`replay --expect`: a
        mismatch; `checkpoint verify`: a checkpoint failed; `convert`: unmapped entries; `incidents
        replay`: a verdict differs; `preflight`: a check failed; `goodput`: malformed lines)
    2   bad input or usage: a message on stderr naming the file, line or field; never a traceback
    70  a crash: an exception the command did not expect (EX_SOFTWARE in BSD's sysexits.h). One line on
        stderr; the traceback only with TRAINGUARD_DEBUG=1 in the environment
    130 interrupted (Ctrl-C)

A script can so tell an answer (1) from a crash (70): before, an uncaught exception exited 1, the very
status that means "a checkpoint failed" or "a verdict differs". Commands may add their own statuses
above 2 (`train`: 4 when the run ended without a durable checkpoint, or a cordon kept the node out);
none uses 70.

`guarded` wraps `trainguard.cli.main`: every command's errors go through it, and its output through
`trainguard.terminal.safe_streams` (run-directory text never reaches a terminal raw).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Callable, Sequence

from trainguard import terminal

OK = 0
FOUND = 1
BAD_INPUT = 2
CRASH = 70
INTERRUPTED = 130
DEBUG_ENV = "TRAINGUARD_DEBUG"


class BadInput(ValueError):
    """Input refused, with a message that names the file, line or field: exit status 2 wherever it is
    raised under a command. The readers' own errors (TLSError, PolicyError, ...) derive from it."""


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least `low`; below it argparse names the flag and exits 2
    (`--nproc 0` trained anyway; `status --tail-kib 0` read nothing, doubled, forever)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    parse.__name__ = "integer"
    return parse


def command_name(argv: Sequence[str]) -> str:
    """`trainguard replay` for a message: the first word that is not an option."""
    chosen = next((a for a in argv if not a.startswith("-")), None)
    return f"trainguard {chosen}" if chosen else "trainguard"


def guarded(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """`main` under the exit-status contract above, with its output escaped for a terminal."""

    @functools.wraps(main)
    def wrapper(argv: list[str] | None = None) -> int:
        name = command_name(sys.argv[1:] if argv is None else argv)
        with terminal.safe_streams():
            try:
                return main(argv)
            except SystemExit as exc:
                if isinstance(exc.code, str):      # SystemExit("message") would exit 1, an answer's status
                    print(exc.code, file=sys.stderr)
                    return BAD_INPUT
                raise
            except BadInput as exc:
                print(f"{name}: {exc}", file=sys.stderr)
                return BAD_INPUT
            except Exception as exc:  # noqa: BLE001 - the last line of defence: a crash, said as one
                return crashed(name, exc)

    return wrapper


def crashed(name: str, exc: BaseException) -> int:
    """One line for an unexpected exception (the traceback under TRAINGUARD_DEBUG=1); CRASH."""
    import traceback     # only on the way out of a crash: not on every command's start

    where = ""
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        last = frames[-1]
        where = f" at {os.path.basename(last.filename)}:{last.lineno}"
    message = str(exc).splitlines()[0][:300] if str(exc) else ""
    print(f"{name}: internal error: {type(exc).__name__}{where}: {message} (exit {CRASH}, a bug in trainguard; "
          f"{DEBUG_ENV}=1 shows the traceback)", file=sys.stderr)
    if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        traceback.print_exception(exc, file=sys.stderr)
    return CRASH
