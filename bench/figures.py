"""The headline figures of each bench, read from what it prints (bench/run_all.py runs them).

Each bench prints its own report (most a Markdown section with a table, some plain text or JSON); a
reader here picks out the figures worth a summary row: ours, the peer measured in the same run, the
ratio, and the target the bench itself states. A reader that cannot find its row raises KeyError or
ValueError naming what it looked for; run_all records that and still shows the bench's whole output.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


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
    """bench_checkpoint.py's table: ours, the peer, the ratio, the target."""
    figures = []
    for label, starts, limit in (("verified sync save (s)", "verified sync save", 1.0),   # the first such row
                                 ("async save, blocked vs DCP async_save (s)", "async save blocked vs DCP", 1.0),
                                 ("async save, blocked vs copy floor (s)", "async save blocked vs copy", 1.25),
                                 ("verified restore (s)", "verified restore", 1.1),
                                 ("restore into another world size, 2 -> 1 (s)",
                                  "restore into another world size (2 -> 1)", 1.1)):
        cells = row(out, starts)
        value = number(cells[3])
        figures.append(Figure(label, cells[1], cells[2].split(" (")[-1].rstrip(")"), cells[2], value,
                              f"<= {limit}x", value <= limit))
    return figures


def recovery(out: str) -> list[Figure]:
    again, peer = row(out, "crash -> training again"), row(out, "peer: new interpreter")
    seconds = number(again[1])
    against = ratio(seconds, number(peer[1]))
    return [Figure("crash to training again, tiny model on CPU (s)", again[1],
                   "new interpreter + import torch + load (DCP + torch.load)", peer[1], against,
                   "< 10 s and <= 1.5x", seconds < 10.0 and against is not None and against <= 1.5)]


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
    figures = []
    for shape in dict.fromkeys(r.get("shape", "layers") for r in rows):
        by_what = {r["what"]: r for r in rows if r["stage"] and r.get("shape", "layers") == shape}
        peer = by_what["json.loads per line"]
        for row_what, what, targeted in (("replay LOG", "trainguard replay LOG", True),
                                         ("columns: guard + cost", "guard + cost alone", True),
                                         # merged or compressed logs: no target stated for them
                                         ("one process (merged, .gz)", "replay, one-process path", False),
                                         # every pass of the command (recorded actions, replica, stall)
                                         ("replay_logs (trainguard replay)", "trainguard replay LOG, all passes",
                                          False)):
            if row_what not in by_what:       # bench output from before that row
                continue
            rate = by_what[row_what]["records"] / by_what[row_what]["seconds"]
            figures.append(Figure(f"{what}, {shape} records (records/s)", f"{rate:,.0f}", "json.loads",
                                  f"{peer['records'] / peer['seconds']:,.0f}",
                                  (1 / rate) / (peer["seconds"] / peer["records"]),
                                  ">= 500,000 records/s" if targeted else "",
                                  rate >= 500_000 if targeted else None))
    return figures


def replay_rundir(out: str) -> list[Figure]:
    """bench_replay_rundir.py --json: `trainguard replay RUN` end to end and in process, each shape, against
    the msgspec floor on every CPU measured in the same run (the target: 1,000,000 records/s end to end)."""
    results = json.loads(next(line for line in reversed(out.splitlines()) if line.startswith("[")))
    figures = []
    for result in results:
        by_what = {r["what"]: r["records"] / r["seconds"] for r in result["rows"]}
        floor_name = next(what for what in by_what if what.startswith("msgspec floor, ") and "CPUs" in what)
        floor = by_what[floor_name]
        for what, targeted in (("trainguard replay RUN (subprocess)", True), ("replay_logs([RUN]) in this process", False)):
            rate = by_what[what]
            figures.append(Figure(f"{what}, {result['shape']} shape (records/s)", f"{rate:,.0f}", floor_name,
                                  f"{floor:,.0f}", floor / rate, ">= 1,000,000 records/s" if targeted else "",
                                  rate >= 1_000_000 if targeted else None))
    return figures


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


def sdc(out: str) -> list[Figure]:
    """bench_sdc.py: per model, the check's share of a step at the default interval, and its cost per
    check (weights, like for like) against Megatron-LM's SHA-1 check."""
    figures = []
    for cells in table_rows(out)[1:]:
        model, step, both, weights, peer = cells[0], cells[2], cells[3], cells[4], cells[5]
        share = number(cells[7]) / 100
        speedup = number(cells[6])
        figures += [Figure(f"replica check per step at the default interval, {model}", both, "the step", step,
                           share, "<= 0.5 % of a step", share <= 0.005),
                    Figure(f"replica check per check (weights), {model}", weights, "Megatron SHA-1 check", peer,
                           1 / speedup, ">= 20x cheaper", speedup >= 20)]
    if not figures:
        raise KeyError("no model rows in bench_sdc.py's table")
    return figures


def hf_preclip(out: str) -> list[Figure]:
    plain, hooked = row(out, "plain Trainer step"), row(out, "Trainer step with the pre-clip norm hooks")
    return [Figure("HF Trainer step with the pre-clip norm hooks (CPU time)", hooked[2], "plain Trainer step",
                   plain[2], number(hooked[2]) / number(plain[2]))]
