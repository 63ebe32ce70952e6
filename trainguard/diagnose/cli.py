"""`trainguard diagnose RUN_DIR [--json]`: likely causes of lost throughput, by layer, with the evidence."""

from __future__ import annotations

import argparse
import json
import math
import sys

from trainguard import event_types, policy as policy_mod
from trainguard.diagnose import diagnose
from trainguard.formats.discover import SeveralRuns
from trainguard.diagnose.finding import NO_DATA, OK, PROBLEM, Finding
from trainguard.diagnose.loader import RunData, load_run
from trainguard.report.charts import format_value
from trainguard.report.charts import MFU_UNKNOWN, mfu_na

ERRORS_SHOWN = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory (or its tls/ directory)")
    parser.add_argument("--policy", metavar="FILE", help="policy YAML (alert and diagnose thresholds)")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        policy = policy_mod.load(args.policy)
        data = load_run(args.run_dir)
    except (FileNotFoundError, policy_mod.PolicyError, SeveralRuns) as exc:
        print(f"trainguard diagnose: {exc}", file=sys.stderr)
        return 2
    findings = diagnose(data, policy)
    if args.json:
        print(json.dumps(to_json(data, findings), indent=2))
    else:
        print(render(data, findings))
    return 0


def mfu_summary(data: RunData) -> dict:
    """The lowest rank's mean MFU as recorded, or why there is none (a run_start's `mfu_unavailable`)."""
    for rank in sorted(data.ranks):
        values = [v for v in data.ranks[rank].values.get("mfu", ()) if math.isfinite(v)]
        if values:
            return {"rank": rank, "mean": sum(values) / len(values)}
    reasons = [e["event"]["mfu_unavailable"] for e in data.events
               if e["event"].get("type") == event_types.RUN_START and isinstance(e["event"].get("mfu_unavailable"), str)]
    return {"unavailable": reasons[-1][:200] if reasons else MFU_UNKNOWN}


def _mfu_line(data: RunData) -> str:
    mfu = mfu_summary(data)
    if "mean" in mfu:
        return f"MFU: {format_value(mfu['mean'], 'ratio')} (mean of rank {mfu['rank']}'s steps)"
    return f"MFU: {mfu_na(mfu['unavailable'])}"


def to_json(data: RunData, findings: list[Finding]) -> dict:
    return {"run_dir": data.run_dir, "files": data.files, "records": data.records, "malformed": data.malformed,
            "errors": data.errors, "mfu": mfu_summary(data), "findings": [f.to_dict() for f in findings]}


def _evidence_line(key: str, value) -> str:
    if key == "stretches":
        parts = []
        for s in value:
            where = f"steps {s['steps'][0]}-{s['steps'][1]}" if "steps" in s else f"{s['rows']} samples"
            parts.append(f"{where} ({s['from']} .. {s['to']})")
        return "when: " + "; ".join(parts)
    text = json.dumps(value, separators=(", ", ": ")) if isinstance(value, (dict, list)) else str(value)
    return f"{key}: {text if len(text) <= 160 else text[:157] + '...'}"


def render(data: RunData, findings: list[Finding]) -> str:
    lines = [f"trainguard diagnose {data.run_dir}: {data.records} records from {len(data.files)} files"
             + (f", {data.malformed} malformed lines" if data.malformed else ""), _mfu_line(data)]
    problems = [f for f in findings if f.status == PROBLEM]
    lines.append("")
    if problems:
        lines.append("Likely causes of lost throughput, biggest share of the run first:")
        for n, f in enumerate(problems, 1):
            lines.append(f"{n:>2}. [{f.layer}] {f.check} (score {f.score:.2f})")
            lines.append(f"    {f.cause}")
            lines.extend(f"      {_evidence_line(k, v)}" for k, v in f.evidence.items())
    else:
        lines.append("No likely cause of lost throughput found in what the logs hold.")
    for title, status in (("Not enough data in the logs for:", NO_DATA), ("Checked, nothing found:", OK)):
        group = [f for f in findings if f.status == status]
        if group:
            lines += ["", title] + [f"  [{f.layer}] {f.check}: {f.cause}" for f in group]
    if data.errors:
        lines += ["", f"Malformed lines ({data.malformed}, first {min(ERRORS_SHOWN, len(data.errors))}):"]
        lines += [f"  {e}" for e in data.errors[:ERRORS_SHOWN]]
    return "\n".join(lines)
