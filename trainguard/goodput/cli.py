"""`trainguard goodput RUN_DIR [--json]`: goodput and badput of a run, by cause, from its TLS log.

Reads ``RUN/tls/rank-0.jsonl`` (the lowest rank there is, or ``--rank``; a TLS file may be given
instead of a run directory), the agents' decisions (``alert`` and ``action`` events of
``RUN/tls/node-*.jsonl``) so a hang is split at the restore decision, and ``RUN/incidents/*/incident.json``
so each hang names its incident. Every malformed line is reported as ``file:line: message`` on stderr and
left out of the numbers.

Exit codes: 0 computed; 1 computed, but some lines were malformed; 2 usage error, no log, no records.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from trainguard import event_types, rundir
from trainguard import paths, tls
from trainguard import policy as policy_mod
from trainguard.progress import Progress
from trainguard.goodput import CAUSES, Goodput, GoodputConfig, Incident, compute

EXIT_OK, EXIT_MALFORMED, EXIT_USAGE = 0, 1, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = "exit codes: 0 ok, 1 some lines malformed (reported, numbers still shown), 2 nothing to read"
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="a run directory, or one TLS .jsonl file")
    parser.add_argument("--rank", type=int, help="read this rank's log (default: the lowest, normally 0)")
    parser.add_argument("--slow-factor", "--stall-factor", dest="slow_factor", type=float,
                        default=GoodputConfig.slow_factor,
                        help="a step this many times the median is slow (default: %(default)s)")
    parser.add_argument("--policy", metavar="FILE", help="policy YAML: alerts.stall_seconds, the interval without "
                                                         "a step that is a stall, not a slow step (default: built-in)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def find_log(run_dir: Path, rank: int | None) -> Path:
    if run_dir.is_file():
        return run_dir
    paths.run_dir(run_dir, "run directory or log")
    if rank is not None:
        path = rundir.rank_log(run_dir, rank)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such log")
        return path
    logs = [(int(m.group(1)), p) for p in rundir.tls_dir(run_dir).glob("rank-*.jsonl")
            if (m := re.fullmatch(r"rank-([0-9]+)\.jsonl", p.name))]
    if not logs:
        raise FileNotFoundError(f"{rundir.tls_dir(run_dir)}: no rank-*.jsonl log")
    return min(logs)[1]


def agent_decisions(run_dir: Path, malformed: list[str]) -> list[dict]:
    """The agents' `alert` and `action` event records (node logs), the only node records goodput reads."""
    from trainguard.report.files import log_files

    found = []
    for path in log_files(run_dir)[0]:
        for line in tls.iter_lines(path):
            if line.error is not None:
                malformed.append(str(line.error))
                continue
            event = line.record.get("event")
            if isinstance(event, dict) and event.get("type") in (event_types.ALERT, event_types.ACTION):
                found.append(line.record)
    return found


def read_incidents(run_dir: Path, malformed: list[str]) -> list[Incident]:
    """The id and detection time of each verdict in RUN/incidents (read, strictly, by trainguard.incidents)."""
    from trainguard import incidents

    found = []
    for _incident_id, verdict, problem in incidents.scan(run_dir):
        if problem is not None:
            malformed.append(problem)
        elif verdict is not None:
            found.append(Incident(verdict["id"], float(verdict["detected_at"])))
    return found


def run(args: argparse.Namespace) -> int:
    if args.slow_factor <= 1:
        print(f"trainguard goodput: --slow-factor must be above 1, got {args.slow_factor}", file=sys.stderr)
        return EXIT_USAGE
    try:
        stall_seconds = policy_mod.load(args.policy).alerts.stall_seconds
    except policy_mod.PolicyError as exc:
        print(f"trainguard goodput: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        path = find_log(args.run_dir, args.rank)
    except FileNotFoundError as exc:
        print(f"trainguard goodput: {exc}", file=sys.stderr)
        return EXIT_USAGE
    records, malformed = [], []
    with Progress("goodput") as shown:
        shown.step(0, path.name)
        for line in shown.counted(tls.iter_lines(path)):
            if line.error is not None:
                malformed.append(str(line.error))
                print(line.error, file=sys.stderr)
            else:
                records.append(line.record)
    if not records:
        print(f"trainguard goodput: {path}: no records", file=sys.stderr)
        return EXIT_USAGE
    incidents: list[Incident] = []
    if args.run_dir.is_dir():
        before = len(malformed)
        records += agent_decisions(args.run_dir, malformed)
        incidents = read_incidents(args.run_dir, malformed)
        for problem in malformed[before:]:
            print(problem, file=sys.stderr)
    result = compute(records, GoodputConfig(slow_factor=args.slow_factor, stall_seconds=stall_seconds), incidents)
    if args.json:
        print(json.dumps({"source": str(path), "records": len(records), "malformed": malformed,
                          **result.to_dict()}, indent=2))
    else:
        print(render(result, path, len(records), len(malformed)))
    return EXIT_MALFORMED if malformed else EXIT_OK


def render(result: Goodput, path: Path, records: int, malformed: int) -> str:
    lines = [f"{path}: {records} records" + (f", {malformed} malformed (see stderr)" if malformed else ""),
             f"  {'wall time':<18}{_duration(result.total_seconds):>12}",
             f"  {'productive':<18}{_duration(result.productive_seconds):>12}  {_pct(result.goodput_ratio)}"
             "  goodput",
             "  badput by cause:"]
    ratios = result.badput_ratio
    for cause in CAUSES:
        lines.append(f"    {cause:<16}{_duration(result.badput_seconds[cause]):>12}  {_pct(ratios[cause])}")
    median = f"{result.median_step_seconds:.3f}s" if result.median_step_seconds is not None else "n/a"
    lines.append(f"  steps {result.productive_steps}, restarts {result.restarts}, rollbacks {result.rollbacks}, "
                 f"median step {median}")
    if result.in_process_restarts:
        lines.append(f"  in-process restarts {result.in_process_restarts}: the snapshots kept "
                     f"{result.snapshot_steps_saved} step(s) a restore from the checkpoint would have lost")
    for number, hang in enumerate(result.hangs, 1):
        decided = (f"restore decided {_duration(hang.stall_seconds)} after the last step"
                   + (f" ({hang.decided_by})" if hang.decided_by else "")) if hang.decided_at is not None else \
            "no restore decision recorded (a crash, restarted by the launcher)"
        lines.append(f"  hang {number} at {tls.format_timestamp(hang.last_progress)}: stall "
                     f"{_duration(hang.stall_seconds)}, restart_recovery {_duration(hang.restart_recovery_seconds)}; "
                     f"{decided}; incident {hang.incident or 'none recorded'}")
    return "\n".join(lines)


def _pct(ratio: float) -> str:
    return f"{100 * ratio:6.2f}%"


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.2f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"
