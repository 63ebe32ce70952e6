"""Every benchmark of the project in one command, and docs/benchmarks.md written from the results.

    .venv/bin/python bench/run_all.py                  # every bench, full size (tens of minutes)
    .venv/bin/python bench/run_all.py --quick          # every bench, small sizes (a smoke run; marked quick)
    .venv/bin/python bench/run_all.py --only checkpoint,telemetry
    .venv/bin/python bench/run_all.py --render         # only re-render docs/benchmarks.md from bench/out/
    .venv/bin/python bench/run_all.py --list

Each bench (every ``bench/bench_*.py``, plus ``bench/fault_to_action.py``) runs as its own process with its
documented flags, one after the other so none measures another's load. Each bench prints its figures
(most as a Markdown section, some as plain text); this script keeps that output as it is and pulls out the
headline figures (ours, the peer measured in the same run, the ratio, the target the bench states) into
``bench/out/<name>.json``, together with the machine, the date and the exact command. docs/benchmarks.md is
then rendered from every ``bench/out/*.json`` (the soak's ``soak.json`` included): a summary table first,
then each bench's own section. A section of docs/benchmarks.md that no result here covers (written by hand)
is kept, marked as such, at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
OUT = BENCH / "out"
DOCS = ROOT / "docs" / "benchmarks.md"
COMMAND = ".venv/bin/python bench/run_all.py"


@dataclass
class Figure:
    """One headline figure: ours beside the peer measured in the same run; ratio is ours / peer where
    lower is better (times; for throughputs, the inverse of the rates)."""

    measure: str
    ours: str
    peer_name: str
    peer: str
    ratio: float | None
    target: str = ""
    met: bool | None = None


@dataclass
class Spec:
    title: str
    full: list[str]
    quick: list[str]
    extract: Callable[[str], list[Figure]]
    timeout: float = 3600.0


# ------------------------------------------------------------------------------------ reading outputs

def table_rows(text: str) -> list[list[str]]:
    """The cells of every Markdown table row in `text` (separator rows left out)."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("|") and line.endswith("|") and not re.fullmatch(r"\|[\s:|-]+\|", line):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def row(text: str, starts: str) -> list[str]:
    """The first table row whose first cell starts with `starts` (KeyError naming it otherwise)."""
    for cells in table_rows(text):
        if cells[0].startswith(starts):
            return cells
    raise KeyError(f"no row starting {starts!r} in the output")


def number(cell: str) -> float:
    match = re.search(r"-?\d[\d,]*\.?\d*(?:e-?\d+)?", cell)
    if not match:
        raise ValueError(f"no number in {cell!r}")
    return float(match.group(0).replace(",", ""))


def ratio(ours: float, peer: float) -> float | None:
    return ours / peer if peer else None


def agent(out: str) -> list[Figure]:
    cycle, rss = row(out, "CPU per collection + scrape"), row(out, "peak RSS")
    scrape, idle = row(out, "CPU per scrape alone"), row(out, "idle cost")
    return [Figure("agent CPU per collection + scrape, 1 s", cycle[1], "node_exporter", cycle[2], number(cycle[3]),
                   "<= node_exporter", number(cycle[3]) <= 1),
            Figure("agent CPU per scrape alone", scrape[1], "node_exporter", scrape[2], number(scrape[3])),
            Figure("agent idle CPU (no scrapes)", idle[1], "node_exporter", idle[2], None, "< 1 % of a core",
                   number(idle[1]) < 1),
            Figure("agent peak RSS", rss[1], "node_exporter", rss[2], number(rss[3]))]


def checkpoint(out: str) -> list[Figure]:
    raw, save = row(out, "raw torch.save (peer)"), row(out, "verified save, sync")
    blocking, load = row(out, "async save: blocking"), row(out, "raw torch.load + SHA-256")
    restore = row(out, "verified restore")
    save_ratio = number(save[1]) / number(raw[1])
    block_ratio = number(blocking[1]) / number(save[1])
    return [Figure("verified checkpoint save (s)", save[1], "raw torch.save", raw[1], save_ratio, "<= 1.25x",
                   save_ratio <= 1.25),
            Figure("async save, blocking part (s)", blocking[1], "sync verified save", save[1], block_ratio,
                   "<= 0.10x", block_ratio <= 0.10),
            Figure("verified restore (s)", restore[1], "raw torch.load + SHA-256", load[1],
                   ratio(number(restore[1]), number(load[1])))]


def collectors(out: str) -> list[Figure]:
    figures = []
    for label, starts in (("fixtures", "fixtures"), ("live /proc", "live")):
        cells = row(out, starts)
        figures.append(Figure(f"io + ib collectors, {label} (ms CPU)", cells[1], "node_exporter scrape", cells[2],
                              number(cells[4])))
    return figures


def _stage(out: str, name: str) -> float:
    match = re.search(rf"^\s*{re.escape(name)}\s+([\d.]+) s", out, re.M)
    if not match:
        raise KeyError(f"no line {name!r} in the output")
    return float(match.group(1))


def diagnose(out: str) -> list[Figure]:
    peer, decode, total = (_stage(out, n) for n in ("peer json.loads", "decode tls.iter_lines", "total diagnose_run"))
    return [Figure("TLS decode of a run (s)", f"{decode:.2f}", "json.loads", f"{peer:.2f}", decode / peer),
            Figure("trainguard diagnose of a run (s)", f"{total:.2f}", "json.loads", f"{peer:.2f}", total / peer)]


def loop(out: str) -> list[Figure]:
    off, inside = row(out, "step, `--telemetry off`"), row(out, "inside `StepTelemetry.step`")
    share = number(inside[1].split("(")[1]) / 100
    return [Figure("telemetry per step (wall)", inside[1].split(" (")[0], "no-telemetry step", off[1], share,
                   "< 1 % of a step", share < 0.01)]


def preflight(out: str) -> list[Figure]:
    match = re.search(r"preflight probe\s+([\d.]+) MB/s\s+dd conv=fsync\s+([\d.]+) MB/s", out)
    if not match:
        raise KeyError("no 'preflight probe ... dd conv=fsync' line in the output")
    ours, peer = float(match.group(1)), float(match.group(2))
    return [Figure("storage probe, fsynced write (MB/s)", f"{ours:.0f}", "dd conv=fsync", f"{peer:.0f}",
                   peer / ours)]


def replay(out: str) -> list[Figure]:
    rows = json.loads(next(line for line in reversed(out.splitlines()) if line.startswith("[")))
    by_stage = {r["stage"]: r for r in rows if r["stage"]}
    peer, total = by_stage["peer"], by_stage["total"]
    rate = total["records"] / total["seconds"]
    return [Figure("trainguard replay LOG (records/s)", f"{rate:,.0f}", "json.loads",
                   f"{peer['records'] / peer['seconds']:,.0f}", (total["seconds"] / total["records"])
                   / (peer["seconds"] / peer["records"]), ">= 500,000 records/s", rate >= 500_000)]


def report(out: str) -> list[Figure]:
    tb = row(out, "peer: TensorBoard")
    figures = []
    for case, what in (("ours: load_run", "report: load a run's series (s)"),
                       ("ours: report", "report: the whole HTML report (s)")):
        cells = row(out, case)
        figures.append(Figure(what, cells[1], "TensorBoard EventAccumulator", tb[1], number(cells[4])))
    return figures


def telemetry(out: str) -> list[Figure]:
    ours = row(out, "trainguard")
    figures = []
    for peer_name in ("TensorBoard", "wandb"):
        cells = row(out, peer_name)
        figures.append(Figure("step record write (µs wall)", ours[1], peer_name, cells[1],
                              number(ours[1]) / number(cells[1]), "<= 20 µs", number(ours[1]) <= 20))
    return figures


def fault_to_action(out: str) -> list[Figure]:
    figures = []
    for cells in table_rows(out)[1:]:
        if cells[1] == "alerts":
            embedded = next(c for c in table_rows(out) if c[0] == cells[0] and c[1] == "embedded")
            figures.append(Figure(f"{cells[0]}: fault to action via Prometheus (s)", cells[2],
                                  "the agent's embedded path", embedded[2], number(cells[4])))
    return figures


BENCHES: dict[str, Spec] = {
    "agent": Spec("Agent", [], ["--seconds", "5", "--burst", "50"], agent),
    "checkpoint": Spec("Checkpoints", [], ["--repeat", "1"], checkpoint),
    "collectors": Spec("Collectors: gpu, io, ib, nccl", [], ["--iterations", "50"], collectors),
    "diagnose": Spec("Diagnose", [], ["--steps", "10000", "--repeat", "1"], diagnose),
    "loop": Spec("Training loop overhead", [], ["--steps", "100", "--warmup", "10"], loop),
    "preflight": Spec("Preflight storage probe", [], ["--rounds", "1"], preflight),
    "replay": Spec("Replay", ["--json"], ["--records", "100000", "--decide-records", "50000", "--repeat", "1",
                                          "--json"], replay),
    "report": Spec("Report (`trainguard report`)", [], ["--steps", "20000", "--repeat", "1"], report),
    "telemetry": Spec("Trainer telemetry", [], ["--steps", "500", "--rounds", "1"], telemetry),
    "fault_to_action": Spec("Fault to action", [], ["--scenarios", "cost"], fault_to_action),
}


# ------------------------------------------------------------------------------------------- running

def discover() -> dict[str, Path]:
    """name -> script: every bench/bench_*.py and fault_to_action.py (a new bench is picked up as it is)."""
    scripts = {p.stem.removeprefix("bench_"): p for p in sorted(BENCH.glob("bench_*.py"))}
    if (BENCH / "fault_to_action.py").exists():
        scripts["fault_to_action"] = BENCH / "fault_to_action.py"
    return scripts


def machine() -> dict:
    """What the figures were measured on."""
    info = {"host": platform.node(), "cores": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
            "memory_gib": None, "python": platform.python_version(), "torch": _version("torch"), "gpu": None,
            "load_average": round(os.getloadavg()[0], 1)}
    with _quiet_oserror():
        info["cpu"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                           if line.startswith("model name"))
    with _quiet_oserror():
        kib = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
        info["memory_gib"] = round(kib / 2**20, 1)
    if shutil.which("nvidia-smi"):
        with _quiet_oserror():
            listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout.strip()
            info["gpu"] = "; ".join(listed.splitlines()) or None
    return info


class _quiet_oserror:
    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        return kind is not None and issubclass(kind, (OSError, StopIteration, subprocess.SubprocessError))


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def run_bench(name: str, script: Path, quick: bool) -> dict:
    spec = BENCHES.get(name)
    args = (spec.quick if quick else spec.full) if spec else []
    argv = [sys.executable, str(script.relative_to(ROOT)), *args]
    command = " ".join([".venv/bin/python", *argv[1:]])
    print(f"== {name}: {command}", flush=True)
    began, started_at = time.monotonic(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    try:
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True,
                              timeout=(spec.timeout if spec else 3600) / (4 if quick else 1))
        code, stdout, stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        code, stdout, stderr = "timeout", _text(exc.stdout), _text(exc.stderr) + f"\ntimed out after {exc.timeout:.0f} s"
    result = {"name": name, "title": spec.title if spec else name, "script": str(script.relative_to(ROOT)),
              "command": command, "quick": quick, "started_at": started_at,
              "seconds": round(time.monotonic() - began, 1), "returncode": code, "stdout": stdout,
              "stderr_tail": stderr[-3000:], "machine": machine(), "figures": [], "extract_error": None}
    if code == 0 and spec:
        try:
            result["figures"] = [asdict(f) for f in spec.extract(stdout)]
        except (KeyError, ValueError, IndexError, StopIteration, ZeroDivisionError) as exc:
            result["extract_error"] = f"{type(exc).__name__}: {exc}"
    status = "ok" if code == 0 else f"FAILED ({code})"
    print(f"   {status} in {result['seconds']:.0f} s; {len(result['figures'])} figures"
          + (f"; could not read figures: {result['extract_error']}" if result["extract_error"] else ""), flush=True)
    return result


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


# ----------------------------------------------------------------------------------------- rendering

def machine_text(m: dict) -> str:
    gpu = f"GPU: {m['gpu']}" if m.get("gpu") else "no GPU"
    return (f"{m['cores']} cores ({m['cpu']}), {m['memory_gib']} GiB, {gpu}; Python {m['python']}, "
            f"torch {m['torch']}; load average {m['load_average']} at the start")


def summary(results: list[dict]) -> list[str]:
    lines = ["| bench | figure | ours | peer (same run) | peer | ours / peer | target | met | on |",
             "|---|---|---:|---|---:|---:|---|---|---|"]
    for r in results:
        where = ("**GPU**" if r["machine"].get("gpu") else "CPU") + (", quick" if r["quick"] else "")
        if r["returncode"] != 0 and not r["figures"]:
            lines.append(f"| {r['name']} | not measured: the bench failed ({r['returncode']}) | | | | | | | {where} |")
            continue
        if not r["figures"]:
            lines.append(f"| {r['name']} | see its section ({r['extract_error'] or 'no headline figure'}) "
                         f"| | | | | | | {where} |")
        for f in r["figures"]:
            met = "" if f["met"] is None else ("yes" if f["met"] else "**no**")
            shown = "" if f["ratio"] is None else f"{f['ratio']:.3g}"
            lines.append(f"| {r['name']} | {f['measure']} | {f['ours']} | {f['peer_name']} | {f['peer']} | {shown} "
                         f"| {f['target']} | {met} | {where} |")
    return lines


def section(r: dict) -> list[str]:
    """A bench's own output under its heading, with the command, date and machine that produced it."""
    body = r["stdout"].strip("\n")
    if r.get("markdown"):                               # soak.json and other writers of their own section
        body = r["markdown"].strip("\n")
    lines = body.splitlines()
    if lines and lines[0].startswith("#"):
        lines = lines[1:]
    elif lines:
        lines = ["```", *lines, "```"]
    gpu = " **Measured on a GPU machine.**" if r["machine"].get("gpu") else ""
    quick = " Quick run (`--quick`: small sizes): a smoke test, not the published figure." if r["quick"] else ""
    head = [f"## {r['title']}", "",
            f"`{r['command']}` — {r['started_at'][:10]}, {r['seconds']:.0f} s; {machine_text(r['machine'])}.{gpu}{quick}"]
    if r["returncode"] != 0 and not r.get("markdown"):
        return [*head, "", f"Not measured: the bench ended with {r['returncode']}:", "", "```",
                *r["stderr_tail"].strip().splitlines()[-15:], "```", ""]
    return [*head, *lines, ""]


def kept_sections(text: str, titles: set[str]) -> list[str]:
    """Sections of the current docs/benchmarks.md that no result covers (hand-written ones), as they are."""
    kept = []
    for block in re.split(r"(?m)^(?=## )", text):
        heading = block.splitlines()[0][3:].strip() if block.startswith("## ") else None
        if heading and heading not in titles and not heading.startswith(("Summary", "How to run", "Kept from")):
            kept.append(block.rstrip("\n") + "\n")
    return kept


def render(results: list[dict], current: str) -> str:
    order = {name: i for i, name in enumerate(BENCHES)}
    results = sorted(results, key=lambda r: (order.get(r["name"], len(order)), r["name"]))
    newest = max((r["started_at"] for r in results), default="")
    kept = kept_sections(current, {r["title"] for r in results})
    lines = ["# Benchmarks", "",
             f"Generated by `{COMMAND}` from `bench/out/*.json` (last measured {newest[:10]}). Every figure "
             "stands beside its peer measured in the same run on the same machine; the ratio is ours / peer, "
             "lower is better (for throughputs, the inverse of the rates). Each section names the command, the "
             "date and the machine it came from; figures from a GPU machine are marked **GPU**.", "",
             "## How to run", "",
             "```", f"{COMMAND}                  # every bench, full size (tens of minutes)",
             f"{COMMAND} --quick          # small sizes: a smoke run, marked quick",
             f"{COMMAND} --only replay,checkpoint", f"{COMMAND} --render         # re-render this file only",
             ".venv/bin/python bench/soak.py --minutes 10   # the soak (not in CI); rendered here from bench/out/soak.json",
             "```", "", "## Summary", "", *summary(results), ""]
    for r in results:
        lines += section(r)
    if kept:
        lines += ["## Kept from earlier runs", "",
                  "Sections below were written by hand or by a bench's own `--write-docs`, and no result in "
                  "`bench/out/` covers them; they are kept as they were, with the figures of their own date.", ""]
        lines += [block.replace("## ", "### ", 1) for block in kept]
    return "\n".join(lines).rstrip("\n") + "\n"


def load_results(out: Path) -> list[dict]:
    results = []
    for path in sorted(out.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except ValueError as exc:
            print(f"skipping {path}: {exc}", file=sys.stderr)
            continue
        if isinstance(data, dict) and "name" in data and "machine" in data:
            results.append(data)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run (marked quick in the docs)")
    parser.add_argument("--only", help="comma-separated bench names (see --list)")
    parser.add_argument("--render", action="store_true", help="only render docs/benchmarks.md from bench/out/")
    parser.add_argument("--list", action="store_true", help="list the benches found and exit")
    parser.add_argument("--out", type=Path, default=OUT, help="where the JSON results go (default bench/out)")
    parser.add_argument("--docs", type=Path, default=DOCS, help="the file rendered (default docs/benchmarks.md)")
    args = parser.parse_args(argv)
    scripts = discover()
    if args.list:
        for name, script in scripts.items():
            spec = BENCHES.get(name)
            print(f"{name:16} {script.relative_to(ROOT)}  full: {' '.join(spec.full) if spec else ''}  "
                  f"quick: {' '.join(spec.quick) if spec else ''}")
        return 0
    if not args.render:
        chosen = args.only.split(",") if args.only else list(scripts)
        unknown = [name for name in chosen if name not in scripts]
        if unknown:
            parser.error(f"unknown bench {', '.join(unknown)} (known: {', '.join(scripts)})")
        args.out.mkdir(parents=True, exist_ok=True)
        for name in chosen:
            result = run_bench(name, scripts[name], args.quick)
            (args.out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    current = args.docs.read_text() if args.docs.exists() else ""
    args.docs.write_text(render(load_results(args.out), current))
    print(f"wrote {args.docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
