"""`trainguard preflight`: exit 0 only when every check passes; a table on a terminal, JSON with --json.

The result is also written to RUN/preflight.json (or ~/.cache/trainguard/preflight.json without
--run-dir), where the agent's preflight collector exports it to Prometheus.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import textwrap
from pathlib import Path

from trainguard import policy as policy_mod
from trainguard.runtime import preflight_result as result_mod
from trainguard.preflight import run_preflight

CHECK_NAMES = ("environment", "nccl_env", "gpus", "storage", "checkpoint_drill", "collective")
MARKS = {"pass": "PASS", "fail": "FAIL", "skip": "skip"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", help="the run directory: checkpoints are checked under RUN/checkpoints, "
                                          "the result is written to RUN/preflight.json")
    parser.add_argument("--checkpoint-dir", help="check this checkpoint directory instead of RUN/checkpoints")
    parser.add_argument("--expect", metavar="FILE", help="lock file the versions must match")
    parser.add_argument("--write-lock", metavar="FILE", help="write this node's versions as a lock file")
    parser.add_argument("--policy", metavar="FILE", help="policy YAML (preflight thresholds)")
    parser.add_argument("--skip", action="append", default=[], choices=CHECK_NAMES, metavar="CHECK",
                        help=f"leave a check out (repeatable): {', '.join(CHECK_NAMES)}")
    parser.add_argument("--output", metavar="FILE", help="where to write the result "
                                                         "(default RUN/preflight.json or ~/.cache/trainguard/)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        policy = policy_mod.load(args.policy)
    except policy_mod.PolicyError as exc:
        print(f"trainguard preflight: {exc}", file=sys.stderr)
        return 2
    report = run_preflight(run_dir=args.run_dir, checkpoint_dir=args.checkpoint_dir, expect=args.expect,
                           write_lock=args.write_lock, policy=policy, skip=tuple(args.skip))
    path = result_mod.default_path(args.run_dir) if args.output is None else Path(args.output)
    try:
        result_mod.write(report, path)
        written = str(path)
    except OSError as exc:   # the verdict still stands; the agent just cannot export it
        written = None
        print(f"trainguard preflight: could not write {path}: {exc.strerror or exc}", file=sys.stderr)
    if args.json:
        print(json.dumps({**report.to_dict(), "written_to": written}, indent=2))
    else:
        print(render_table(report))
        if written:
            print(f"\nresult written to {written}")
    return 0 if report.passed else 1


def render_table(report: result_mod.Report) -> str:
    width = shutil.get_terminal_size((100, 24)).columns
    name_width = max(len(c.name) for c in report.checks) if report.checks else 5
    lead = name_width + 17
    lines = [f"{'check':<{name_width}}  {'result':<6} {'time':>6}  detail"]
    for check in report.checks:
        body = textwrap.wrap(check.message, max(30, width - lead), break_long_words=False,
                             break_on_hyphens=False) or [""]   # paths stay whole
        lines.append(f"{check.name:<{name_width}}  {MARKS[check.status]:<6} {check.seconds:>5.1f}s  {body[0]}")
        lines.extend(" " * lead + more for more in body[1:])
    lines.append(f"\n{report.host}: {verdict(report.checks)} (environment {report.lock_hash})")
    return "\n".join(lines)


def verdict(checks: list) -> str:
    """The last line's verdict. A skipped check proved nothing, so "all checks passed" is said only when
    every check ran and passed; otherwise the skipped ones are named."""
    failed = [c.name for c in checks if c.status == "fail"]
    skipped = [c.name for c in checks if c.status == "skip"]
    passed = len(checks) - len(failed) - len(skipped)
    said = f"FAILED: {', '.join(failed)}" if failed else (
        f"all {passed} checks passed" if not skipped else f"{passed} of {len(checks)} checks passed")
    return said + (f"; skipped, so not checked: {', '.join(skipped)}" if skipped else "")
