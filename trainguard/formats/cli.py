"""`trainguard convert IN -o OUT.jsonl`: a TensorBoard event file, a Hugging Face trainer_state.json, a
Megatron-LM or a torchtitan log as TLS. What could not be mapped is listed (file and position) and makes
the exit status 1; what was passed over on purpose is said once per kind with its count (status 0);
unreadable input, or input with no record in it, is status 2."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from trainguard import formats
from trainguard.progress import Progress

EXIT_OK, EXIT_UNMAPPED, EXIT_USAGE = 0, 1, 2
SHOWN = 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", metavar="IN", type=Path,
                        help="an event file, trainer_state.json, Megatron or torchtitan log")
    parser.add_argument("-o", "--output", required=True, type=Path, help="the TLS file to write (.jsonl)")
    parser.add_argument("--map", action="append", default=[], metavar="TAG=FIELD",
                        help="TensorBoard: read scalar TAG as the TLS metric FIELD (adds to the default map)")


def run(args: argparse.Namespace) -> int:
    try:
        mapping = formats.parse_map(args.map)
    except ValueError as exc:
        return usage(str(exc))
    if not args.input.is_file():
        return usage(f"{args.input}: no such file")
    kind = formats.detect(args.input)
    if kind == formats.TLS:
        return usage(f"{args.input}: not a TensorBoard event file, trainer_state.json, Megatron or torchtitan log "
                     "(it reads as TLS already, or is none of them)")
    if (refusal := output_refusal(args.input, args.output)) is not None:
        return usage(refusal)
    temporary = args.output.with_name(args.output.name + ".partial")
    notes = formats.Notes()
    try:
        with open(temporary, "wb") as out, Progress("convert") as shown:
            shown.step(0, args.input.name)
            written, problems = formats.write_tls(args.input, out, mapping, notes, progress=shown)
        if written:
            os.replace(temporary, args.output)
    finally:
        temporary.unlink(missing_ok=True)      # a full disk, an interrupt or nothing read leaves no .partial
    if not written:
        for problem in problems[:SHOWN]:
            print(f"  not mapped: {problem}", file=sys.stderr)
        return usage(f"{args.input}: read as a {kind} log, and no record in it ({len(problems)} not mapped)")
    clock = " (no wall clock: each record's timestamp is its step, marked \"clock\": \"none\")" \
        if notes.clock == formats.NO_CLOCK else ""
    print(f"trainguard convert: {args.input} ({kind}) -> {args.output}: {written} records{clock}")
    for line in notes.lines(str(args.input)):
        print(f"  {line}", file=sys.stderr)
    for problem in problems[:SHOWN]:
        print(f"  not mapped: {problem}", file=sys.stderr)
    if len(problems) > SHOWN:
        print(f"  ... and {len(problems) - SHOWN} more", file=sys.stderr)
    return EXIT_UNMAPPED if problems else EXIT_OK


def output_refusal(source: Path, output: Path) -> str | None:
    """Why `-o OUTPUT` cannot be written, or None. The output replaces its path when done, so the input
    itself, by any name (a symlink, a hard link: the same inode), would be destroyed."""
    if output.is_dir():
        return f"-o {output}: is a directory; name the .jsonl file to write"
    if not output.parent.is_dir():
        return f"-o {output}: no such directory {output.parent}"
    if output.exists() or output.is_symlink():
        try:
            same = os.path.samefile(source, output)
        except OSError:       # a dangling symlink: it is replaced, nothing of the input is at it
            same = False
        if same:
            return f"-o {output}: is the input {source} itself; converting would destroy it"
    return None


def usage(message: str) -> int:
    print(f"trainguard convert: {message}", file=sys.stderr)
    return EXIT_USAGE
