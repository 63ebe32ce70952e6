"""`trainguard incidents`: the culprit verdicts of a run, with their evidence.

    trainguard incidents RUN                 list (oldest first): id, kind, culprit, confidence, action
    trainguard incidents show RUN ID         one verdict, its reasons, its evidence; the culprit's stacks
                                             beside a healthy rank's   (also: incidents RUN show ID)
    trainguard incidents replay RUN [ID]     decide again from the stored evidence; the same verdict?
    trainguard uncordon RUN HOST             let a cordoned node join the job again

Exit codes: 0 ok; 1 a replayed verdict differs or an incident is unreadable; 2 usage (no such run or
incident), with the file named, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

from trainguard import incidents, safe_read

EXIT_OK, EXIT_DIFFERS, EXIT_USAGE = 0, 1, 2
COLUMN = 62


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = "exit codes: 0 ok, 1 a replayed verdict differs or an incident is unreadable, 2 usage"
    parser.add_argument("words", nargs="+", metavar="[show|replay] RUN [ID]",
                        help="RUN to list; show RUN ID; replay RUN [ID]")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--key-file", default=None,
                        help="the run's checkpoint key the cordons are checked with (default: where "
                             "`trainguard train` looks for it)")


def parse_words(words: list[str]) -> tuple[str, Path, str | None]:
    """(command, run dir, id) from `RUN`, `show RUN ID`, `RUN show ID`, `replay RUN [ID]`."""
    if words[0] in ("show", "replay", "list"):
        command, rest = words[0], words[1:]
    elif len(words) >= 2 and words[1] in ("show", "replay", "list"):
        command, rest = words[1], [words[0], *words[2:]]
    else:
        command, rest = "list", words
    if not rest or len(rest) > 2 or (command == "show" and len(rest) != 2) or (command == "list" and len(rest) != 1):
        raise ValueError("usage: trainguard incidents RUN | show RUN ID | replay RUN [ID]")
    return command, Path(rest[0]), rest[1] if len(rest) == 2 else None


def run(args: argparse.Namespace) -> int:
    try:
        command, run_dir, incident_id = parse_words(args.words)
    except ValueError as exc:
        print(f"trainguard incidents: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not run_dir.is_dir():
        print(f"trainguard incidents: {run_dir}: no such run directory", file=sys.stderr)
        return EXIT_USAGE
    key = cordon_checker(getattr(args, "key_file", None))
    if isinstance(key, str):
        print(f"trainguard incidents: {key}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if command == "list":
            return list_incidents(run_dir, args.json, key)
        if command == "show":
            return show(run_dir, incident_id, args.json, key.key)
        return replay(run_dir, incident_id, args.json, key.key)
    except incidents.IncidentError as exc:
        print(f"trainguard incidents: {exc}", file=sys.stderr)
        return EXIT_USAGE


def cordon_checker(key_file: str | None):
    """The key cordons are checked with (trainguard/cordon/__init__.py CordonKey), or why a --key-file cannot be used."""
    from trainguard.runtime.cordon_key import checker   # the runtime, when it runs (Layers)

    key = checker(key_file)
    if key_file is not None and key.key is None:
        return f"--key-file {key_file}: {key.where}"
    return key


def list_incidents(run_dir: Path, as_json: bool, key=None) -> int:
    rows, problems = [], []
    for incident_id, verdict, problem in incidents.scan(run_dir):
        if problem:
            problems.append(problem)
        rows.append({"id": incident_id, **({} if verdict is None else verdict),
                     **({"problem": problem} if problem else {})})
    if as_json:
        print(json.dumps(rows, indent=1, sort_keys=True))
    elif not rows:
        print(f"no incidents in {run_dir}")
    else:
        print(f"{'ID':34} {'KIND':5} {'CULPRIT':18} {'CONF':>5}  ACTION")
        for row in rows:
            if "kind" not in row:
                print(f"{row['id']:34} {'?':5} {row.get('problem') or 'gathering evidence'}")
                continue
            print(f"{row['id']:34} {row['kind']:5} {_culprit(row):18} {row['confidence']:5.2f}  {row.get('action')}")
    if not as_json:
        print_cordons(run_dir, key if key is not None else cordon_checker(None))
    for problem in problems:
        print(f"trainguard incidents: {problem}", file=sys.stderr)
    return EXIT_DIFFERS if problems else EXIT_OK


def print_cordons(run_dir: Path, key) -> None:
    """The run's cordon files, each checked with the checkpoint key and its revocations (trainguard/cordon/__init__.py)."""
    from trainguard import cordon

    where = key.where
    for host, found in sorted(cordon.read_all(run_dir, key).items()):
        if found.honoured:
            print(f"cordoned   {host}: kept out of the job (incident {found.record.get('incident')}, "
                  f"{found.record.get('reason')}); `trainguard uncordon {run_dir} {host}` lets it join")
        elif found.refused == cordon.REVOKED:
            print(f"REVOKED: cordon of {host}: {found.why_refused()}; its launcher joins the job; "
                  f"`trainguard uncordon {run_dir} {host}` removes the copy")
        else:
            print(f"NOT honoured: cordon of {host}: {found.why_refused()} (checked with {where}); "
                  f"its launcher joins the job anyway")


def show(run_dir: Path, incident_id: str, as_json: bool, key: bytes | None = None) -> int:
    from trainguard import signed

    verdict = incidents.read(run_dir, incident_id)
    files = incidents.evidence(run_dir, incident_id)
    refused = incidents.check_verdict(key, incident_id, verdict)
    if as_json:
        print(json.dumps({**verdict, "evidence": [p.name for p in files], "verdict_refused": refused},
                         indent=1, sort_keys=True))
        return EXIT_OK
    print(f"incident {verdict['id']}  ({verdict['kind']}, detected by {verdict['detected_by']})")
    if refused is not None:     # no agent acts on it (agent/culprit.py): say so before what it claims
        print(f"NOT genuine: {signed.refusal_message(refused, 'this verdict')}; no agent acts on it")
    print(f"culprit:    {_culprit(verdict)}   confidence {verdict['confidence']:.2f}")
    print(f"action:     {verdict.get('action')}")
    print("reasons:")
    for reason in verdict["reasons"]:
        print(textwrap.fill(reason, 110, initial_indent="  - ", subsequent_indent="    "))
    print("evidence:   " + ", ".join(f"{p.name} ({p.stat().st_size} B)" for p in files))
    for ignored in verdict.get("evidence_ignored") or ():
        if isinstance(ignored, dict):
            print(f"ignored:    {ignored.get('why')}")
    culprit_rank, healthy_rank = _pair(verdict, files)
    if culprit_rank is not None or healthy_rank is not None:
        print()
        print(side_by_side(_stack(run_dir, incident_id, culprit_rank), f"rank {culprit_rank} (culprit)",
                           _stack(run_dir, incident_id, healthy_rank), f"rank {healthy_rank} (healthy)"))
    return EXIT_OK


def replay(run_dir: Path, incident_id: str | None, as_json: bool, key: bytes | None = None) -> int:
    """Decide every incident (or one) again from its stored evidence and compare with the verdict. The same
    evidence the live verdict may use: signed node files (checked with `key`) and the rank files they vouch
    for; the rest is named (`ignored`), never decided on."""
    from trainguard.agent import evidence
    from trainguard.decide import culprit

    ids = [incident_id] if incident_id else [i for i, v, _ in incidents.scan(run_dir) if v is not None]
    results = []
    for one in ids:
        stored = incidents.read(run_dir, one)
        loaded = evidence.load(run_dir, one, key)
        again = culprit.decide(*loaded)
        same = (again.culprit or None) == (stored.get("culprit") or None) and \
            abs(again.confidence - stored["confidence"]) < 1e-9
        results.append({"id": one, "same": same, "stored": stored.get("culprit"), "replayed": again.culprit,
                        "confidence": again.confidence, "ignored": loaded.refused})
    if as_json:
        print(json.dumps(results, indent=1, sort_keys=True))
    else:
        for r in results:
            print(f"{r['id']:34} {'same' if r['same'] else 'DIFFERS'}  stored {r['stored']}  replayed {r['replayed']}")
            for ignored in r["ignored"]:
                print(f"  ignored: {ignored['why']}")
    return EXIT_OK if all(r["same"] for r in results) else EXIT_DIFFERS


def side_by_side(left: str, left_title: str, right: str, right_title: str, width: int = COLUMN) -> str:
    """Two texts in two columns of `width`, long lines cut (the stacks of two ranks, compared)."""
    a, b = [left_title, "-" * len(left_title), *left.splitlines()], \
           [right_title, "-" * len(right_title), *right.splitlines()]
    rows = []
    for i in range(max(len(a), len(b))):
        x = a[i] if i < len(a) else ""
        y = b[i] if i < len(b) else ""
        rows.append(f"{_cut(x, width):{width}} | {_cut(y, width)}")
    return "\n".join(rows)


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def _pair(verdict: dict, files: list[Path]) -> tuple[int | None, int | None]:
    """The culprit's rank and one healthy rank (the lowest other) that have stacks."""
    ranks = sorted(int(p.name.split("-")[1].split(".")[0]) for p in files if p.name.endswith(".stack.txt"))
    culprit = (verdict.get("culprit") or {}).get("rank")
    bad = set((verdict.get("culprit") or {}).get("ranks") or ([culprit] if culprit is not None else []))
    healthy = next((r for r in ranks if r not in bad), None)
    if culprit is None:
        culprit, healthy = (ranks[0] if ranks else None), (ranks[1] if len(ranks) > 1 else None)
    return culprit, healthy


def _stack(run_dir: Path, incident_id: str, rank: int | None) -> str:
    if rank is None:
        return "(no rank)"
    path = incidents.incidents_dir(run_dir) / incident_id / f"rank-{rank}.stack.txt"
    try:
        return safe_read.read_text(path, incidents.MAX_FILE_BYTES, "stack dump", errors="replace")
    except OSError:
        return "(no stacks)"


def _culprit(verdict: dict) -> str:
    culprit = verdict.get("culprit")
    if not culprit:
        return "none"
    return f"rank {culprit.get('rank')} on {culprit.get('node')}"
