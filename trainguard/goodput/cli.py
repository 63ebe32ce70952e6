"""`trainguard goodput RUN_DIR [--json]`: goodput and badput of a run, by cause, from its TLS log.

Reads ``RUN/tls/rank-0.jsonl`` (the lowest rank there is, or ``--rank``; a TLS file may be given
instead of a run directory), the agents' decisions (``alert`` and ``action`` events of
``RUN/tls/node-*.jsonl``) so a hang is split at the restore decision, and ``RUN/incidents/*/incident.json``
so each hang names its incident. Every malformed line is reported as ``file:line: message`` on stderr and
left out of the numbers.

Beside the split: what each useful token cost (dollars at the policy's price, and joules from the GPUs'
energy counter in the agents' records), the checkpoint autopilot's recommended interval from the run's
own measurements, and with ``--what-if`` the run's recorded failures replayed under other intervals.

Exit codes: 0 computed; 1 computed, but some lines were malformed; 2 usage error, no log, no records.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from trainguard import event_types, rundir
from trainguard import paths, tls
from trainguard import policy as policy_mod
from trainguard.progress import Progress
from trainguard.decide import checkpoint_interval as ci
from trainguard.decide.cost import gpu_cost
from trainguard.goodput import CAUSES, LOST_CAUSES, PRODUCTIVE, Goodput, GoodputConfig, Incident, compute

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
    parser.add_argument("--what-if", nargs="?", const="", default=None, metavar="SECONDS,...",
                        help="replay the run's recorded failures under other checkpoint intervals (default: the "
                             "recorded one, the recommended one and 1/4x to 4x of it; or these, comma-separated)")


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


def agent_decisions(run_dir: Path, malformed: list[str], energy: list[dict] | None = None) -> list[dict]:
    """The agents' `alert` and `action` event records (node logs), the only node records goodput reads
    into the split; records with the GPUs' energy counter go to `energy` when given."""
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
            elif energy is not None and isinstance(line.record.get("hardware"), dict) and \
                    "gpus" in line.record["hardware"]:
                energy.append(line.record)
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
        policy = policy_mod.load(args.policy)
        intervals = _intervals(args.what_if)
    except (policy_mod.PolicyError, ValueError) as exc:
        print(f"trainguard goodput: {exc}", file=sys.stderr)
        return EXIT_USAGE
    stall_seconds = policy.alerts.stall_seconds
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
    metered: list[dict] = []
    if args.run_dir.is_dir():
        before = len(malformed)
        records += agent_decisions(args.run_dir, malformed, metered)
        incidents = read_incidents(args.run_dir, malformed)
        for problem in malformed[before:]:
            print(problem, file=sys.stderr)
    from trainguard import energy

    # The agents' samples of every GPU; without them, rank 0's own counter standing for each of the job's GPUs.
    series = energy.samples_of(metered)
    if not series:
        gpus = max((r["system"]["gpu_count"] for r in records if isinstance(r.get("system"), dict)
                    and isinstance(r["system"].get("gpu_count"), int)), default=0)
        series = energy.samples_of((r for r in records if "metrics" in r), scale=max(gpus, 1))
    curve = energy.Curve(series) if series else None
    result = compute(records, GoodputConfig(slow_factor=args.slow_factor, stall_seconds=stall_seconds), incidents,
                     energy=curve if curve else None)
    autopilot = checkpoint_section(records, policy, result)
    what_if = replay_intervals(records, result, autopilot, intervals) if intervals is not None else None
    priced = price(result, policy)
    if args.json:
        out = {"source": str(path), "records": len(records), "malformed": malformed, **result.to_dict(),
               "cost": priced, "checkpoint": autopilot}
        if what_if is not None:
            out["what_if"] = what_if
        print(json.dumps(out, indent=2))
    else:
        print(render(result, path, len(records), len(malformed)))
        print(render_useful(priced, result))
        print(render_checkpoint(autopilot))
        if what_if is not None:
            print(render_what_if(what_if))
    return EXIT_MALFORMED if malformed else EXIT_OK


# ------------------------------------------------------------------------------ useful work, priced

def price(result: Goodput, policy: policy_mod.Policy) -> dict:
    """Dollars (the policy's price, its GPU count override else the records') and joules, per token and
    per useful token (the tokens of productive steps: not thrown away by a rollback or restart, not skipped)."""
    gpus = policy.cost.gpu_count_override or result.gpu_count
    usd = gpu_cost(result.total_seconds, gpus, policy.cost.price_per_gpu_hour)
    out: dict = {"gpu_count": gpus, "price_per_gpu_hour": policy.cost.price_per_gpu_hour, "cost_usd": usd,
                 "tokens": result.tokens, "useful_tokens": result.useful_tokens,
                 "usd_per_million_tokens": _per_million(usd, result.tokens),
                 "usd_per_million_useful_tokens": _per_million(usd, result.useful_tokens),
                 "energy_joules": None, "joules_per_useful_token": None, "joules_per_token": None,
                 "energy_per_step_joules_per_gpu": result.energy_per_step_joules}
    if result.energy_joules is not None:
        total = sum(result.energy_joules.values())
        out.update(energy_joules=total, joules_by_cause=result.energy_joules,
                   joules_per_token=total / result.tokens if result.tokens else None,
                   joules_per_useful_token=total / result.useful_tokens if result.useful_tokens else None)
    return out


def _per_million(usd: float, tokens: float) -> float | None:
    return usd / tokens * 1e6 if tokens > 0 and usd > 0 else None


def render_useful(priced: dict, result: Goodput) -> str:
    lines = [f"  tokens {priced['tokens']:.0f}, useful {priced['useful_tokens']:.0f} "
             f"({_pct(priced['useful_tokens'] / priced['tokens']) if priced['tokens'] else '   n/a'})"]
    if priced["cost_usd"] > 0:
        lines.append(f"  cost ${priced['cost_usd']:.4f} ({priced['gpu_count']} GPUs at "
                     f"${priced['price_per_gpu_hour']:g}/GPU-hour): "
                     f"${_maybe(priced['usd_per_million_tokens'])} per 1M tokens, "
                     f"${_maybe(priced['usd_per_million_useful_tokens'])} per 1M useful tokens")
    else:
        lines.append("  cost n/a: no GPUs in the records (set cost.gpu_count_override in the policy to bill a CPU run)")
    if priced["energy_joules"] is None:
        lines.append("  energy n/a: no GPU energy counter in the agents' records (RUN/tls/node-*.jsonl)")
        return "\n".join(lines)
    by = priced["joules_by_cause"]
    lost = {cause: by[cause] for cause in LOST_CAUSES if by[cause] > 0}
    lines.append(f"  energy {priced['energy_joules'] / 3.6e6:.4f} kWh ({priced['energy_joules']:.0f} J): "
                 f"{_maybe(priced['joules_per_token'], '.4g')} J per token, "
                 f"{_maybe(priced['joules_per_useful_token'], '.4g')} J per useful token; "
                 f"productive {by[PRODUCTIVE]:.0f} J"
                 + "".join(f", {cause} {joules:.0f} J" for cause, joules in lost.items()))
    if priced["energy_per_step_joules_per_gpu"] is not None:
        lines.append(f"  energy per step {priced['energy_per_step_joules_per_gpu']:.4g} J per GPU (median)")
    return "\n".join(lines)


def _maybe(value: float | None, spec: str = ".4f") -> str:
    return "n/a" if value is None else format(value, spec)


# ------------------------------------------------------------------------------ the checkpoint interval

def _failure_log(records: list[dict]) -> ci.FailureLog:
    log = ci.FailureLog()
    for record in sorted((r for r in records if "event" not in r or r["event"].get("type") not in
                          (event_types.ALERT, event_types.ACTION)), key=lambda r: float(r["timestamp"])):
        log.observe(record)
    return log


def checkpoint_section(records: list[dict], policy: policy_mod.Policy, result: Goodput) -> dict:
    """The autopilot's view of the run: its measurements at the end, the interval it recommends, the one
    the run applied (its last `checkpoint_interval` event) or kept (the median time between saves)."""
    log = _failure_log(records)
    now = log.last_ts if log.last_ts is not None else 0.0
    measured = log.measured(now, policy.checkpoint)
    recommendation = ci.recommend(measured, policy.checkpoint)
    saves = sorted(float(r["timestamp"]) for r in records
                   if isinstance(r.get("event"), dict) and r["event"].get("type") == ci.SAVE_EVENT)
    gaps = [b - a for a, b in zip(saves, saves[1:]) if b > a]
    observed = statistics.median(gaps) if gaps else None
    return {"applied_seconds": log.applied, "observed_seconds": observed,
            "recommended_seconds": recommendation.interval_seconds if recommendation else None,
            "recommendation": recommendation.inputs() if recommendation else None,
            "failures": len(log.failures), "failure_times": [t - (log.first_ts or 0.0) for t in log.failures],
            "restart_seconds": list(log.restart_costs), "save_seconds": measured.save_seconds,
            "total_seconds": result.total_seconds}


def render_checkpoint(section: dict) -> str:
    applied = section["applied_seconds"]
    kept = (f"applied {_duration(applied)} (autopilot)" if applied is not None else
            f"kept {_duration(section['observed_seconds'])} between saves" if section["observed_seconds"] else
            "no interval seen (fewer than two saves)")
    if section["recommendation"] is None:
        return f"  checkpoint interval: {kept}; recommended n/a (no save measured)"
    rec = section["recommendation"]
    mtbf = rec["mtbf_seconds"]
    restart = rec["restart_seconds"]
    return (f"  checkpoint interval: {kept}; recommended {_duration(section['recommended_seconds'])} "
            f"(Daly; MTBF {_duration(mtbf) if mtbf is not None else 'none'} [{rec['mtbf_source']}, "
            f"{rec['failures']} failures], save {rec['save_seconds']:.3f}s, restart "
            f"{_duration(restart) if restart is not None else 'n/a'}"
            + (f", at the {rec['bound']} bound" if rec["bound"] else "") + ")")


def _intervals(text: str | None) -> list[float] | None:
    """--what-if's list: None (no --what-if), [] (the default set), or the seconds given."""
    if text is None:
        return None
    if not text.strip():
        return []
    values = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"--what-if: expected seconds separated by commas, got {part!r}") from None
        if not (value > 0 and value < float("inf")):
            raise ValueError(f"--what-if: an interval must be a positive number of seconds, got {part!r}")
        values.append(value)
    return values


def replay_intervals(records: list[dict], result: Goodput, section: dict, intervals: list[float]) -> dict:
    """The run's failures (at their times, each with its measured restart) replayed under each interval."""
    save = section["save_seconds"]
    if save is None:
        return {"error": "no save measured: nothing to replay an interval against", "rows": []}
    recorded = section["applied_seconds"] or section["observed_seconds"]
    recommended = section["recommended_seconds"]
    chosen = list(intervals)
    if not chosen:
        chosen = sorted({round(base * factor, 3) for base in (recommended, recorded) if base
                         for factor in (0.25, 0.5, 1.0, 2.0, 4.0)})
    rows = []
    for interval in sorted(set(chosen)):
        replayed = ci.replay_trace(section["failure_times"], section["restart_seconds"], section["total_seconds"],
                                   max(interval, save), save)
        label = " ".join(name for name, value in (("recorded", recorded), ("recommended", recommended))
                         if value and abs(value - interval) < 1e-3)
        rows.append({**replayed.to_dict(), "label": label})
    return {"save_seconds": save, "failures": section["failures"], "total_seconds": section["total_seconds"],
            "rows": rows}


def render_what_if(table: dict) -> str:
    if table.get("error"):
        return f"  what-if: {table['error']}"
    lines = [f"  what-if: {table['failures']} recorded failures over {_duration(table['total_seconds'])}, "
             f"save {table['save_seconds']:.3f}s (goodput counts checkpoint badput only: saves, lost work, restarts)",
             f"    {'interval':>10} {'saves':>6} {'saving':>10} {'lost work':>10} {'restarts':>10} {'goodput':>8}"]
    for row in table["rows"]:
        lines.append(f"    {_duration(row['interval_seconds']):>10} {row['saves']:>6} {_duration(row['save_seconds']):>10} "
                     f"{_duration(row['lost_seconds']):>10} {_duration(row['restart_seconds']):>10} "
                     f"{_pct(row['goodput'])}  {row['label']}")
    return "\n".join(lines)


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
