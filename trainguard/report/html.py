"""The run report as one self-contained HTML file: inline CSS, inline SVG charts, a few lines of inline script.

A Content-Security-Policy with `default-src 'none'` makes the promise checkable: the page cannot load
anything from anywhere, and a browser says so on its console if anything tries.
"""

from __future__ import annotations

import time
from html import escape
from pathlib import Path

from trainguard.report import charts
from trainguard.report.charts import HLine, Line, Mark, Span, format_value
from trainguard.report.charts import mfu_na
from trainguard.report.data import Pass, Run
from trainguard.report.summary import goodput_shares, sentences, tiles

ASSETS = Path(__file__).with_name("assets")
CSP = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:"
MARKED = ("checkpoint", "skip", "rollback", "restore", "alert", "fault", "phase")
STEP_PARTS = (("data_wait_seconds", "data wait"), ("forward_backward_seconds", "forward + backward"),
              ("optimizer_seconds", "optimizer"), ("comm_seconds", "communication"))
GPU_LINES_MAX = 16
BADPUT_COLORS = ("#e03131", "#f08c00", "#ae3ec9", "#1c7ed6", "#0c8599", "#868e96", "#c2255c", "#5c940d")


class Page:
    """Builds the figures of one run; every chart shares the run's time axis and event marks."""

    def __init__(self, run: Run):
        self.run = run
        span = run.span
        self.t0 = span[0] if span else 0.0
        self.x_range = span if span and span[1] > span[0] else None
        self.marks = [Mark(m.timestamp, kind, m.label)
                      for kind in MARKED for m in run.markers.get(kind, ())]
        self.spans: list[Span] = run.spans
        # On the step axis a rollback or restart is where a new pass starts again (steps repeat).
        self.step_marks = [Mark(p.start_step, "rollback" if p.cause == "rollback" else "restore",
                                f"{p.cause}: steps from {p.start_step} again (the earlier pass, faded, was "
                                f"thrown away)") for p in run.passes[1:]]
        self.charts = 0

    def figure(self, title: str, lines: list[Line], unit: str = "", *, empty: str, marks: bool = False,
               hlines: list[HLine] = (), note: str = "", y_min: float | None = None,
               y_max: float | None = None) -> str:
        if self.x_range:   # the agent's records from before and after the run stay off the chart
            low, high = self.x_range
            lines = [Line(line.label, [p for p in line.points if low <= p[0] <= high], line.color, line.dash)
                     for line in lines]
        kept = [line for line in lines if line.points]
        head = f"<figcaption>{escape(title)}</figcaption>"
        if not kept:
            return f'<figure class="plot empty">{head}<p class="absent">{escape(empty)}</p></figure>'
        self.charts += 1
        svg = charts.line_chart(kept, t0=self.t0, unit=unit, marks=self.marks if marks else (),
                                hlines=hlines, y_min=y_min, y_max=y_max, x_range=self.x_range, spans=self.spans)
        keys = _keys([line.label for line in kept], charts.line_colors(kept))
        foot = f'<p class="note">{escape(note)}</p>' if note else ""
        return f'<figure class="plot" data-chart="{self.charts}">{head}{svg}<div class="keys">{keys}</div>{foot}</figure>'

    def series_figure(self, title: str, metrics: list[tuple[str, str]], unit: str = "", *, empty: str,
                      marks: bool = True, note: str = "", y_min: float | None = None,
                      hlines: list[HLine] = ()) -> str:
        """A training metric chart drawn twice: over steps (shown first, each pass of a rollback or restart
        on its own, the discarded one faded) and over wall time (stalls and restarts shaded)."""
        low, high = self.x_range or (float("-inf"), float("inf"))
        present = [(key, label) for key, label in metrics if self.run.training.get(key)]
        timed = [Line(label, [p for p in self.run.training[key].points() if low <= p[0] <= high], group=i)
                 for i, (key, label) in enumerate(present)]
        timed = [line for line in timed if line.points]
        head = f"<figcaption>{escape(title)}</figcaption>"
        if not timed:
            return f'<figure class="plot empty">{head}<p class="absent">{escape(empty)}</p></figure>'
        self.charts += 1
        stepped = [line for i, (key, label) in enumerate(present) for line in _pass_lines(self.run.passes, key, label, i)]
        by_step = charts.line_chart(stepped, t0=0.0, unit=unit, marks=self.step_marks if marks else (),
                                    hlines=hlines, y_min=y_min, by_step=True) if stepped else ""
        by_time = charts.line_chart(timed, t0=self.t0, unit=unit, marks=self.marks if marks else (), hlines=hlines,
                                    y_min=y_min, x_range=self.x_range, spans=self.spans)
        views = (by_step.replace('<svg class="chart"', '<svg class="chart view view-step"', 1)
                 + by_time.replace('<svg class="chart"', '<svg class="chart view view-time"', 1))
        keys = _keys([label for _, label in present], [charts.PALETTE[i % len(charts.PALETTE)]
                                                       for i in range(len(present))])
        foot = f'<p class="note">{escape(note)}</p>' if note else ""
        return (f'<figure class="plot" data-chart="{self.charts}">{head}{views}<div class="keys">{keys}</div>'
                f'{foot}</figure>')

    def training(self, key: str, label: str | None = None) -> Line:
        series = self.run.training.get(key)
        return Line(label or key, series.points() if series else [])


def _keys(labels: list[str], colors: list[str]) -> str:
    return "".join(f'<button type="button" class="key" data-series="{i}" style="--c:{color}">{escape(label)}</button>'
                   for i, (label, color) in enumerate(zip(labels, colors)))


def _pass_lines(passes: list[Pass], key: str, label: str, group: int) -> list[Line]:
    """A metric over steps, pass by pass: what was kept, and (faded) what a later pass threw away."""
    out = []
    for number, done in enumerate(passes, 1):
        series = done.series.get(key)
        if not series:
            continue
        points = series.points()
        cut = done.discarded_from if done.discarded_from is not None else float("inf")
        kept = [p for p in points if p[0] < cut]
        thrown = [p for p in points if p[0] >= cut]
        if kept:
            out.append(Line(f"{label} (pass {number})" if len(passes) > 1 else label, kept, group=group))
        if thrown:
            out.append(Line(f"{label}: pass {number}, steps {thrown[0][0]:.0f}–{thrown[-1][0]:.0f} thrown away by "
                            f"the {passes[number].cause if number < len(passes) else 'next pass'}",
                            thrown, group=group, faded=True))
    return out


# ------------------------------------------------------------------------------------------ sections

def _section(title: str, body: str, anchor: str) -> str:
    return f'<section id="{anchor}"><h2>{escape(title)}</h2>{body}</section>'


def _nonfinite_note(run: Run, key: str) -> str:
    series = run.training.get(key)
    return f"{series.nonfinite} non-finite value(s) not drawn." if series and series.nonfinite else ""


def training_section(page: Page) -> str:
    run = page.run
    legend = "".join(f'<span class="mk" style="--c:{charts.MARK_COLORS[k]}">{charts.MARK_NAMES[k]}'
                     f' ({len(run.markers[k])}{"+" if run.markers[k].thinned else ""})</span>'
                     for k in MARKED if k in run.markers)
    kinds = sorted({span.kind for span in run.spans}, key=list(charts.SPAN_COLORS).index)
    legend += "".join(f'<span class="sp" style="--c:{charts.SPAN_COLORS[k]}">{charts.SPAN_NAMES[k]} '
                      f'({sum(1 for s in run.spans if s.kind == k)})</span>' for k in kinds)
    body = f'<p class="marklegend">{legend or "No checkpoints, skipped steps, rollbacks, restores or alerts."}</p>'
    body += AXIS_TOGGLE
    empty = "No training metrics recorded."
    body += page.series_figure("Loss", [("loss", "loss"), ("val_loss", "validation loss")],
                               empty=empty, note=_nonfinite_note(run, "loss"))
    body += page.series_figure("Gradient norm", [("grad_norm", "grad norm")], empty=empty,
                               note=_nonfinite_note(run, "grad_norm"))
    body += page.series_figure("Learning rate", [("learning_rate", "learning rate")], empty=empty)
    return _section("Training", body, "training")


AXIS_TOGGLE = ('<p class="axis-toggle">x axis: <button type="button" data-axis="step" class="on">step</button>'
               '<button type="button" data-axis="time">wall time</button> <span class="note">By step, a rollback '
               'or restart draws the steps it repeats again, and the pass it threw away faded; by wall time, '
               'stalls and restarts are shaded and no line crosses them.</span></p>')


def throughput_section(page: Page) -> str:
    ranks = len(page.run.ranks)
    body = page.series_figure("Tokens per second", [("tokens_per_second", "tokens/s")], "tok/s",
                              empty="No throughput recorded.", y_min=0, marks=False,
                              note=f"Rank {page.run.primary_rank}'s; the {ranks} ranks together train about {ranks} "
                                   f"times this." if ranks > 1 else "")
    body += page.series_figure("Model FLOPs utilisation (MFU)", [("mfu", "MFU")], "ratio", marks=False,
                               empty=f"MFU {mfu_na(page.run.mfu_unavailable)}: it is recorded only where the "
                                     "device's peak FLOPs are documented (runtime/mfu.py) or given.",
                               y_min=0)
    body += page.series_figure("Step time breakdown", [("step_time_seconds", "step time"), *STEP_PARTS], "s",
                               empty="No step timing recorded.", y_min=0, marks=False,
                               note="The parts overlap when communication runs during backward.")
    return _section("Throughput", body, "throughput")


def _gpu_lines(run: Run, key: str) -> tuple[list[Line], str]:
    keys = sorted(run.gpus)
    lines = []
    for host, gpu in keys[:GPU_LINES_MAX]:
        series = run.gpus[(host, gpu)].get(key)
        label = f"{host} GPU {gpu}" if len(run.hosts) > 1 else f"GPU {gpu}"
        lines.append(Line(label, series.points() if series else []))
    note = f"Showing {GPU_LINES_MAX} of {len(keys)} GPUs." if len(keys) > GPU_LINES_MAX else ""
    return lines, note


def gpu_section(page: Page) -> str:
    run = page.run
    if not run.gpus:
        where = "no agent node logs (RUN/tls/node-*.jsonl)" if not run.hosts else "no per-GPU records"
        body = (f'<p class="absent">No per-GPU data: this run has {where}. That is expected for a CPU run; '
                f'on GPU nodes the agent records utilisation, memory and temperature per GPU.</p>')
        return _section("GPUs", body + _host_memory(page) + _health_findings(run), "gpus")
    body = ""
    for title, key, unit, extra in (("GPU utilisation", "gpu_util", "percent", {"y_min": 0, "y_max": 100}),
                                    ("GPU memory used", "mem_used_bytes", "bytes", {"y_min": 0}),
                                    ("GPU memory utilisation", "mem_util", "percent", {"y_min": 0, "y_max": 100}),
                                    ("GPU temperature", "gpu_temp_c", "°C", {}),
                                    ("GPU power", "gpu_power_w", "W", {"y_min": 0})):
        lines, note = _gpu_lines(run, key)
        hlines = ([HLine(run.policy.alerts.gpu_temp_c, f"GPUOverheating {run.policy.alerts.gpu_temp_c:g} °C")]
                  if key == "gpu_temp_c" else [])
        body += page.figure(title, lines, unit, empty=f"No {title.lower()} recorded.", note=note, hlines=hlines,
                            **extra)
    return _section("GPUs", body + _health_findings(run), "gpus")


def _health_findings(run: Run) -> str:
    """Other tools' findings on the nodes' timelines (dcgmi diag, NCCL RAS, kernel NVRM lines), by host."""
    if not run.health.items:
        return ""
    thinned = " (evenly thinned to fit)" if run.health.thinned else ""
    return _event_table(sorted(run.health, key=lambda r: (r.timestamp, r.source)),
                        f"Node health findings{thinned}", "")


def _host_memory(page: Page) -> str:
    lines = [page.training(k, n) for k, n in (("mem_allocated_bytes", "allocated"),
                                               ("mem_reserved_bytes", "reserved"), ("rss_bytes", "process RSS"))]
    return page.figure("Trainer memory (rank 0)", lines, "bytes", empty="No trainer memory recorded.", y_min=0)


def _host_lines(run: Run, key: str, label: str) -> list[Line]:
    return [Line(f"{label} {host}" if len(run.hardware) > 1 else label, table[key].points())
            for host, table in sorted(run.hardware.items()) if key in table]


def io_section(page: Page) -> str:
    run, alerts = page.run, page.run.policy.alerts
    body = page.figure("Disk await", _host_lines(run, "disk_await_ms", "await"), "ms",
                       hlines=[HLine(alerts.disk_await_ms, f"DiskAwaitHigh {alerts.disk_await_ms:g} ms")],
                       empty="No disk await recorded (the agent's io collector writes it).", y_min=0)
    body += page.figure("Data throughput", _host_lines(run, "data_throughput", "read"), "bytes/s",
                        empty="No data throughput recorded.", y_min=0)
    shares = [Line(label, run.shares[key].points() if key in run.shares else [])
              for key, label in (("data_wait", "data wait"), ("comm", "communication"))]
    body += page.figure("Data wait and communication, share of step time", shares, "ratio", y_min=0,
                        hlines=[HLine(alerts.data_wait_ratio, f"DataLoaderStarved {alerts.data_wait_ratio:.0%}"),
                                HLine(alerts.comm_overhead_max, f"CommOverheadHigh {alerts.comm_overhead_max:.0%}",
                                      "#f08c00")],
                        empty="No data wait or communication time recorded.",
                        note="Each step's part over that step's time (a single rank has no communication).")
    body += _nccl(run)
    return _section("IO and NCCL", body, "io")


def _nccl(run: Run) -> str:
    counted = {host: {k: v for k, v in counts.items() if v} for host, counts in sorted(run.nccl.items())}
    rows = "".join(f"<tr><td>{escape(host)}</td><td>{escape(kind)}</td><td>{count:,}</td></tr>"
                   for host, counts in counted.items() for kind, count in sorted(counts.items()))
    head = "<h3>NCCL events</h3>"
    if rows:
        head += f"<table><tr><th>host</th><th>event</th><th>count</th></tr>{rows}</table>"
    elif run.nccl:
        head += (f'<p class="absent">The agent on {escape(", ".join(sorted(run.nccl)))} found no NCCL errors, aborts '
                 f'or watchdog timeouts in the ranks\' logs.</p>')
    else:
        head += '<p class="absent">No NCCL counts recorded (no agent node logs).</p>'
    events = [row for row in run.events if "nccl" in row.type.lower() or "NCCL" in row.detail]
    return head + (_event_table(events, "NCCL events in the logs", "") if events else "")


def cost_section(page: Page) -> str:
    run, policy = page.run, page.run.policy.cost
    series = run.cost.get("cost_per_1k_steps")
    budget = policy.budget_per_1k_steps
    hlines = [HLine(budget, f"budget {format_value(budget, 'usd')}", "#2f9e44")] + [
        HLine(budget * (1 + getattr(policy.tiers, tier)), f"{tier} +{getattr(policy.tiers, tier):.0%}", color)
        for tier, color in (("warn", "#f08c00"), ("throttle", "#e8590c"), ("stop", "#e03131"))]
    lines = [Line("cost per 1000 steps", [(x, y) for x, y in series.points() if y > 0] if series else [])]
    metered = run.cost_state is not None and run.cost_state.gpu_count > 0
    empty = ("No step records to meter." if run.last_step is None or metered else
             "Not metered: the run recorded no GPUs (a CPU run); set cost.gpu_count_override in the policy "
             "to bill it as that many devices.")
    body = page.figure("Cost per 1000 steps against budget", lines, "usd", hlines=hlines, y_min=0,
                       empty=empty, marks=False,
                       note=f"Metered by the agent's CostMeter over the last {policy.window_steps} steps at "
                            f"{format_value(policy.price_per_gpu_hour, 'usd')} per GPU-hour.")
    spent = run.cost.get("cost_usd")
    body += page.figure("Spend", [Line("spent", spent.points() if spent and metered else [])], "usd", y_min=0,
                        empty=empty)
    return _section("Cost", body, "cost")


def goodput_section(page: Page) -> str:
    run = page.run
    shares = goodput_shares(run)
    if not shares:
        why = run.goodput_error or "the run has no step records to measure"
        return _section("Goodput", f'<p class="absent">No goodput breakdown: {escape(why)}.</p>', "goodput")
    badput = sorted(((k, v) for k, v in shares.items() if k != "goodput" and v > 0), key=lambda kv: -kv[1])
    parts = [("productive training", shares["goodput"], "#2f9e44")] + [
        (cause.replace("_", " "), share, BADPUT_COLORS[i % len(BADPUT_COLORS)])
        for i, (cause, share) in enumerate(badput)]
    page.charts += 1
    rows = "".join(f"<tr><td><span class='sw' style='--c:{c}'></span>{escape(n)}</td><td>{v:.1%}</td></tr>"
                   for n, v, c in parts)
    body = (f'<figure class="plot" data-chart="{page.charts}"><figcaption>Share of wall time</figcaption>'
            f'{charts.share_bar(parts, "ratio")}</figure><table class="small"><tr><th>time</th><th>share</th></tr>'
            f'{rows}</table>')
    restarts = getattr(run.goodput, "in_process_restarts", 0)
    if restarts:    # docs/recovery.md, "The books"
        body += (f'<p class="small">In-process restarts: {restarts}; the in-memory snapshots kept '
                 f'{run.goodput.snapshot_steps_saved} step(s) a restore of the checkpoint would have lost.</p>')
    return _section("Goodput and badput", body, "goodput")


def _event_table(rows, title: str, empty: str) -> str:
    if not rows:
        return f'<h3>{escape(title)}</h3><p class="absent">{escape(empty)}</p>'
    body = "".join(f"<tr><td>{time.strftime('%H:%M:%S', time.gmtime(r.timestamp))}</td><td>{escape(r.type)}</td>"
                   f"<td>{'' if r.step is None else r.step}</td><td>{escape(r.source)}</td>"
                   f"<td>{escape(r.detail)}</td></tr>" for r in rows)
    return (f'<h3>{escape(title)}</h3><table><tr><th>time (UTC)</th><th>event</th><th>step</th><th>from</th>'
            f'<th>detail</th></tr>{body}</table>')


def events_section(page: Page) -> str:
    run = page.run
    counts = ", ".join(f"{k} ×{v}" for k, v in run.event_counts.most_common()) or "none"
    thinned = " (evenly thinned to fit)" if run.events.thinned else ""
    body = f"<p>Events by type: {escape(counts)}.</p>"
    body += _event_table(sorted(run.events, key=lambda r: r.timestamp), f"Events{thinned}", "No events were recorded.")
    rows = "".join(f"<tr><td>{escape(c.name)}</td><td>{escape(c.error or 'manifest present')}</td></tr>"
                   for c in run.checkpoints)
    body += (f"<h3>Checkpoints on disk</h3><table><tr><th>checkpoint</th><th>state</th></tr>{rows}</table>"
             if rows else '<h3>Checkpoints on disk</h3><p class="absent">None.</p>')
    return _section("Events and checkpoints", body, "events")


def quality_section(run: Run) -> str:
    files = "".join(f"<li><code>{escape(f)}</code></li>" for f in run.files) or "<li>none</li>"
    errors = "".join(f"<li><code>{escape(e)}</code></li>" for e in run.errors)
    more = f"<p>…and {run.malformed - len(run.errors)} more.</p>" if run.malformed > len(run.errors) else ""
    body = (f"<p>{run.records:,} records read, {run.malformed:,} malformed line(s).</p>"
            + (f"<ul class='errors'>{errors}</ul>{more}" if errors else "")
            + f"<details><summary>Files read ({len(run.files)})</summary><ul>{files}</ul></details>")
    return _section("Logs read", body, "logs")


# ---------------------------------------------------------------------------------------------- page

def render(run: Run) -> str:
    page = Page(run)
    sections = [training_section(page), throughput_section(page), gpu_section(page), io_section(page),
                cost_section(page), goodput_section(page), events_section(page), quality_section(run)]
    tile_html = "".join(f'<div class="tile {t.tone}" title="{escape(t.hint)}"><div class="v">{escape(t.value)}</div>'
                        f'<div class="l">{escape(t.label)}</div><div class="d">{escape(t.hint)}</div></div>'
                        for t in tiles(run))
    story = "".join(f"<li>{escape(s)}</li>" for s in sentences(run))
    span = ""
    if run.span is not None:
        span = (time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(run.span[0])) + " – "
                + time.strftime("%H:%M:%S UTC", time.gmtime(run.span[1])))
    title = f"trainguard report: {run.run_id or run.run_dir.name}"
    nav = "".join(f'<a href="#{a}">{n}</a>' for a, n in (("training", "Training"), ("throughput", "Throughput"),
                  ("gpus", "GPUs"), ("io", "IO & NCCL"), ("cost", "Cost"), ("goodput", "Goodput"),
                  ("events", "Events"), ("logs", "Logs")))
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<title>{escape(title)}</title><style>{(ASSETS / "report.css").read_text()}</style></head>'
            f'<body class="by-step" data-charts="{page.charts}"><header><h1>{escape(title)}</h1>'
            f'<p class="sub">{escape(str(run.run_dir))} · {escape(span)} · generated '
            f'{time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}</p><nav>{nav}</nav></header>'
            f'<main><div class="tiles">{tile_html}</div><section id="summary"><h2>What happened</h2>'
            f'<ul class="story">{story}</ul></section>{"".join(sections)}</main>'
            f'<script>{(ASSETS / "report.js").read_text()}</script></body></html>')
