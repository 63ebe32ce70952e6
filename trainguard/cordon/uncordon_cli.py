"""`trainguard uncordon RUN HOST`: let a cordoned node's launcher join the job again, for good.

Removes ``RUN/control/cordon/HOST`` whether or not it is honoured (trainguard/cordon/__init__.py: signed with the
run's checkpoint key), and says which it was: a cordon that was not honoured never kept the node out. A
genuine cordon is first revoked: its id goes into the signed revocation list beside the key
(``<key file>.revoked``, outside RUN/), so a copy of it put back into the run directory is refused as
``revoked`` by the launcher, `trainguard incidents` and the agent (docs/incidents.md).
Exit codes: 0 removed; 2 usage (no such run directory, not a node name, HOST not cordoned, a missing or
bad --key-file, a cordon that cannot be checked or revoked: no key, a revocation list that does not prove
itself).
"""

from __future__ import annotations

import argparse
import getpass
import sys
from pathlib import Path

from trainguard import cordon, paths, signed

EXIT_OK, EXIT_USAGE = 0, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("exit codes: 0 removed, 2 usage (no such run directory, HOST not cordoned, no usable key, "
                     "a revocation list that does not prove itself)")
    parser.add_argument("run_dir", metavar="RUN", type=Path, help="the run directory")
    parser.add_argument("host", metavar="HOST", help="the node to let join the job again")
    parser.add_argument("--key-file", default=None,
                        help="the run's checkpoint key (default: where `trainguard train` looks for it); "
                             "the revocation list lives beside it")


def run(args: argparse.Namespace) -> int:
    try:
        paths.run_dir(args.run_dir)
        key = checker(args.key_file)
        found = cordon.read_one(args.run_dir, args.host, key)
        if found is not None and found.refused in (signed.NO_KEY, cordon.REVOCATIONS_UNREADABLE):
            raise ValueError(f"cannot revoke the cordon of {args.host}: {found.why_refused()} (key: {key.where}); "
                             f"nothing was removed")
        if found is not None and found.honoured:
            cordon.revoke(key, args.run_dir, found, by=f"human:{getpass.getuser()}")
    except (FileNotFoundError, ValueError, OSError) as exc:
        print(f"trainguard uncordon: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if found is None or not cordon.remove(args.run_dir, args.host):
        present = sorted(cordon.read_all(args.run_dir, key))
        print(f"trainguard uncordon: {args.host} is not cordoned in {args.run_dir} "
              f"(cordoned: {', '.join(present) or 'none'})", file=sys.stderr)
        return EXIT_USAGE
    print(message(args, found, key))
    return EXIT_OK


def checker(key_file: str | None) -> cordon.CordonKey:
    """The key and its revocation list; ValueError naming the path for a --key-file that cannot be used."""
    from trainguard.runtime.cordon_key import checker as find   # the runtime, when it runs (Layers)

    key = find(key_file)
    if key_file is not None and key.key is None:
        raise ValueError(f"--key-file {key_file}: {key.where}")
    return key


def message(args: argparse.Namespace, found: cordon.Cordon, key: cordon.CordonKey) -> str:
    if found.honoured:
        return (f"{args.host} uncordoned: its launcher may join the job again; the cordon {found.ident} is "
                f"revoked in {key.revocations} (a copy put back is refused)")
    if found.refused == cordon.REVOKED:
        return f"{args.host} uncordoned: removed a copy of a cordon revoked before; it kept nothing out"
    return (f"{args.host} uncordoned: removed a cordon that was NOT honoured ({found.why_refused()}, checked "
            f"with {key.where}); it never kept the node out")
