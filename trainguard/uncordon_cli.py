"""`trainguard uncordon RUN HOST`: let a cordoned node's launcher join the job again.

Removes ``RUN/control/cordon/HOST`` whether or not it is honoured (trainguard/cordon.py: signed with the
run's checkpoint key), and says which it was: a cordon that was not honoured never kept the node out.
Exit codes: 0 removed; 2 usage (no such run directory, not a node name, HOST not cordoned).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainguard import cordon, paths

EXIT_OK, EXIT_USAGE = 0, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = "exit codes: 0 removed, 2 usage (no such run directory, HOST not cordoned)"
    parser.add_argument("run_dir", metavar="RUN", type=Path, help="the run directory")
    parser.add_argument("host", metavar="HOST", help="the node to let join the job again")


def run(args: argparse.Namespace) -> int:
    try:
        paths.run_dir(args.run_dir)
        from trainguard.trainer.cordon_key import signing_key   # a command may reach the trainer's key

        key, where = signing_key()
        found = cordon.read_one(args.run_dir, args.host, key)
    except (FileNotFoundError, ValueError) as exc:
        print(f"trainguard uncordon: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if found is None or not cordon.remove(args.run_dir, args.host):
        present = sorted(cordon.read_all(args.run_dir, key))
        print(f"trainguard uncordon: {args.host} is not cordoned in {args.run_dir} "
              f"(cordoned: {', '.join(present) or 'none'})", file=sys.stderr)
        return EXIT_USAGE
    if found.honoured:
        print(f"{args.host} uncordoned: its launcher may join the job again")
    else:
        print(f"{args.host} uncordoned: removed a cordon that was NOT honoured ({found.why_refused()}, checked "
              f"with {where}); it never kept the node out")
    return EXIT_OK
