"""A restore must never turn a recoverable hang into a dead run.

`trainguard train --nproc 2` with default flags gives its launcher room for the agent's restores, so a
hung run next to `trainguard agent` is restored and completes; launched with `--max-restarts 0`, its ranks
register `restarts_left: 0`, and the agent does not end them: it pages a human, in its log, its metrics
and `trainguard status`. Real trainer under torch's elastic launcher (gloo), real agent process. The
restored run is the session's run with a hang (the `hung_run` fixture, tests/hung_run.py), launched with
default flags.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.alerts.helpers import read_jsonl
from tests.hung_run import STEPS
from tests.trainer.helpers import events, step_records
from trainguard.demo import cli as demo

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def start(run, *flags):
    run.mkdir(parents=True)
    # the restart path (ending ranks) is what needs a restart left; in_process would end none
    (run / "policy.yaml").write_text("alerts: {stall_seconds: 4}\nrecovery: {mode: restart}\n")
    port = demo.free_port()
    agent = demo.start_agent(run, port, "--policy", str(run / "policy.yaml"))   # its own, as the docs say
    command = [sys.executable, "-m", "trainguard.cli", "train", "--run-dir", str(run), "--device", "cpu",
               "--steps", "12", "--checkpoint-every", "4", "--nproc", "2", "--inject", "hang@6",
               "--policy", str(run / "policy.yaml"), *flags]
    trainer = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return agent, port, trainer


def agent_actions(run):
    return [r["event"] for path in (run / "tls").glob("node-*-actions.jsonl")
            for r in read_jsonl(path) if r["event"]["type"] == "action"]


def test_a_hung_run_with_default_flags_is_restored_by_the_agent_and_completes(hung_run):
    # the session's run with a hang (tests/hung_run.py): `trainguard train --nproc 2` without --max-restarts
    run = hung_run
    [restore] = agent_actions(run)
    assert restore["outcome"] == "issued" and sorted(e["rank"] for e in restore["ended"]) == [0, 1]
    assert restore["refused"] == []
    starts = events(run, "run_start")
    assert [(s["restart_count"], s["resumed_from"]) for s in starts] == [(0, None), (1, 30)]   # hung in step 40
    assert step_records(run)[-1]["step"] == STEPS
    registration = json.loads((run / "control" / "ranks" / "rank-0.json").read_text())
    assert registration["max_restarts"] == 3 and registration["restarts_left"] == 2


def test_a_hung_run_without_restarts_left_is_not_killed_and_a_human_is_paged(tmp_path):
    run = tmp_path / "run"
    agent, port, trainer = start(run, "--max-restarts", "0")
    try:
        deadline = time.time() + 240
        while not agent_actions(run):
            assert time.time() < deadline and trainer.poll() is None, "no restore decided"
            time.sleep(0.5)
        time.sleep(2.0)
        assert trainer.poll() is None                       # hung, still alive: not killed
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            metrics = response.read().decode()
        status = subprocess.run([sys.executable, "-m", "trainguard.cli", "status", str(run)],
                                capture_output=True, text=True, timeout=60).stdout
    finally:
        trainer.kill()
        trainer.wait()
        demo.stop(agent)
    [paged] = agent_actions(run)
    assert paged["outcome"] == "paged" and paged["ended"] == [] and sorted(paged["paged"]["ranks"]) == [0, 1]
    assert 'trainguard_restore_refused_total{reason="no_restarts_left"} 1.0' in metrics
    assert "the launcher has no restarts left" in (run / "agent.log").read_text()
    assert "restore NOT done, a human is paged: no_restarts_left" in status
