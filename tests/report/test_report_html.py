"""The HTML report: self-contained, every section present, and drawn by a real browser without errors."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.report.browser import chromium
from tests.report.synthetic import write_run
from trainguard.report import render_report, write_report

TRAINGUARD = [sys.executable, "-m", "trainguard.cli"]


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return write_run(tmp_path_factory.mktemp("run"), steps=120, ranks=2, gpus=2, spike_at=80)


def test_report_is_one_file_that_loads_nothing(synthetic):
    html = render_report(synthetic)
    assert "Content-Security-Policy" in html and "default-src 'none'" in html
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert "url(" not in html and "@import" not in html


def test_report_has_every_section_and_the_story(synthetic):
    html = render_report(synthetic)
    for anchor in ("summary", "training", "throughput", "gpus", "io", "cost", "goodput", "events", "logs"):
        assert f'id="{anchor}"' in html
    for chart in ("Loss", "Gradient norm", "Learning rate", "Tokens per second", "Step time breakdown",
                  "GPU utilisation", "GPU memory used", "GPU temperature", "Disk await", "Cost per 1000 steps against budget"):
        assert f"<figcaption>{chart}</figcaption><svg" in html, chart
    story = html[html.index('<ul class="story">'):]
    for fact in ("steps 1–120", "spike@80", "skip_step", "rollback", "LossSpike", "6 checkpoint(s) saved",
                 "1 malformed log line"):
        assert fact in story, fact
    loss = html[html.index("<figcaption>Loss</figcaption>"):html.index("<figcaption>Gradient norm")]
    for kind in ("checkpoint", "skip", "rollback", "alert", "fault"):
        assert f'class="mark mark-{kind}"' in loss, kind
    assert "rank-0.jsonl:130" in html        # the malformed line, named


def test_cpu_run_says_plainly_there_are_no_gpus(tmp_path):
    html = render_report(write_run(tmp_path, node=False, gpus=0, spike_at=None, malformed=0))
    assert "No per-GPU data" in html and "CPU run" in html
    assert "No faults were injected." in html and "The guard took no action." in html


def test_browser_draws_every_chart_and_logs_nothing(synthetic, tmp_path):
    path = write_report(synthetic, tmp_path / "report.html")
    dom, console = chromium(path, tmp_path)
    assert console == []
    charts = int(re.search(r'<body[^>]* data-charts="(\d+)"', dom).group(1))
    drawn = int(re.search(r'<body[^>]* data-drawn="(\d+)"', dom).group(1))
    assert charts >= 15 and drawn == charts
    assert len(re.findall(r'<figure class="plot" data-chart="\d+" data-drawn="\d+"', dom)) == charts


def test_browser_check_catches_a_broken_page(tmp_path):
    # The harness above must be able to fail: a page whose script throws is reported, and draws nothing.
    page = tmp_path / "broken.html"
    page.write_text('<!doctype html><body data-charts="1"><script>missing.call();</script></body>')
    dom, console = chromium(page, tmp_path)
    assert any("missing is not defined" in line for line in console)
    assert "data-drawn" not in dom


def test_cli_writes_the_default_path_and_names_a_missing_run(synthetic, tmp_path):
    done = subprocess.run(TRAINGUARD + ["report", str(synthetic)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(synthetic / "report.html") and (synthetic / "report.html").stat().st_size
    out = tmp_path / "elsewhere" / "r.html"
    done = subprocess.run(TRAINGUARD + ["report", str(synthetic), "-o", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and out.read_text().startswith("<!doctype html>")
    done = subprocess.run(TRAINGUARD + ["report", str(tmp_path / "nope")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "nope: no such run directory" in done.stderr


def test_nccl_counts_of_the_agent_are_shown(tmp_path):
    from trainguard.tls import Writer, make_record

    root = write_run(tmp_path, steps=20, spike_at=None, malformed=0)
    html = render_report(root)
    assert "<td>init</td><td>2</td>" in html and "<td>error</td>" not in html
    with Writer(root / "tls" / "node-host-a.jsonl") as writer:
        writer.write(make_record(timestamp=1_710_512_600, node="host-a",
                                 system={"nccl_events": {"error": 2, "watchdog_timeout": 1, "init": 2}}))
    html = render_report(root)
    assert "<td>error</td><td>2</td>" in html and "<td>watchdog_timeout</td><td>1</td>" in html


def test_a_line_is_cut_at_a_gap_and_across_a_span_it_has_no_point_in():
    from trainguard.report.charts import GAP_FACTOR, Span, pieces

    steps = [(float(t), 1.0) for t in range(10)] + [(30.0, 1.0), (31.0, 1.0)]
    assert [len(p) for p in pieces(steps)] == [10, 2]                  # 21 s where 1 s is usual
    short = [(0.0, 1.0), (1.0, 1.0), (1.0 + GAP_FACTOR - 0.5, 1.0), (2.0 + GAP_FACTOR, 1.0)]
    assert len(pieces(short)) == 1
    stall = Span(2.0, 4.0, "stall", "stalled")
    assert [len(p) for p in pieces([(0.0, 1.0), (2.0, 1.0), (4.5, 1.0), (5.0, 1.0)], [stall])] == [2, 2]
    # A node's samples kept coming during the stall: its line is not cut (it has points in the span).
    sampled = [(t / 2, 1.0) for t in range(12)]
    assert len(pieces(sampled, [stall])) == 1


def test_a_chart_shades_its_spans_and_marks_its_axis():
    from trainguard.report.charts import Line, Span, line_chart

    svg = line_chart([Line("loss", [(0.0, 2.0), (1.0, 1.9), (9.0, 1.5), (10.0, 1.4)])], t0=0.0,
                     spans=[Span(1.0, 9.0, "stall", "stalled 8s")])
    assert 'class="span span-stall"' in svg and "<title>stalled 8s</title>" in svg and 'data-axis="time"' in svg
    [d] = re.findall(r'<path class="series" data-series="0" d="([^"]+)"', svg)
    assert d.count("M") == 2
    stepped = line_chart([Line("loss", [(1.0, 2.0), (50.0, 1.5)]), Line("old", [(20.0, 1.8), (30.0, 1.7)],
                                                                        faded=True, group=0)], t0=0.0, by_step=True)
    assert 'data-axis="step"' in stepped and 'class="series faded" data-series="0"' in stepped
    assert ">20<" in stepped and ">40<" in stepped
