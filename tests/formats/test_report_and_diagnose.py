"""`trainguard report` and `trainguard diagnose` read another tool's logs in a run folder directly, as
replay does (trainguard.formats.discover): no `trainguard convert` first."""

import json
import subprocess
import sys

from tests.formats.helpers import megatron_log
from trainguard.report.data import load_run

TRAINGUARD = [sys.executable, "-m", "trainguard.cli"]


def test_report_and_diagnose_of_a_megatron_log_folder(tmp_path):
    folder = tmp_path / "megatron-run"
    folder.mkdir()
    megatron_log(folder / "train.log")
    run = load_run(folder)
    assert (run.step_records, run.first_step, run.last_step) == (100, 1, 100)
    ys = sorted(y for _, y in run.training["loss"].points())
    assert ys[-1] > 20 * ys[len(ys) // 2]                 # the 50x spike is drawn

    out = tmp_path / "report.html"
    done = subprocess.run(TRAINGUARD + ["report", str(folder), "-o", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "<svg" in out.read_text()
    done = subprocess.run(TRAINGUARD + ["diagnose", str(folder), "--json"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["records"] == 100 and found["files"] == [str(folder / "train.log")] and found["malformed"] == 0

