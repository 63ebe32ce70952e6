"""End to end on one machine: the bundled trainer under torch's elastic launcher, and an agent whose gpu collector
reads the fake NVML (tests/fakes/nvml/, stepping a sample a second).

- degrading: one GPU's corrected ECC errors climb, rows are remapped, a remap waits for a reset; the agent's
  node-risk rule flags the node, the executor signs a drain_at_checkpoint request, every rank saves a verified
  checkpoint of the step it is in and stops (nothing trained past it), and the agent, once that checkpoint
  verifies, cordons the node (signed) and ends its launcher.
- reboot: both GPUs lost, then back with their counters reset and a link at x8 for a moment: nothing drains,
  nothing is cordoned, the run trains on.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.e2e.stack import kill_tree
from tests.servers import free_port, start, wait_for
from trainguard import rundir, tls
from trainguard.actions import DRAIN
from trainguard.agent import evict
from trainguard.node import node_name
from trainguard.runtime.checkpoint import CheckpointManager

ROOT = Path(__file__).resolve().parents[2]
TRAINGUARD = str(Path(sys.executable).with_name("trainguard"))
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def records(path: Path) -> list[dict]:
    return tls.read_records(path) if path.exists() else []


def steps_of(run: Path) -> list[int]:
    return [r["step"] for r in records(run / "tls" / "rank-0.jsonl") if isinstance(r.get("metrics"), dict)
            and "loss" in r["metrics"]]


def start_run(tmp_path: Path, scenario: str):
    """The trainer (stepping), then the agent over the fake NVML `scenario`; returns (run, trainer, agent)."""
    run = tmp_path / "run"
    env = {**os.environ, "TRAINGUARD_CHECKPOINT_KEY": str(tmp_path / "checkpoint.key"), "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "trainer.log", "ab")
    trainer = subprocess.Popen([TRAINGUARD, "train", "--run-dir", str(run), "--steps", "1000000", "--nproc", "1",
                                "--max-restarts", "0", "--checkpoint-every", "1000000",
                                "--checkpoint-every-seconds", "0"],
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    wait_for(lambda: len(steps_of(run)) > 2, timeout=180, interval=0.5, message="the trainer's first steps")
    config = {"interval": 1, "nodelog": {"interval": 1},
              "collectors": {"gpu": {"enabled": True, "nvml_module": "tests.fakes.fake_nvml", "kmsg": False,
                                     "reinit_backoff_seconds": 1, "interval": 1}},
              "webhook": {"token_file": str(tmp_path / "webhook.token")}}
    (tmp_path / "agent.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "webhook.token").write_text("e2e-" + os.urandom(16).hex())
    (tmp_path / "webhook.token").chmod(0o600)
    port = free_port()
    agent = start([TRAINGUARD, "agent", "--run-dir", str(run), "--listen", f"127.0.0.1:{port}", "--config",
                   str(tmp_path / "agent.yaml"), "--collectors", "gpu"],
                  url=f"http://127.0.0.1:{port}", ready_url=f"http://127.0.0.1:{port}/healthz",
                  log_path=tmp_path / "agent.log", cwd=ROOT, timeout=120,
                  env={**env, "TRAINGUARD_FAKE_NVML": scenario, "TRAINGUARD_FAKE_NVML_STEP_S": "1",
                       "PYTHONPATH": str(ROOT)})
    return run, trainer, agent


def diagnostics(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(tmp_path.glob("*.log")))


def test_a_degrading_node_is_drained_at_a_checkpoint_with_no_work_lost_past_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_KEY", str(tmp_path / "checkpoint.key"))     # the run's key, here too
    run, trainer, agent = start_run(tmp_path, "degrading")
    try:
        try:
            code = trainer.wait(180)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the run was not drained\n{diagnostics(tmp_path)}") from None
        assert code != 0, diagnostics(tmp_path)             # drained is not done: the launchers re-form
        wait_for(lambda: node_name() in evict.cordoned(run), timeout=30, interval=0.25,
                 message=f"the node's cordon\n{diagnostics(tmp_path)}")
    finally:
        kill_tree(trainer)
        agent.stop()
    [drained] = [r["event"] for r in records(run / "tls" / "rank-0.jsonl")
                 if r.get("event", {}).get("type") == "action" and r["event"].get("action") == DRAIN]
    step = drained["checkpoint_step"]
    assert drained["checkpoint_verified"] is True
    assert steps_of(run)[-1] == step                           # nothing trained past the checkpoint
    assert CheckpointManager(run).latest_verified().step == step
    cordon = evict.cordoned(run)[node_name()]
    assert cordon["reason"] == "node_risk"                     # signed with the run's key: honoured
    requests = [line for line in (rundir.control_dir(run) / "actions.jsonl").read_text().splitlines()
                if DRAIN in line]
    assert len(requests) == 1                                  # one flag, one request


def test_a_reboot_transient_drains_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_KEY", str(tmp_path / "checkpoint.key"))
    run, trainer, agent = start_run(tmp_path, "reboot")
    try:
        began = len(steps_of(run))
        time.sleep(20)                                         # the scenario's 14 samples, and some
        assert trainer.poll() is None, diagnostics(tmp_path)   # still training
        assert len(steps_of(run)) > began
    finally:
        kill_tree(trainer)
        agent.stop()
    control = rundir.control_dir(run) / "actions.jsonl"
    assert not control.exists() or DRAIN not in control.read_text()
    assert not evict.cordoned(run)
    assert "node at risk" not in (tmp_path / "agent.log").read_text()
