"""`trainguard report RUN_DIR [-o FILE] [--policy FILE]`: one self-contained HTML file, no network."""

from __future__ import annotations

import argparse
import os
import sys

from trainguard import policy as policy_mod
from trainguard.formats.discover import SeveralRuns
from trainguard.report import write_report  # noqa: F401  (also the library entry point: demo uses it)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (with tls/ and checkpoints/)")
    parser.add_argument("-o", "--output", metavar="FILE", help="where to write the report (default RUN_DIR/report.html)")
    parser.add_argument("--policy", metavar="FILE", help="policy YAML for cost and thresholds (default: built-in)")
    parser.add_argument("--no-goodput", action="store_true",
                        help="leave out the goodput breakdown, the one part whose memory grows with the "
                             "run (about 1 KiB per step)")


def run(args: argparse.Namespace) -> int:
    if args.output and os.path.isdir(args.output):
        print(f"trainguard report: -o {args.output}: is a directory; name the .html file to write", file=sys.stderr)
        return 2
    try:
        policy = policy_mod.load(args.policy)
        path = write_report(args.run_dir, args.output, policy=policy, goodput=not args.no_goodput)
    except (FileNotFoundError, policy_mod.PolicyError, SeveralRuns) as exc:
        print(f"trainguard report: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0
