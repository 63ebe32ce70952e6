"""The agent killed (SIGKILL) and restarted while a real 2-rank training runs (torchrun, gloo):
training is unaffected, and the agent's view loses and doubles no step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.servers import free_port, http_get, wait_for
from trainguard import tls

pytestmark = pytest.mark.slow
# The agent is killed at step 20 and at step 80: each restart comes while the 2 ranks still have many
# steps to train (the second leaves 120 of 200), so it resumes from its saved offsets mid-run.
STEPS, KILL_AT = 200, (20, 80)


def agent_steps(url: str) -> dict[str, float] | None:
    """steps_total per rank from a running agent, or None while it is not answering."""
    try:
        status, _, body = http_get(url + "/metrics", timeout=5)
    except OSError:
        return None
    if status != 200:
        return None
    return {s.labels["rank"]: s.value for f in text_string_to_metric_families(body.decode())
            for s in f.samples if s.name == "trainguard_training_steps_total"}


def start_agent(run_dir: Path, port: int, log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "trainguard.cli", "agent", "--create", "--run-dir", str(run_dir),
                                 "--listen", f"127.0.0.1:{port}", "--collectors", "training,host",
                                 "--interval", "0.2"], stdout=out, stderr=subprocess.STDOUT)


def step_records(path: Path) -> list[int]:
    return [r["step"] for r in tls.read_records(path) if r.get("metrics") and r.get("step") is not None
            and not r.get("event")]


def test_agent_killed_and_restarted_during_training(tmp_path):
    run_dir = tmp_path / "run"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    agent_log, train_log = tmp_path / "agent.log", tmp_path / "train.log"
    with open(train_log, "wb") as out:
        trainer = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "train", "--nproc", "2", "--run-dir",
                                    str(run_dir), "--steps", str(STEPS), "--checkpoint-every", "100"],
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    agent = start_agent(run_dir, port, agent_log)
    try:
        # Kill the agent twice mid-run, each time once it has counted some steps, and start it again.
        for kill_at in KILL_AT:
            wait_for(lambda: (agent_steps(url) or {}).get("0", 0) >= kill_at, 120,
                     message=f"agent counting past step {kill_at}")
            agent.send_signal(signal.SIGKILL)
            agent.wait(10)
            agent = start_agent(run_dir, port, agent_log)
        assert trainer.wait(240) == 0, train_log.read_text()[-3000:]
        expected = {str(rank): len(step_records(run_dir / "tls" / f"rank-{rank}.jsonl")) for rank in (0, 1)}
        assert expected == {"0": STEPS, "1": STEPS}
        final = wait_for(lambda: agent_steps(url) == expected and agent_steps(url), 60,
                         message=f"agent caught up to {expected} (has {agent_steps(url)})")
        assert final == expected
        assert "resumed from saved offsets" in agent_log.read_text()
    finally:
        for process in (agent, trainer):
            if process.poll() is None:
                if process is trainer:
                    os.killpg(process.pid, signal.SIGKILL)
                else:
                    process.kill()
                process.wait()
