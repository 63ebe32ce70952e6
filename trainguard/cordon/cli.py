"""`trainguard cordon RUN HOST --reason TEXT`: keep a node out of the job by hand.

The launcher honours only a cordon signed with the run's checkpoint key (trainguard/cordon/__init__.py), so a file
written by hand keeps nothing out; this command writes the signed one, as a culprit verdict or a replica
mismatch would, with `by: human` and the reason given. `trainguard uncordon RUN HOST` lets the node back.
Exit codes: 0 cordoned (or already cordoned); 2 usage (no such run directory, not a node name, no usable key).
"""

from __future__ import annotations

import argparse
import getpass
import sys
from pathlib import Path

from trainguard import cordon, paths

EXIT_OK, EXIT_USAGE = 0, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = "exit codes: 0 cordoned, 2 usage (no such run directory, not a node name, no usable key)"
    parser.add_argument("run_dir", metavar="RUN", type=Path, help="the run directory")
    parser.add_argument("host", metavar="HOST", help="the node to keep out of the job")
    parser.add_argument("--reason", required=True, help="why, for whoever reads the cordon later")
    parser.add_argument("--key-file", default=None,
                        help="the run's checkpoint key (default: where `trainguard train` looks for it)")


def run(args: argparse.Namespace) -> int:
    try:
        paths.run_dir(args.run_dir)
        cordon.check_host(args.host)
        from trainguard.runtime.cordon_key import checker, write_cordon   # the runtime, when it runs (Layers)

        signer = checker(args.key_file)
        key, where = signer.key, signer.where
        if key is None:
            raise ValueError(f"cannot sign the cordon: {where}")
        existing = cordon.read_one(args.run_dir, args.host, signer)
        if existing is not None and existing.honoured:
            print(f"{args.host} is already cordoned: {existing.record.get('reason', '')}")
            return EXIT_OK
        path = write_cordon(args.run_dir, args.host, key, args.key_file, reason=args.reason,
                            by=f"human:{getpass.getuser()}")
    except (FileNotFoundError, ValueError, OSError) as exc:
        print(f"trainguard cordon: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"{args.host} cordoned ({path}, signed with {where}): its launcher will not join the job "
          f"until `trainguard uncordon {args.run_dir} {args.host}`")
    return EXIT_OK


def run_key(key_file: str | None) -> tuple[bytes | None, str]:
    """The run's checkpoint key as a command reads it (never created: a key only the reader held checks
    nothing), and where it is or why none: what `replay` checks the run's signed policy with."""
    from trainguard.runtime.cordon_key import signing_key   # the runtime, when it runs (Layers)

    return signing_key(key_file)
