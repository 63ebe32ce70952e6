"""How right trainguard is: a labelled corpus scored through replay's own engine.

    .venv/bin/python bench/bench_efficacy.py                     # embedded path: guard, cost meter, stall watchdog
    .venv/bin/python bench/bench_efficacy.py --rules alerts      # and the alert rules, by promtool (Prometheus's engine)
    .venv/bin/python bench/bench_efficacy.py --json score.json   # the per-case findings too
    .venv/bin/python bench/bench_efficacy.py --phase DIR [DIR ...]    # healthy logs from each chunk phase
    .venv/bin/python bench/bench_efficacy.py --stress 30 --offsets 8  # more seeds: the soak's shape, slow divergence

The corpus is tests/efficacy/corpus.py: generated shapes of healthy training (plain, heavy-tailed noise,
loss-scaler overflows, a data-mix change, an annealing phase, a restart appended to the log, warm-up
wobble) and of faults (spikes, a warm-up spike, NaN bursts, gradient explosions, slow divergence, hangs,
stragglers, cost overruns at each tier, overheating), several seeds and sizes, plus the real logs of
../shared/real-logs (skipped, and said so, when the folder is absent). Each case says which actions and
alerts are right (in `trainguard replay --expect`'s vocabulary), which are tolerated, and so which are
wrong. Every case is replayed by `trainguard.replay.timeline.replay_logs`, what `trainguard replay`
runs: the same guard, cost meter, stall watchdog and ledger; with --rules, Prometheus's own rule engine
(promtool) over the exported series, as `trainguard replay --rules` does.

Scored per action and per alert: precision, recall and F1 over cases (a right entry found is a true
positive; a right entry not found, a false negative; a case with an action or alert of that name that is
neither right nor tolerated, a false positive); the actions taken on healthy cases; the step delay from
the trouble's first step to each right action; every miss and every wrong action, by case.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.efficacy import corpus  # noqa: E402
from trainguard.policy import Policy  # noqa: E402
from trainguard.replay import expect, timeline  # noqa: E402

HARMFUL_ON_HEALTHY = ("rollback", "stop", "restore")


@dataclass
class Finding:
    case: str
    shape: str
    healthy: bool
    records: int = 0
    found: list[tuple[str, str, int | None]] = field(default_factory=list)   # (kind, name, step)
    hits: list[tuple[str, str, int | None]] = field(default_factory=list)    # right entries found: delay
    misses: list[str] = field(default_factory=list)
    wrong: list[tuple[str, str, int | None]] = field(default_factory=list)
    error: str = ""
    note: str = ""                  # how it was replayed, where not as asked


def score_case(case: corpus.Case, folder: Path, policy: Policy, rules: str | None) -> Finding:
    finding = Finding(case.name, case.shape, case.healthy)
    path = case.write(folder)
    try:
        try:
            result = timeline.replay_logs([path], policy, rules_dir=rules, hold=case.hold)
        except Exception as exc:
            if rules is None:
                raise
            # The rules refuse what has no wall clock (a Trainer state): the embedded path still decides it.
            result = timeline.replay_logs([path], policy, hold=case.hold)
            finding.note = f"without --rules ({type(exc).__name__}: {exc})"
    except Exception as exc:        # a reader that refuses a real log: the case is missed, and why is said
        finding.error = f"{type(exc).__name__}: {exc}"
        finding.misses = [f"{e.get('action') or e.get('alertname')} (unreadable)" for e in
                          case.expect.get("actions", []) + case.expect.get("alerts", [])]
        return finding
    finding.records = result.outcome.records
    origin = result.outcome.first_timestamp
    found = result.found()
    finding.found = [(f.kind, f.name, f.step) for f in found]
    expected = expect.parse(case.expect, case.name)
    claimed: set[int] = set()
    for entry in expected.entries:
        if entry.kind == "alert" and result.alerts is None:
            continue                # alerts are scored only where the rules ran
        hits = [i for i, item in enumerate(found) if expect.matches(entry, item, origin)]
        claimed.update(hits)
        if hits:
            first = found[hits[0]]
            delay = None if first.step is None or case.onset is None else first.step - case.onset
            finding.hits.append((entry.kind, entry.name, delay))
        else:
            finding.misses.append(entry.describe(origin))
    for index, item in enumerate(found):
        if index not in claimed and item.name not in case.tolerate:
            finding.wrong.append((item.kind, item.name, item.step))
    if not finding.records:
        finding.error = "no records read"
    return finding


def summarise(findings: list[Finding]) -> dict:
    counts: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: {"tp": 0, "fp": 0, "fn": 0})
    delays: dict[tuple[str, str], list[int]] = defaultdict(list)
    healthy_actions: dict[str, int] = defaultdict(int)
    for f in findings:
        for kind, name, delay in f.hits:
            counts[(kind, name)]["tp"] += 1
            if delay is not None:
                delays[(kind, name)].append(delay)
        for miss in f.misses:
            name = miss.split()[0]
            kind = "alert" if name[:1].isupper() else "action"
            counts[(kind, name)]["fn"] += 1
        for kind, name in {(kind, name) for kind, name, _ in f.wrong}:
            counts[(kind, name)]["fp"] += 1
        if f.healthy:
            for kind, name, _ in f.found:
                healthy_actions[f"{kind}:{name}"] += 1
    rows = {}
    for (kind, name), c in sorted(counts.items()):
        precision = c["tp"] / (c["tp"] + c["fp"]) if c["tp"] + c["fp"] else None
        recall = c["tp"] / (c["tp"] + c["fn"]) if c["tp"] + c["fn"] else None
        f1 = (2 * precision * recall / (precision + recall)) if precision and recall else (0.0 if precision is not None and recall is not None else None)
        d = sorted(delays[(kind, name)])
        rows[f"{kind}:{name}"] = {**c, "precision": precision, "recall": recall, "f1": f1,
                                  "delay_median": d[len(d) // 2] if d else None, "delay_max": d[-1] if d else None}
    faults = [f for f in findings if not f.healthy]
    caught = [f for f in faults if not f.misses]
    tp = sum(c["tp"] for c in counts.values())
    fn = sum(c["fn"] for c in counts.values())
    harmful = sum(1 for f in findings if f.healthy for _, name, _ in f.found if name in HARMFUL_ON_HEALTHY)
    return {"rows": rows, "cases": len(findings), "healthy_cases": len(findings) - len(faults),
            "fault_cases": len(faults), "fault_cases_caught": len(caught),
            "case_recall": len(caught) / len(faults) if faults else None,
            "entry_recall": tp / (tp + fn) if tp + fn else None,
            "harmful_on_healthy": harmful, "actions_on_healthy": dict(healthy_actions)}


def fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)


def report(summary: dict, findings: list[Finding], path: str, seconds: float, skipped_real: str) -> str:
    lines = [f"efficacy ({path}): {summary['cases']} cases ({summary['healthy_cases']} healthy, "
             f"{summary['fault_cases']} faults) in {seconds:.0f} s{skipped_real}", "",
             "| action / alert | TP | FP | FN | precision | recall | F1 | delay median | delay max |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in summary["rows"].items():
        lines.append(f"| {name} | {r['tp']} | {r['fp']} | {r['fn']} | {fmt(r['precision'])} | {fmt(r['recall'])} | "
                     f"{fmt(r['f1'])} | {fmt(r['delay_median'])} | {fmt(r['delay_max'])} |")
    lines += ["", "| shape | cases | healthy | right (every right entry found, nothing wrong) | with a wrong action | steps to the first "
              "right action (median, max) | actions taken |", "|---|---|---|---|---|---|---|"]
    shapes: dict[str, list[Finding]] = defaultdict(list)
    for f in findings:
        shapes[f.shape].append(f)
    for shape, group in shapes.items():
        taken: dict[str, int] = defaultdict(int)
        for f in group:
            for _, name, _ in f.found:
                taken[name] += 1
        firsts = sorted(min(d for _, _, d in f.hits if d is not None) for f in group
                        if any(d is not None for _, _, d in f.hits))
        delay = f"{firsts[len(firsts) // 2]}, {firsts[-1]}" if firsts else "-"
        lines.append(f"| {shape} | {len(group)} | {'yes' if group[0].healthy else 'no'} | "
                     f"{sum(1 for f in group if not f.misses and not f.wrong and not f.error)} | {sum(1 for f in group if f.wrong)} | "
                     f"{delay} | {', '.join(f'{k} {v}' for k, v in sorted(taken.items())) or '-'} |")
    lines += ["", f"fault cases caught (every right entry found): {summary['fault_cases_caught']}/{summary['fault_cases']}"
              f" = {fmt(summary['case_recall'])}; right entries found: {fmt(summary['entry_recall'])}",
              f"rollback/stop/restore on healthy cases: {summary['harmful_on_healthy']}",
              f"everything on healthy cases: {summary['actions_on_healthy'] or 'nothing'}", ""]
    for f in findings:
        if f.misses or f.wrong or f.error or f.note:
            wrong = ", ".join(f"{name}@{step}" for _, name, step in f.wrong[:6]) + (" ..." if len(f.wrong) > 6 else "")
            lines.append(f"- {f.case} ({f.records} records){': ' + f.error if f.error else ''}"
                         + (f"; {f.note}" if f.note else "")
                         + (f"; missed {f.misses}" if f.misses else "") + (f"; wrong {wrong}" if f.wrong else ""))
    return "\n".join(lines)


def phase_rows(folders: list[str], offsets: int, policy: Policy) -> list[tuple[str, list[int], dict]]:
    """Healthy recorded runs (a folder of TLS logs each; its rank-0.jsonl, every rank logs the same global loss)
    replayed from each of `offsets` starting points: the first k step records left out, so the guard's
    chunks start at another step (the loss-drift rule's verdict once depended on it). Per folder: the offsets
    at which there was an action, and every action taken by (action, reason); a healthy run should have none."""
    rows = []
    for folder in folders:
        text = (Path(folder) / "rank-0.jsonl").read_text().splitlines(keepends=True)
        steps = [i for i, line in enumerate(text) if '"metrics"' in line and '"loss"' in line]
        taken: dict[tuple[str, str], int] = defaultdict(int)
        acting = []
        with tempfile.TemporaryDirectory(prefix="phase-") as tmp:
            for offset in range(offsets):
                dropped = set(steps[:offset])
                (Path(tmp) / "rank-0.jsonl").write_text("".join(line for i, line in enumerate(text) if i not in dropped))
                actions = timeline.replay_logs([tmp], policy).actions
                for action in actions:
                    taken[(action.action, action.reason)] += 1
                if actions:
                    acting.append(offset)
        rows.append((folder, acting, dict(taken)))
    return rows


def phase(folders: list[str], offsets: int, policy: Policy) -> str:
    lines = ["| log | offsets | offsets with an action | actions (all offsets) |", "|---|---|---|---|"]
    for folder, acting, taken in phase_rows(folders, offsets, policy):
        lines.append(f"| {folder} | 0..{offsets - 1} | {len(acting)} {acting if acting else ''} | "
                     f"{', '.join(f'{a} {r}: {n}' for (a, r), n in sorted(taken.items())) or 'none'} |")
    return "\n".join(lines)


def stress(seeds: int, offsets: int, policy: Policy) -> str:
    """Beyond the corpus's seeds: the soak's healthy shape (corpus.soak_healthy, 9,000 steps) for `seeds` seeds
    from `offsets` chunk phases each, and slow divergences (corpus.slow_divergence, 3,000 steps) for `seeds`
    more seeds, scored as the corpus scores them (a rollback after the onset, before the trend is +20%)."""
    with tempfile.TemporaryDirectory(prefix="stress-") as tmp:
        folders = [str(corpus.soak_healthy(seed, 9_000).write(Path(tmp))) for seed in range(seeds)]
        acting = [f"- {Path(folder).name}: offsets {offs}, {taken}" for folder, offs, taken in
                  phase_rows(folders, offsets, policy) if offs]
        findings = [score_case(corpus.slow_divergence(seed, 3_000), Path(tmp), policy, None)
                    for seed in range(6, 6 + seeds)]
    delays = sorted(d for f in findings for _, _, d in f.hits if d is not None)
    late = [f.case for f in findings if f.misses]
    lines = [f"soak_healthy: {seeds} seeds x {offsets} offsets, {len(acting)} seeds with an action"] + acting
    lines.append(f"slow_divergence: {len(findings)} seeds (6..{5 + seeds}), {len(late)} without a rollback in time "
                 f"{late if late else ''}; steps from the onset to it: median "
                 f"{delays[len(delays) // 2] if delays else '-'}, max {delays[-1] if delays else '-'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rules", help="alert rules directory: score the alerts too (needs promtool)")
    parser.add_argument("--scale", type=float, default=1.0, help="shorten the long generated cases (0.1: a quick look)")
    parser.add_argument("--only", default="", help="only the cases whose name contains this")
    parser.add_argument("--no-real", action="store_true", help="leave the real logs out")
    parser.add_argument("--json", help="write the summary and every finding here")
    parser.add_argument("--phase", nargs="+", metavar="DIR", help="instead: these healthy runs' logs replayed from "
                        "each chunk phase (--offsets starting points); any action is wrong")
    parser.add_argument("--offsets", type=int, default=32, help="starting points for --phase (default 32)")
    parser.add_argument("--stress", type=int, default=0, metavar="SEEDS", help="instead: the soak's healthy shape "
                        "and slow divergence over this many seeds (--offsets phases each for the healthy)")
    args = parser.parse_args(argv)
    if args.stress:
        print(stress(args.stress, args.offsets, Policy()))
        return 0
    if args.phase:
        print(phase(args.phase, args.offsets, Policy()))
        return 0
    cases = list(corpus.generated(args.scale))
    skipped_real = ""
    if args.no_real:
        skipped_real = "; real logs left out (--no-real)"
    elif not corpus.REAL_LOGS.is_dir():
        skipped_real = f"; real logs skipped: {corpus.REAL_LOGS} is absent"
    else:
        cases += list(corpus.real())
    cases = [case for case in cases if args.only in case.name]
    policy, started = Policy(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="efficacy-") as tmp:
        findings = [score_case(case, Path(tmp), policy, args.rules) for case in cases]
    summary = summarise(findings)
    path = f"alert rules {args.rules} by promtool" if args.rules else "embedded (guard, cost meter, stall watchdog)"
    print(report(summary, findings, path, time.perf_counter() - started, skipped_real))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "findings": [f.__dict__ for f in findings]},
                                              indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
