"""A real run with a rollback and a hang, told truthfully by the report, goodput and replay.

Two ranks of the bundled trainer (torchrun, gloo on CPU) with `trainguard agent` beside them: NaNs at
steps 15-17 make the guard roll back to step 10 (steps 11-17 run twice); a hang at step 40 is seen by
the agent's embedded stall watchdog, which restores (ends the ranks; torchrun starts them again from
step 30). One run (the `hung_run` fixture of tests/conftest.py, tests/hung_run.py), shared by
the tests below and by tests/reliability/test_restore_needs_a_restart.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

from tests.report.browser import chromium
from tests.hung_run import STALL_SECONDS
from trainguard import tls

TRAINGUARD = [sys.executable, "-m", "trainguard.cli"]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def _events(path, kind):
    return [r for r in tls.read_records(path) if isinstance(r.get("event"), dict) and r["event"]["type"] == kind]


def _recorded_times(run_dir):
    """(last step before the hang, the agent's restore decision, first step after the restart) from the logs."""
    steps = [r for r in tls.read_records(run_dir / "tls" / "rank-0.jsonl") if r.get("metrics") and "step" in r]
    hang = _events(run_dir / "tls" / "rank-0.jsonl", "fault_injected")[-1]
    before = max(r["timestamp"] for r in steps if r["timestamp"] < hang["timestamp"])
    [action] = _events(run_dir / "tls" / f"node-{_host(run_dir)}-actions.jsonl", "action")
    after = min((r for r in steps if r["timestamp"] > action["timestamp"]), key=lambda r: r["timestamp"])
    resumed = after["timestamp"] - after["metrics"].get("step_time_seconds", 0.0)
    return before, action["event"]["issued_at"], resumed


def _host(run_dir):
    [path] = (run_dir / "tls").glob("node-*-actions.jsonl")
    return path.name[len("node-"):-len("-actions.jsonl")]


def _segments(path_d: str) -> list[list[tuple[float, float]]]:
    """The sub-paths of an SVG path `d` (M starts one, L continues it) as pixel points."""
    pieces = []
    for command, x, y in re.findall(r"([ML])(-?[\d.]+),(-?[\d.]+)", path_d):
        if command == "M":
            pieces.append([])
        pieces[-1].append((float(x), float(y)))
    return pieces


def _time_of(px: float, svg: str) -> float:
    from trainguard.report.charts import PAD_L, PAD_R, WIDTH

    x0, x1 = (float(v) for v in re.search(r'data-x0="([\d.]+)" data-x1="([\d.]+)"', svg).groups())
    return x0 + (px - PAD_L) / (WIDTH - PAD_L - PAD_R) * (x1 - x0)


def test_the_report_breaks_lines_at_the_stall_shades_it_and_draws_both_axes(hung_run, tmp_path):
    done = subprocess.run(TRAINGUARD + ["report", str(hung_run)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    html = (hung_run / "report.html").read_text()
    loss = html[html.index("<figcaption>Loss</figcaption>"):html.index("<figcaption>Gradient norm")]
    by_time = re.search(r'<svg class="chart view view-time".*?</svg>', loss).group(0)
    by_step = re.search(r'<svg class="chart view view-step".*?</svg>', loss).group(0)

    before, decided, resumed = _recorded_times(hung_run)
    stall = re.search(r'class="span span-stall"[^>]*data-start="([\d.]+)" data-end="([\d.]+)"', by_time)
    restart = re.search(r'class="span span-restart"[^>]*data-start="([\d.]+)" data-end="([\d.]+)"', by_time)
    assert stall and restart
    assert float(stall.group(1)) == pytest.approx(before, abs=0.01)
    assert float(stall.group(2)) == pytest.approx(decided, abs=0.01) == pytest.approx(float(restart.group(1)))
    assert float(restart.group(2)) == pytest.approx(resumed, abs=0.5)

    # No segment of the loss line joins a point before the stall to one after the restart.
    [path] = re.findall(r'<path class="series" data-series="0" d="([^"]+)"', by_time)
    pieces = _segments(path)
    assert len(pieces) >= 2
    for piece in pieces:
        for (xa, _), (xb, _) in zip(piece, piece[1:]):
            assert not (_time_of(xa, by_time) <= before + 0.01 and _time_of(xb, by_time) >= resumed - 0.01)
    assert any(_time_of(p[-1][0], by_time) <= before + 0.05 for p in pieces)   # a piece ends at the stall
    assert any(_time_of(p[0][0], by_time) >= resumed - 0.5 for p in pieces)   # another starts after it

    # By step: three passes (start, after the rollback to 10, after the restart from 30 + the snapshot of 35);
    # the first two have faded tails, steps 11-17 and 36-39, thrown away.
    assert 'data-axis="step"' in by_step and 'data-axis="time"' in by_time
    faded = re.findall(r'<path class="series faded" data-series="0" d="[^"]+"[^>]*><title>([^<]+)</title>', by_step)
    assert len(faded) == 2 and "rollback" in faded[0] and "restart" in faded[1]
    # The restarted workers resume from the checkpoint of step 30, then take the in-memory snapshot of step
    # 35 taken on top of it (docs/recovery.md): only 36-39 are thrown away.
    assert re.search(r"steps 1[1-4]–1[4-7]", faded[0]) and re.search(r"steps 3[6-8]–39", faded[1])
    assert by_step.count('class="mark mark-rollback"') == 1 and by_step.count('class="mark mark-restore"') == 1
    assert ">10<" in by_step and ">60<" in by_step                      # step ticks
    assert re.search(r">\d+s<", by_time)                                  # elapsed-time ticks

    # Every card says what it counts; the red loss says why.
    cards = re.findall(r'<div class="tile[^"]*" title="([^"]*)"><div class="v">[^<]*</div><div class="l">([^<]*)<', html)
    assert {label for _, label in cards} >= {"steps", "final loss", "goodput", "guard actions", "wall time"}
    assert all(hint for hint, _ in cards)
    assert "non-finite loss" in dict((label, hint) for hint, label in cards)["final loss"]

    dom, console = chromium(hung_run / "report.html", tmp_path, screenshot=tmp_path / "by-step.png")
    assert console == []
    dom, console = chromium(hung_run / "report.html", tmp_path)
    charts = int(re.search(r'data-charts="(\d+)"', dom).group(1))
    assert f'data-drawn="{charts}"' in dom and console == []


def here(capfd, *args: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of a command run in this process: the tests below are about what the
    commands say of this run; each command also runs once here as a process (report, goodput, replay)."""
    from trainguard.cli import main

    code = main(list(args))
    out, err = capfd.readouterr()
    return code, out, err


def test_goodput_splits_the_hang_into_stall_and_restart_recovery(hung_run, capfd):
    code, out, err = here(capfd, "goodput", str(hung_run), "--json")
    assert code == 0, err
    result = json.loads(out)
    before, decided, resumed = _recorded_times(hung_run)
    [hang] = result["hangs"]
    assert hang["stall_seconds"] == pytest.approx(decided - before, abs=1.0)
    assert hang["restart_recovery_seconds"] == pytest.approx(resumed - decided, abs=1.0)
    assert hang["stall_seconds"] >= STALL_SECONDS - 0.5          # the watchdog waited its stall_seconds
    assert hang["decided_by"].startswith("restore-")
    from trainguard import incidents      # the agent's watchdog gathered evidence before it restored

    assert hang["incident"] in [found for found, verdict, _ in incidents.scan(hung_run) if verdict]
    assert result["badput_seconds"]["stall"] >= hang["stall_seconds"]
    assert result["badput_seconds"]["restart_recovery"] >= hang["restart_recovery_seconds"]
    assert result["restarts"] == 1 and result["rollbacks"] == 1


def test_goodput_names_the_incident_a_hang_belongs_to(hung_run, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(hung_run / "tls", copy / "tls")
    _, decided, _ = _recorded_times(hung_run)
    from trainguard import incidents

    incidents.write_incident(copy, incidents.Incident("hang-1", "hang", decided, "embedded", action="restore"))
    done = subprocess.run(TRAINGUARD + ["goodput", str(copy)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert re.search(r"hang 1 at .*: stall [\d.]+s, restart_recovery [\d.]+s; restore decided .*incident hang-1",
                     done.stdout)


def test_replay_lists_the_alert_the_restore_and_the_restart_and_expect_asserts_on_them(hung_run, tmp_path, capfd):
    code, out, err = here(capfd, "replay", str(hung_run), "--json")
    assert code == 0, err
    result = json.loads(out)
    actions = [(a["action"], a["source"]) for a in result["recorded_actions"]]
    assert ("restore", "agent+control") in actions
    assert ("restart", "trainer") in actions and ("rollback", "trainer") in actions
    [alert] = result["recorded_alerts"]
    assert alert["alertname"] == "TrainingStalled" and alert["detail"]["action"] == "restore"
    restart = next(a for a in result["recorded_actions"] if a["action"] == "restart")
    assert restart["step"] == 30

    expectation = tmp_path / "expect.yml"
    expectation.write_text(yaml.safe_dump({
        # the run's own signed policy (its stall_seconds) is replay's: the live restore is decided again
        "actions": [{"action": "skip_step", "step": [15, 16], "count": 2}, {"action": "rollback", "step": 17},
                    {"action": "restore", "count": 1}],
        "recorded": [{"action": "skip_step", "count": 2}, {"action": "rollback", "step": 17},
                     {"alert": "TrainingStalled", "source": "embedded"},
                     {"action": "restore", "source": "agent+control", "count": 1},
                     {"action": "restart", "step": 30}]}))
    done = subprocess.run(TRAINGUARD + ["replay", str(hung_run), "--expect", str(expectation)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "alert TrainingStalled" in done.stdout and "agent+control" in done.stdout

    expectation.write_text(yaml.safe_dump({"actions": [{"action": "skip_step", "count": 2}, {"action": "rollback"}],
                                           "recorded": [{"action": "restart", "step": 20}]}))
    code, out, err = here(capfd, "replay", str(hung_run), "--expect", str(expectation))
    assert code == 1
    assert "- recorded_action restart  step 20" in err and "+ recorded_action restore" in err
