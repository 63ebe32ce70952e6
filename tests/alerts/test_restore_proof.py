"""A rank must prove it is one before the agent ends it (agent/restore.py `prove_rank`).

Anyone who can write RUN/control/ranks can name any pid there. The agent must end only processes the
kernel shows to be workers of this run under an identifiable launcher, with the registered start time
and uid; everything else is refused with a reason, logged and counted, never signalled.
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

from tests.alerts.helpers import read_jsonl
from tests.alerts.ranks import STANDIN, Ranks, alive, rewrite
from trainguard import actions
from trainguard.demo import cli as demo
from trainguard.agent import restore
from trainguard.agent.executor import Executor
from trainguard.decide.ledger import Ledger, Notice

HOST = socket.gethostname()


@pytest.fixture
def ranks():
    launched = Ranks()
    yield launched
    launched.stop()


@pytest.fixture
def victim():
    """An innocent process of the agent's own uid: what an attacker would like the agent to kill."""
    process = subprocess.Popen(["sleep", "900"])
    yield process
    process.kill()
    process.wait()


def register(run_dir, pid, **fields):
    """A rank file naming `pid`, with its exact start time (the attacker can read it too)."""
    directory = run_dir / "control" / "ranks"
    directory.mkdir(parents=True, exist_ok=True)
    created = psutil.Process(pid).create_time()
    info = {"rank": 0, "pid": pid, "host": HOST, "started_at": created + 0.5, "create_time": created,
            "uid": os.getuid(), "restarts_left": 3, **fields}
    (directory / "rank-0.json").write_text(json.dumps(info))
    return info


def restore_now(run_dir, **kwargs):
    executor = Executor(run_dir, "n1", Ledger(), **kwargs)
    executor.submit([Notice("TrainingStalled", "firing", actions.RESTORE, "s@1", starts_at=time.time() + 5)])
    [action] = [r["event"] for r in read_jsonl(run_dir / "tls" / "node-n1-actions.jsonl")
                if r["event"]["type"] == "action"]
    return executor, action


def refused_counts(executor):
    family = next(f for f in executor.families() if f.name == "trainguard_restore_refused")
    return {s.labels["reason"]: s.value for s in family.samples if s.value}


def test_the_issues_sleep_900_through_the_cli_agent_is_refused_counted_and_never_killed(tmp_path, victim):
    """A forged restore target, reproduced: a rank file naming `sleep 900`, a TLS file gone quiet, the agent."""
    run = tmp_path / "R"
    register(run, victim.pid)
    time.sleep(1.0)                  # the repro's sleep had been running a while: its record comes after
    (run / "tls").mkdir()
    # the step record is dated after the registration (the watchdog reads the record's time, decide/stall.py)
    (run / "tls" / "rank-0.jsonl").write_text('{"schema":"tls/1","timestamp":%.3f,"rank":0,'
                                             '"step":1,"metrics":{"loss":1,"grad_norm":1}}\n' % time.time())
    (run / "policy.yaml").write_text("alerts: {stall_seconds: 1}\n")
    port = demo.free_port()
    agent = demo.start_agent(run, port, "--policy", str(run / "policy.yaml"))   # its own: RUN/'s is not signed
    try:
        deadline = time.time() + 60
        log = run / "tls" / f"node-{HOST}-actions.jsonl"
        while not (log.exists() and any(r["event"]["type"] == "action" for r in read_jsonl(log))):
            assert time.time() < deadline and agent.poll() is None, "no restore decided"
            time.sleep(0.2)
        [action] = [r["event"] for r in read_jsonl(log) if r["event"]["type"] == "action"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            metrics = response.read().decode()
    finally:
        demo.stop(agent)
    assert action["ended"] == [] and [r["reason"] for r in action["refused"]] == ["not_a_worker"]
    assert 'trainguard_restore_refused_total{reason="not_a_worker"} 1.0' in metrics
    assert "restore refused" in (run / "agent.log").read_text()
    assert victim.poll() is None


def test_a_process_running_code_from_the_command_line_is_no_worker(tmp_path):
    """Words of the bundled entry point anywhere but the program's place prove nothing."""
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-m", restore.BUNDLED_ENTRY_POINT,
                              "--run-dir", str(tmp_path)])
    try:
        time.sleep(0.3)
        register(tmp_path, decoy.pid)
        executor, action = restore_now(tmp_path)
        assert [r["reason"] for r in action["refused"]] == ["not_a_worker"] and decoy.poll() is None
        assert refused_counts(executor) == {"not_a_worker": 1}
    finally:
        decoy.kill()
        decoy.wait()


def test_another_uid_is_refused(tmp_path, victim):
    if os.getuid() != 0:
        pytest.skip("needs root to start a process under another uid")
    other = subprocess.Popen(["sleep", "60"], user=65534)
    try:
        register(tmp_path, other.pid, uid=0)
        _, action = restore_now(tmp_path)
        assert [r["reason"] for r in action["refused"]] == ["wrong_uid"] and other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_a_rank_file_without_a_start_time_is_refused(tmp_path, victim):
    info = register(tmp_path, victim.pid)
    del info["create_time"]
    (tmp_path / "control" / "ranks" / "rank-0.json").write_text(json.dumps(info))
    _, action = restore_now(tmp_path)
    assert [r["reason"] for r in action["refused"]] == ["no_start_time"] and victim.poll() is None


def test_a_worker_of_another_run_is_refused(tmp_path, ranks):
    """A real rank of run A, its file copied into run B: B's agent must not end A's rank."""
    [rank] = ranks.start(tmp_path / "A")
    (tmp_path / "B" / "control" / "ranks").mkdir(parents=True)
    (tmp_path / "B" / "control" / "ranks" / "rank-0.json").write_text(json.dumps(rank))
    _, action = restore_now(tmp_path / "B", entry_points=(STANDIN,))
    assert [r["reason"] for r in action["refused"]] == ["other_run"] and alive(rank["pid"])


def test_an_unregistered_entry_point_is_refused_even_under_torchrun(tmp_path, ranks):
    [rank] = ranks.start(tmp_path)
    _, action = restore_now(tmp_path)                      # the stand-in script is not registered here
    assert [r["reason"] for r in action["refused"]] == ["not_a_worker"] and alive(rank["pid"])


def test_a_worker_without_a_launcher_is_refused(tmp_path):
    """Nothing would start it again: ending it would only end the run."""
    lone = subprocess.Popen([sys.executable, STANDIN, "--run-dir", str(tmp_path)], env={**os.environ, "RANK": "0"})
    try:
        deadline = time.time() + 30
        while not (tmp_path / "control" / "ranks" / "rank-0.json").exists():
            assert time.time() < deadline
            time.sleep(0.05)
        rewrite(tmp_path, 0, restarts_left=3)
        _, action = restore_now(tmp_path, entry_points=(STANDIN,))
        assert [r["reason"] for r in action["refused"]] == ["no_launcher"] and lone.poll() is None
    finally:
        lone.kill()
        lone.wait()


def test_a_registered_launcher_that_is_not_the_ranks_is_refused(tmp_path, ranks):
    [rank] = ranks.start(tmp_path)
    rewrite(tmp_path, 0, launcher_pid=1)
    _, action = restore_now(tmp_path, entry_points=(STANDIN,))
    assert [r["reason"] for r in action["refused"]] == ["launcher_mismatch"] and alive(rank["pid"])


def test_a_proven_rank_whose_launcher_has_no_restarts_left_is_not_ended_and_a_human_is_paged(tmp_path, ranks):
    [rank] = ranks.start(tmp_path, max_restarts=0)
    assert rank["restarts_left"] == 0
    executor, action = restore_now(tmp_path, entry_points=(STANDIN,))
    assert action["outcome"] == "paged" and action["ended"] == [] and action["paged"]["ranks"] == [0]
    assert refused_counts(executor) == {"no_restarts_left": 1}
    time.sleep(0.3)
    assert alive(rank["pid"])


def test_start_times_agree_to_the_tick():
    created = psutil.Process().create_time()
    assert restore.same_tick(created, created + restore.TICK) and not restore.same_tick(created, created + 2 * restore.TICK + 0.001)


def test_launchers_and_entry_points_are_read_from_the_programs_place():
    bundled = (restore.BUNDLED_ENTRY_POINT,)
    assert restore.worker_entry_point(["/usr/bin/python3", "-u", "-m", "trainguard.trainer.train", "--run-dir", "R"],
                                      bundled) == restore.BUNDLED_ENTRY_POINT
    assert restore.worker_entry_point(["sleep", "900", "-m", "trainguard.trainer.train"], bundled) is None
    launchers = restore.BUNDLED_LAUNCHERS
    assert restore.is_launcher(["python", "-m", "trainguard.cli", "train", "--run-dir", "R"], launchers)
    assert restore.is_launcher(["/venv/bin/python", "/venv/bin/trainguard", "train", "--nproc", "2"], launchers)
    assert restore.is_launcher(["/venv/bin/python", "/venv/bin/torchrun", "--standalone", "x.py"], launchers)
    assert not restore.is_launcher(["python", "-m", "trainguard.cli", "agent", "--run-dir", "R"], launchers)
    assert not restore.is_launcher(["bash", "-c", "torchrun x.py"], launchers)
