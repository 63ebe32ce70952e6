"""`trainguard replay LOG_OR_RUN_DIR... [--policy FILE] [--rules DIR] [--json] [--expect FILE] [--one-run]`

Inputs that are several runs (a folder of other tools' exports: trainguard.replay.sections) are replayed
each alone, a section per run.

Exit status: 0 done (and the expectation met), 1 the replay does not match --expect, 2 bad input
(no such log, no record in the inputs, a bad policy, expectation or rules directory, promtool missing). Malformed log lines are
never fatal: they are counted and listed with file and line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from trainguard.progress import Progress
from trainguard import policy as tgpolicy
from trainguard import rundir, runpolicy, tls
from trainguard.replay import dynamics, expect, rules, sections, source
from trainguard.replay.timeline import DEFAULT_SCRAPE_INTERVAL, Result, replay_logs

MALFORMED_SHOWN = 20
HEALTH_SHOWN = 40      # node-health findings in the human form (--json lists up to node_risk.HEALTH_KEPT)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", metavar="LOG_OR_RUN_DIR",
                        help="TLS logs (.jsonl, .jsonl.gz, .jsonl.zst) or run directories (their tls/ logs)")
    parser.add_argument("--policy", metavar="FILE",
                        help="policy YAML (default: the run's own RUN/policy.yaml when its signature checks with "
                             "the run's checkpoint key, else the built-in policy; which one is printed)")
    parser.add_argument("--key-file", metavar="FILE",
                        help="the run's checkpoint key, to check the run's policy with (default: where "
                             "`trainguard train` looks for it)")
    parser.add_argument("--rules", metavar="DIR",
                        help="evaluate these Prometheus alert rules (e.g. alerts/) over the recorded series with "
                             "promtool")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON document")
    parser.add_argument("--expect", metavar="FILE", help="expected actions and alerts (YAML); exit 1 on a mismatch")
    parser.add_argument("--scrape-interval", type=float, metavar="SECONDS",
                        help=f"with --rules: the scrape and rule evaluation interval (default: the --expect "
                             f"file's replay.scrape_interval, else {DEFAULT_SCRAPE_INTERVAL:g})")
    parser.add_argument("--hold", type=float, metavar="SECONDS",
                        help="with --rules: keep evaluating this long after the last record, as if the agent "
                             "kept exporting its last values (a log that ends in a hang; default: the --expect "
                             "file's replay.hold, else 0)")
    parser.add_argument("--keep-test", metavar="FILE", help="with --rules: keep the generated promtool test here")
    parser.add_argument("--one-run", action="store_true",
                        help="read every input as one run (default: logs of other tools that are not ranks or "
                             "checkpoint copies of one run, e.g. a folder of exports, are replayed each alone)")


def run(args: argparse.Namespace) -> int:
    try:
        chosen = choose_policy(args.inputs, args.policy, getattr(args, "key_file", None))
        policy = chosen.policy
        print(f"trainguard replay: policy: {chosen.describe()}", file=sys.stderr)
        if policy.cost.budget_per_million_tokens or policy.cost.energy_budget_kwh_per_1k_steps:
            print("trainguard replay: the policy's token and energy budgets are not replayed (replay meters "
                  "cost per 1000 steps; the trainer's and the agent's meters act on them)", file=sys.stderr)
        expected = expect.load(args.expect) if args.expect else None
        options = expected.replay if expected is not None else {}
        scrape_interval = _first(args.scrape_interval, options.get("scrape_interval"), DEFAULT_SCRAPE_INTERVAL)
        if scrape_interval <= 0:
            raise expect.ExpectError(f"--scrape-interval must be above zero, got {scrape_interval:g}")
        results = []
        with Progress("replay", unit="inputs").heartbeat() as shown:
            shown.step(0, f"{len(args.inputs)} input(s): which runs they are")
            conversions = source.Conversions()     # each other tool's log converted once, for every pass
            runs = sections.plan(args.inputs, one_run=getattr(args, "one_run", False), conversions=conversions)
            _one_run_only(runs, args)
            for number, section in enumerate(runs, 1):
                shown.step(number - 1, f"{len(section.inputs)} input(s)"
                           + (f" (run {number} of {len(runs)})" if len(runs) > 1 else "")
                           + ": the guard, the cost meter" + (", the alert rules" if args.rules else ""))
                result = replay_logs(section.inputs, policy, rules_dir=args.rules, scrape_interval=scrape_interval,
                                     hold=_first(args.hold, options.get("hold"), 0.0), keep_test=args.keep_test,
                                     conversions=conversions)
                result.extra["notes"] = section.passed_over + result.extra.get("notes", [])
                results.append(result)
    except (tgpolicy.PolicyError, expect.ExpectError, source.InputError, rules.RulesError, OSError) as exc:
        print(f"trainguard replay: {exc}", file=sys.stderr)
        return 2
    if len(results) > 1:
        return _several(runs, results, args.json)
    (result,) = results
    if not result.outcome.records:
        return _no_records(result)
    diff = result.check(expected) if expected is not None else None
    if args.json:
        json.dump(result.to_json(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render(result))
    if diff:
        print(f"trainguard replay: does not match {expected.source}:", file=sys.stderr)
        for line in diff:
            print(f"  {line}", file=sys.stderr)
        return 1
    return 0


def _one_run_only(runs: list[sections.Section], args: argparse.Namespace) -> None:
    """--expect and --keep-test are about one replay: refused for several runs, naming them."""
    if len(runs) < 2:
        return
    for given, flag in ((args.expect, "--expect"), (args.keep_test, "--keep-test")):
        if given:
            named = "; ".join(f"run {number}: {section.name}" for number, section in enumerate(runs, 1))
            raise source.InputError(f"{flag} is about one run, and these inputs are {len(runs)} runs that are not "
                                    f"ranks or copies of one another ({named}): replay one run's logs, or pass "
                                    "--one-run to read them all as one")


def _several(runs: list[sections.Section], results: list[Result], as_json: bool) -> int:
    """Several runs, each replayed alone: a section each (--json: one document, sections.combined). Exit 2
    only when no run holds a record; a run without any is named on stderr and in its section."""
    empty = [(number, result) for number, result in enumerate(results, 1) if not result.outcome.records]
    for number, result in empty:
        print(f"trainguard replay: run {number} of {len(runs)}: " + _no_records_lines(result)[0], file=sys.stderr)
    if len(empty) == len(results):
        return 2
    if as_json:
        json.dump(sections.combined([result.to_json() for result in results], runs), sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    lines = sections.heading(runs)
    for number, (section, result) in enumerate(zip(runs, results), 1):
        lines += ["", sections.title(number, len(runs), section)]
        lines.append(render(result).rstrip("\n") if result.outcome.records else "\n".join(_no_records_lines(result)))
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def choose_policy(inputs: list[str], given: str | None, key_file: str | None) -> runpolicy.Choice:
    """`--policy`, else the replayed run's own signed policy (one run directory among the inputs), else the
    defaults; a policy file that cannot be authenticated decides nothing here either (trainguard/runpolicy.py)."""
    if given is not None:
        return runpolicy.choose(None, given, None)
    runs = sorted({rundir.run_dir_of(path).resolve() for path in map(Path, inputs) if path.is_dir()})
    if len(runs) != 1:
        return runpolicy.Choice(tgpolicy.Policy(), None, "no run directory given" if not runs else
                                "several run directories given: pass --policy")
    if not os.path.lexists(rundir.policy_path(runs[0])):
        return runpolicy.choose(runs[0], None, None)
    from trainguard.cordon.cli import run_key

    key, where = run_key(key_file)
    if key is None and key_file is not None:
        raise OSError(f"--key-file {key_file}: {where}")
    return runpolicy.choose(runs[0], None, key, where)


def _no_records(result: Result) -> int:
    """Bad input, said as such: nothing in the inputs is a record (every line malformed, or none at all)."""
    lines = _no_records_lines(result)
    print(f"trainguard replay: {lines[0]}", file=sys.stderr)
    for line in lines[1:]:
        print(line, file=sys.stderr)
    return 2


def _no_records_lines(result: Result) -> list[str]:
    files = ", ".join(str(path) for path in result.files[:3]) + (" ..." if len(result.files) > 3 else "")
    lines = [f"no records in {files}: "
             + (f"{result.problems.count:,} malformed lines, none a TLS record or a line of another tool's log that "
                "trainguard reads (TensorBoard, trainer_state.json, Megatron-LM, torchtitan)"
                if result.problems.count else "the input is empty")]
    lines += [f"  {line}" for line in result.extra.get("notes", [])]
    lines += [f"  {malformed}" for malformed in result.problems.kept[:5]]
    return lines


def _first(*values):
    return next(value for value in values if value is not None)


# ----------------------------------------------------------------------------------------- human form

def render(result: Result) -> str:
    origin = result.outcome.first_timestamp
    lines = [_summary(result)]
    if result.actions:
        lines += ["", "actions (what would have executed: guard, cost meter, alerts through the ledger)"]
        lines += [_action_line(a, origin) for a in result.actions]
    else:
        lines += ["", "actions: none"]
    if result.alerts is not None:
        lines += ["", f"alerts (rules in {result.rules_dir}, evaluated by promtool every {result.scrape_interval:g}s)"]
        lines += [_alert_line(a, origin) for a in result.alerts] or ["  none"]
    lines += dynamics.render_lines(result.extra.get("lr_phases"))
    if result.recorded:
        lines += ["", "recorded in the log (what the live run did: trainer, agents, control channel)"]
        lines += [_recorded_line(r, origin) for r in result.recorded]
    if result.health:
        lines += ["", "node health (other tools' findings on the nodes' timelines: dcgmi diag, NCCL RAS, kernel NVRM)"]
        lines += [_health_line(f, origin) for f in result.health[:HEALTH_SHOWN]]
        if result.health_total > HEALTH_SHOWN:
            lines.append(f"  ... and {result.health_total - HEALTH_SHOWN} more (--json lists {len(result.health)})")
    if result.extra.get("notes"):
        lines += ["", "passed over on purpose (recognised, not mapped to TLS)"]
        lines += [f"  {note}" for note in result.extra["notes"]]
    if result.problems.count:
        lines += ["", f"malformed lines: {result.problems.count}"]
        lines += [f"  {m}" for m in result.problems.kept[:MALFORMED_SHOWN]]
        if result.problems.count > MALFORMED_SHOWN:
            lines.append(f"  ... and {result.problems.count - MALFORMED_SHOWN} more (--json lists "
                         f"{len(result.problems.kept)})")
    if result.diff is not None:
        lines += ["", f"expectation {result.expect_file}: " + ("met" if not result.diff else "NOT met")]
    return "\n".join(lines) + "\n"


def _summary(result: Result) -> str:
    out = result.outcome
    files = f"{len(result.files)} file" + ("s" if len(result.files) != 1 else "")
    head = f"replay: {files}, {out.records:,} records, {result.problems.count:,} malformed"
    if out.first_timestamp is None:
        return head + ", no records"
    span = expect.offset_text(out.last_timestamp, out.first_timestamp)
    when = (f"{tls.format_timestamp(out.first_timestamp)} .. {tls.format_timestamp(out.last_timestamp)} "
            f"({span.lstrip('+')})" if not result.extra.get("without_clock") else
            "no wall clock (steps order the records: the stall watchdog, the cost meter and time-based rules "
            "did not run)")
    lines = [f"{head}, {when}",
             f"steps decided: {out.steps:,}" + (f" (rank {result.lead_rank})" if result.lead_rank is not None else "")
             + (f", {out.duplicate_steps:,} copies from other ranks or nodes skipped" if out.duplicate_steps else "")
             + (f", {out.partial_steps:,} with a grad_norm but no loss" if out.partial_steps else "")]
    cost = out.cost
    if cost.get("gpu_count"):
        lines.append(f"cost: ${cost['cost_usd']:,.2f} on {cost['gpu_count']} GPUs, "
                     f"${cost['cost_per_1k_steps']:,.2f} per 1000 steps at the end "
                     f"({cost['overrun_ratio']:+.0%} against budget, tier {cost['tier']})")
    return "\n".join(lines)


def _action_line(action, origin: float) -> str:
    step = f"step {action.step}" if action.step is not None else ""
    return (f"  {expect.offset_text(action.timestamp, origin):>12}  {step:>12}  {action.action:14} "
            f"{action.reason:28} {action.source}")


def _recorded_line(item, origin: float) -> str:
    step = f"step {item.step}" if item.step is not None else ""
    name = item.name if item.kind == "action" else f"alert {item.name}"
    then = item.detail.get("outcome")
    reason = item.reason + (f" -> {item.detail['action']} ({then})" if item.kind == "alert" and item.detail.get("action")
                            else f" ({then})" if then else "")
    return f"  {expect.offset_text(item.timestamp, origin):>12}  {step:>12}  {name:24} {reason:44} {item.source}"


def _health_line(finding, origin: float) -> str:
    return (f"  {expect.offset_text(finding.timestamp, origin):>12}  {finding.node:16} {finding.tool:11} "
            f"{finding.test:18} {finding.status:5} {finding.describe()}")


def _alert_line(alert, origin: float) -> str:
    ends = expect.offset_text(alert.ends_at, origin) if alert.ends_at is not None else "(firing at the end)"
    labels = " ".join(f"{k}={v}" for k, v in sorted(alert.labels.items()))
    return (f"  {expect.offset_text(alert.starts_at, origin):>12} .. {ends:<12}  {alert.alertname:24} "
            f"{alert.severity or '':9} {labels}")
