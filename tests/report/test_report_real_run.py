"""The report and status of a real `trainguard train` run (CPU), drawn by headless Chromium."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.report.browser import chromium

TRAINGUARD = [sys.executable, "-m", "trainguard.cli"]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("real") / "run"
    done = subprocess.run(TRAINGUARD + ["train", "--run-dir", str(run_dir), "--steps", "60", "--checkpoint-every",
                                        "20", "--inject", "nan@30"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return run_dir


def test_report_of_a_real_run_marks_its_events_and_draws(trained, tmp_path):
    done = subprocess.run(TRAINGUARD + ["report", str(trained)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    html = (trained / "report.html").read_text()
    story = html[html.index('<ul class="story">'):]
    assert "Trained steps 1–60" in story and "nan@30" in story and "skip_step" in story
    assert "No per-GPU data" in html                  # a CPU run, said plainly
    loss = html[html.index("<figcaption>Loss</figcaption>"):html.index("<figcaption>Gradient norm")]
    assert loss.count('class="mark mark-checkpoint"') == 3 and 'class="mark mark-skip"' in loss
    dom, console = chromium(trained / "report.html", tmp_path)
    assert console == []
    charts = int(re.search(r'data-charts="(\d+)"', dom).group(1))
    # a CPU run has no MFU chart (no documented peak: the card and the empty figure say n/a and why)
    assert charts >= 7 and f'data-drawn="{charts}"' in dom
    assert "MFU n/a (no documented peak FLOPs for a cpu device" in html


def test_status_of_a_real_run(trained):
    # the skip is 7 events before the end when the snapshot pace moved once after it, 8 or more on a busy
    # host where it moved again (each move a `snapshot_paced` event): beyond the default 8 recent events
    done = subprocess.run(TRAINGUARD + ["status", str(trained), "--events", "20"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert re.search(r"^training step 60 +loss \d", done.stdout, re.M)
    assert re.search(r"^ckpt +step_60", done.stdout, re.M)
    assert "skip_step" in done.stdout and "run_end" in done.stdout
