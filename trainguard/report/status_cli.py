"""`trainguard status RUN_DIR`: the run at a glance, for people who live in a terminal.

It reads only the tail of each live TLS log (the last `--tail-kib`), so it answers at once on a log of
any size and can run in `watch -n 5`. Alerts are firing when their latest event in that tail says so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainguard import event_types, paths, rundir, safe_read
from trainguard.actions import PAGE, SHADOW_ACTION, SHADOW_MODE
from trainguard.exits import int_at_least
from trainguard.report.charts import event_detail, format_elapsed, format_value, mfu_na
from trainguard.report.files import log_files, read_checkpoints
from trainguard.tls import TLSError, decode

TAIL_KIB = 256


@dataclass
class Status:
    run_dir: str
    run_id: str | None = None
    updated: float | None = None
    step: int | None = None
    rank: int | None = None
    ranks: list[int] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    last_checkpoint: str | None = None
    checkpoints_on_disk: int = 0
    gpus: list[dict] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    firing: list[str] = field(default_factory=list)
    resolved: list[str] = field(default_factory=list)
    attention: list[str] = field(default_factory=list)    # what a human must look at (pages, refusals)
    shadowed: dict = field(default_factory=dict)          # shadow_action events in the tail, by action
    shadow_mode: bool = False                             # a run_start in the tail said actions_mode: shadow
    mfu_unavailable: str = ""                             # a run_start in the tail said why there is no MFU
    malformed: int = 0
    errors: list[str] = field(default_factory=list)
    checkpoint_ts: float = field(default=float("-inf"), repr=False)


def tail_records(path: Path, max_bytes: int) -> tuple[list[dict], list[str]]:
    """Records in the last `max_bytes` of a TLS file (the partial first line skipped) and the errors met.

    A window holding no whole line (one record longer than it) is doubled until it holds one, so a long
    last record is still read (the file's end is read once more per doubling: rare, and bounded by it).
    """
    with safe_read.open_file(path, what="log file") as handle:
        size = handle.seek(0, os.SEEK_END)
        while True:
            start = max(0, size - max_bytes)
            handle.seek(start)
            data = handle.read(size - start)
            if start == 0 or data.find(b"\n", 0, len(data) - 1) >= 0:
                break
            if max_bytes > safe_read.MAX_LINE_BYTES:     # no whole line in the bound: a line too long to read
                return [], [f"{path}: its last line is longer than {safe_read.MAX_LINE_BYTES} bytes "
                            f"(a log line is at most that long)"]
            max_bytes *= 2
    lines = data.split(b"\n")
    if start > 0:
        lines = lines[1:]           # began mid-line
    first_lineno = None if start > 0 else 1
    records, errors = [], []
    for offset, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            records.append(decode(raw, str(path), None if first_lineno is None else first_lineno + offset))
        except TLSError as exc:
            if offset == len(lines) - 1 and not data.endswith(b"\n"):
                continue            # a live writer's next line, not yet complete
            errors.append(str(exc))
    return records, errors


def collect(run_dir: str | os.PathLike, tail_kib: int = TAIL_KIB, recent: int = 8) -> Status:
    root = paths.run_dir(run_dir)
    status = Status(run_dir=str(root))
    node_files, rank_files = log_files(root)
    live = [p for p in node_files + rank_files if p.name.endswith(".jsonl")]
    events: list[tuple[float, dict, str]] = []
    ranks = sorted(int(p.name[5:-6]) for p in rank_files if p.name.endswith(".jsonl") and p.name[5:-6].isdigit())
    status.ranks = ranks
    for path in live:
        records, errors = tail_records(path, tail_kib * 1024)
        status.malformed += len(errors)
        status.errors += errors[:5]
        primary = path.name == f"rank-{ranks[0]}.jsonl" if ranks else path.name.startswith("node-")
        for record in records:
            _take(status, record, primary, path.name.startswith("node-"))
            if isinstance(record.get("event"), dict):
                events.append((record["timestamp"], record, path.stem))
    _take_events(status, sorted(events, key=lambda e: e[0]), recent)
    checkpoints = read_checkpoints(root)
    status.checkpoints_on_disk = len(checkpoints)
    readable = [checkpoint for checkpoint in checkpoints if checkpoint.error is None]
    if readable and not status.last_checkpoint:     # a garbage manifest is no checkpoint (not even the latest)
        status.last_checkpoint = readable[-1].name
    _take_checkpoint_save(status, root)
    return status


def _take_checkpoint_save(status: Status, root: Path) -> None:
    """A failing checkpoint save needs a human: RUN/checkpoints/status.json (the checkpoint manager's,
    rewritten in place so even a full disk can record it) says which, why and the bytes it needs."""
    saved = rundir.read_checkpoint_status(root)
    if isinstance(saved, dict) and saved.get("ok") is False:
        durable = saved.get("durable_step")
        status.attention.append(
            f"checkpoint {rundir.step_dir_name(saved.get('step'))} failed ({saved.get('failed_saves', 1)} in a row; needs about "
            f"{saved.get('bytes_needed')} bytes, {saved.get('bytes_free')} free; newest durable: "
            f"{rundir.step_dir_name(durable) if durable is not None else 'none from this run'}): {saved.get('error', '')[:300]}")


def _take(status: Status, record: dict, primary: bool, from_node: bool) -> None:
    ts = record["timestamp"]
    status.updated = ts if status.updated is None else max(status.updated, ts)
    status.run_id = status.run_id or record.get("run_id")
    metrics = record.get("metrics")
    if primary and isinstance(metrics, dict) and record.get("step") is not None:
        if status.step is None or ts >= status.metrics.get("_ts", 0):
            status.step, status.rank = record["step"], record.get("rank")
            status.metrics = {**metrics, "_ts": ts}
    last = (record.get("system") or {}).get("last_checkpoint")
    event = record.get("event")
    if isinstance(event, dict) and event["type"] == event_types.CHECKPOINT_SAVED:
        step = event.get("step", record.get("step"))
        last = rundir.step_dir_name(step) if step is not None else last
    if isinstance(last, str) and ts >= status.checkpoint_ts:
        status.last_checkpoint, status.checkpoint_ts = last, ts
    gpus = (record.get("hardware") or {}).get("gpus")
    if from_node and record.get("node") and record["node"] not in status.hosts:
        status.hosts.append(record["node"])
    if from_node and isinstance(gpus, list):
        host = record.get("node", "")
        status.gpus = [g for g in status.gpus if g.get("_host") != host] + [
            {**g, "_host": host} for g in gpus if isinstance(g, dict)]


# Events a healthy run writes every few steps (docs/recovery.md): counted by goodput, not listed by status.
ROUTINE = frozenset({event_types.SNAPSHOT_SAVED, event_types.SNAPSHOT_REPLICATED})


def _take_events(status: Status, events: list[tuple[float, dict, str]], recent: int) -> None:
    alert_state: dict[str, str] = {}
    seen: dict[tuple, float] = {}
    shown = []
    for ts, record, source in events:
        event = record["event"]
        key = (event["type"], event.get("step", record.get("step")), event.get("alertname"), event.get("action"),
               event.get("id"), event.get("status"))
        if key in seen and ts - seen[key] < 30:
            continue                # the same event from another rank or echoed by the agent
        seen[key] = ts
        if event["type"] == SHADOW_ACTION:
            action = str(event.get("action"))
            status.shadowed[action] = status.shadowed.get(action, 0) + 1
        if event["type"] == event_types.RUN_START and event.get("actions_mode") == SHADOW_MODE:
            status.shadow_mode = True
        if event["type"] == event_types.RUN_START and isinstance(event.get("mfu_unavailable"), str):
            status.mfu_unavailable = event["mfu_unavailable"][:200]
        if event["type"] == event_types.ALERT and event.get("alertname"):
            alert_state[str(event["alertname"])] = str(event.get("status", "firing"))
        _needs_a_human(status, ts, event)
        if event["type"] in ROUTINE:
            continue                # one every few steps: it would crowd the decisions out of the list
        shown.append({"timestamp": ts, "type": event["type"], "step": event.get("step", record.get("step")),
                      "detail": event_detail(event), "source": source})
    status.events = shown[-recent:] if recent else []
    status.firing = sorted(n for n, s in alert_state.items() if s == "firing")
    status.resolved = sorted(n for n, s in alert_state.items() if s != "firing")


def _needs_a_human(status: Status, ts: float, event: dict) -> None:
    """Restores not carried out: a human was paged (no restarts left, past the hourly limit), or the
    agent refused to end processes that did not prove they were ranks of this run."""
    if event["type"] == event_types.ACTION and event.get("outcome") == "paged":
        paged = event.get("paged") or {}
        status.attention.append(f"{_clock(ts)}  restore NOT done, a human is paged: {paged.get('reason', 'paged')} "
                                f"(ranks {paged.get('ranks')}); the ranks were left running")
    elif event["type"] == event_types.ALERT and event.get("action") == PAGE:
        status.attention.append(f"{_clock(ts)}  {event.get('alertname')}: paged a human ({event.get('reason')})")
    if event["type"] == event_types.CORDON_IGNORED:     # trainguard/cordon/__init__.py: the launcher joined despite a cordon file
        status.attention.append(f"{_clock(ts)}  cordon of {event.get('host')} NOT honoured ({event.get('reason')}): "
                                f"the node joined the job (ignored {event.get('ignored_total')} time(s)); "
                                f"{event.get('why', '')}")
    if event["type"] == event_types.CONTROL_REFUSED:     # runtime/control.py: a request that did not prove who wrote it
        status.attention.append(f"{_clock(ts)}  control request {event.get('id')} ({event.get('action')}) REFUSED: "
                                f"{event.get('reason')}, not acted on ({event.get('refused_total')} refused so far); "
                                f"{event.get('why', '')}")
    if event["type"] == event_types.STOP_MARKER_REFUSED:   # protect/protector.py: a stop marker rank 0 did not sign
        status.attention.append(f"{_clock(ts)}  stop marker NOT honoured ({event.get('reason')}): the run started "
                                f"anyway; {event.get('why', '')}")
    if event["type"] == event_types.ACTION and event.get("refused"):
        reasons = sorted({str(r.get("reason")) for r in event["refused"] if isinstance(r, dict)})
        status.attention.append(f"{_clock(ts)}  restore refused to end {len(event['refused'])} process(es) "
                                f"that did not prove to be ranks of this run: {', '.join(reasons)}")


# ------------------------------------------------------------------------------------------- output

def _clock(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(ts))


def render(status: Status, now: float | None = None) -> str:
    now = time.time() if now is None else now
    m = status.metrics
    lines = [f"run      {status.run_id or Path(status.run_dir).name}  ({status.run_dir})"]
    if status.updated is None:
        return "\n".join(lines + ["         no TLS records yet under tls/"])
    lines[0] += f"  updated {format_elapsed(now - status.updated)} ago"
    if status.step is not None:
        parts = [f"step {status.step:,}"] + [f"{label} {format_value(m[key], unit)}" for key, label, unit in (
            ("loss", "loss", ""), ("grad_norm", "grad norm", ""), ("learning_rate", "lr", "")) if key in m]
        lines.append("training " + "   ".join(parts))
        speed = [f"{label} {format_value(m[key], unit)}" for key, label, unit in (
            ("tokens_per_second", "", "tok/s"), ("mfu", "MFU", "ratio"), ("step_time_seconds", "step", "s"))
            if key in m]
        if "mfu" not in m and speed:    # never a made-up figure: say there is none, and why
            speed.insert(1, f"MFU {mfu_na(status.mfu_unavailable)}")
        if m.get("step_time_seconds"):
            speed += [f"{label} {m[key] / m['step_time_seconds']:.0%}" for key, label in (
                ("data_wait_seconds", "data wait"), ("comm_seconds", "comm")) if key in m]
        if speed:
            lines.append("speed    " + "   ".join(s.strip() for s in speed))
    else:
        lines.append("training no step records yet")
    ranks = f"   ranks {','.join(map(str, status.ranks))}" if status.ranks else ""
    lines.append(f"ckpt     {status.last_checkpoint or 'none yet'}   {status.checkpoints_on_disk} on disk{ranks}")
    lines.append("gpus     " + _gpu_line(status))
    alerts = f"FIRING {', '.join(status.firing)}" if status.firing else "none firing"
    if status.resolved:
        alerts += f"   (resolved: {', '.join(status.resolved)})"
    lines.append("alerts   " + alerts)
    if status.shadowed or status.shadow_mode:
        would = ", ".join(f"{action} {count}" for action, count in sorted(status.shadowed.items()))
        lines.append("shadow   SHADOW mode: " + (f"would have taken {would} (none carried out)" if would
                                                 else "no action would have been taken"))
    for line in status.attention[-5:]:
        lines.append("ATTENTION " + line)
    if status.malformed:
        lines.append(f"logs     {status.malformed} malformed line(s), e.g. {status.errors[0]}")
    lines.append("events" + ("" if status.events else "   none in the recent log"))
    for e in status.events:
        step = f"step {e['step']}" if e["step"] is not None else ""
        lines.append(f"  {_clock(e['timestamp'])}  {step:<11}{e['type']:<20}{e['detail']}"[:160])
    return "\n".join(lines)


def _gpu_line(status: Status) -> str:
    gpus = status.gpus
    if not gpus:
        return "none" + (" (a CPU run)" if status.hosts else " recorded (no agent node log)")
    def peak(key: str, unit: str) -> str:
        values = [g[key] for g in gpus if isinstance(g.get(key), (int, float))]
        return f"{format_value(max(values), unit)}" if values else "n/a"
    utils = [g["gpu_util"] for g in gpus if isinstance(g.get("gpu_util"), (int, float))]
    util = f"util {min(utils):.0f}–{max(utils):.0f}%" if utils else "util n/a"
    return f"{len(gpus)}  {util}   temp max {peak('gpu_temp_c', '°C')}   mem max {peak('mem_used_bytes', 'bytes')}"


def finite_json(value):
    """`value` with every NaN or infinity as the string Python's json would have written bare ("NaN",
    "Infinity", "-Infinity"): bare, they are not JSON, and `jq` or any strict reader refuses the whole
    status; a string keeps what was recorded (a NaN loss is news)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {key: finite_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(item) for item in value]
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    parser.add_argument("--events", type=int_at_least(0), default=8, metavar="N",
                        help="recent events to show (default 8)")
    parser.add_argument("--tail-kib", type=int_at_least(1), default=TAIL_KIB, metavar="KIB",
                        help=f"how much of each log's end to read (default {TAIL_KIB})")
    parser.add_argument("--json", action="store_true", help="print the status as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        status = collect(args.run_dir, tail_kib=args.tail_kib, recent=args.events)
    except FileNotFoundError as exc:
        print(f"trainguard status: {exc}", file=sys.stderr)
        return 2
    if args.json:
        data = asdict(status)
        data["metrics"].pop("_ts", None)
        data.pop("checkpoint_ts", None)
        data["gpus"] = [{k: v for k, v in g.items()} for g in status.gpus]
        print(json.dumps(finite_json(data), default=str, allow_nan=False))
    else:
        print(render(status))
    return 0
