"""The whole stack on loopback for end-to-end tests: trainer, agents, Prometheus, Alertmanager.

Everything is real and started here with short intervals (scrape 1s, evaluation 1s, group_wait 1s, `for`
from the test's policy), in temporary directories, and ended at teardown whatever happens. A missing
server binary skips the test, and fails it under CI=true (tests/servers.py).

Fault-to-action times are measured from the run's own records: the trainer's `fault_injected` event (or
another start mark) to the agent's `action` event, and to the trainer's acting on it. With
TRAINGUARD_TIMINGS=FILE set, each scenario appends its times there as a JSON line
(bench/fault_to_action.py renders them for docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import yaml

from tests.servers import free_port, http_get, spawn, start_alertmanager, start_prometheus, wait_for
from trainguard import tls
from trainguard.alerts import alertmanager, rules
from trainguard.policy import load as load_policy

ROOT = Path(__file__).resolve().parents[2]
TRAINGUARD = str(Path(sys.executable).with_name("trainguard"))
FAST_TIMING = alertmanager.Timing(group_wait="1s", group_interval="1s", repeat_interval="1h")

# The policy every scenario starts from: short `for`, small cooldowns, and a guard that leaves loss
# spikes and gradient explosions to the alerts (the alert path is what these tests prove).
BASE_POLICY = {
    "alerts": {"for_short": "1s", "for_long": "5s", "stall_seconds": 8.0, "action_cooldown_seconds": 20.0},
    # a spike rule that needs a million steps needs a window that holds them (policy validation)
    "guard": {"spike_min_steps": 1_000_000, "spike_window": 1_000_000, "grad_min_steps": 1_000_000,
              "grad_climb_min_steps": 1_000_000, "grad_climb_window": 1_000_000,
              # while the band warms up (here: for ever), the warm-up spike rule would take the spike first
              "warmup_spike_factor": 1e9},
}


def merge(base: dict, extra: dict) -> dict:
    out = {key: dict(value) if isinstance(value, dict) else value for key, value in base.items()}
    for key, value in extra.items():
        out[key] = {**out.get(key, {}), **value} if isinstance(value, dict) else value
    return out

# Slow data for a few steps at a time (0.5 s per batch for 5 steps): paces the run so the loss baseline
# has its samples at 1 s scrapes before the burst of spikes, keeps the burst on screen for a few scrapes,
# and leaves the alert time to act before the last step.
PACE = [f"--inject=slowio@{step}" for step in (1, 6, 11, 16, 25, 33, 38, 43)]
SPIKES = [f"--inject=spike@{step}" for step in range(25, 33)]


@dataclass
class Agent:
    node: str
    address: str
    server: object
    log_path: Path


@dataclass
class Stack:
    tmp: Path
    run_dir: Path
    policy_path: Path
    token_file: Path
    agents: list[Agent] = field(default_factory=list)
    prometheus: object = None
    alertmanager: object = None
    trainers: list[subprocess.Popen] = field(default_factory=list)

    # ------------------------------------------------------------------------------------ start
    def start_agent(self, node: str, embedded: bool = False, wait: bool = True) -> Agent:
        """The node's agent; `wait=False` leaves it starting (start_servers waits for every agent)."""
        port = free_port()
        address = f"127.0.0.1:{port}"
        config = {
            "collectors": {"training": {"interval": 0.5}, "host": {"interval": 1}},
            "nodelog": {"enabled": False},
            "webhook": {"token_file": str(self.token_file), "embedded": embedded, "max_body_bytes": 65536},
        }
        config_path = self.tmp / f"agent-{node}.yaml"
        config_path.write_text(yaml.safe_dump(config))
        log_path = self.tmp / f"agent-{node}.log"
        cmd = [TRAINGUARD, "agent", "--run-dir", str(self.run_dir), "--listen", address, "--node", node,
               "--config", str(config_path), "--collectors", "training,host", "--policy", str(self.policy_path)]
        server = spawn(cmd, url=f"http://{address}", ready_url=f"http://{address}/healthz", log_path=log_path,
                       env={**os.environ, "TRAINGUARD_LOG_JSON": "1"})
        if wait:
            server.wait_ready()
        agent = Agent(node, address, server, log_path)
        self.agents.append(agent)
        return agent

    def start_servers(self) -> None:
        """Alertmanager routing to the agents (the first is primary), Prometheus with the policy's rules;
        returns once they and every agent are ready (their start-ups overlap)."""
        policy = load_policy(self.policy_path)
        rule_dir = self.tmp / "rules"
        rule_files = rules.write(rule_dir, policy)
        config = alertmanager.render([a.address for a in self.agents], str(self.token_file), timing=FAST_TIMING)
        self.alertmanager = start_alertmanager(self.tmp, config, wait=False)
        self.prometheus = start_prometheus(self.tmp, [a.address for a in self.agents], rule_files=rule_files,
                                           alertmanager_url=self.alertmanager, wait=False)
        for server in (self.alertmanager, self.prometheus):
            server.wait_ready(60)
        for agent in self.agents:
            agent.server.wait_ready()

    def train(self, *args: str, name: str = "trainer", env: dict | None = None) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "ab")
        process = subprocess.Popen([TRAINGUARD, "train", "--run-dir", str(self.run_dir), "--policy",
                                    str(self.policy_path), *args], stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, env={**os.environ, **(env or {})})
        self.trainers.append(process)
        return process

    def torchrun_node(self, node_rank: int, nnodes: int, endpoint: str, *args: str,
                      max_restarts: int = 0) -> subprocess.Popen:
        """One simulated node of a multi-node run: its own torchrun, joining a c10d rendezvous on loopback."""
        log = open(self.tmp / f"node{node_rank}.log", "ab")
        cmd = [str(Path(sys.executable).with_name("torchrun")), f"--nnodes={nnodes}", "--nproc-per-node=1",
               f"--node-rank={node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
               "--rdzv-id=trainguard-e2e", f"--max-restarts={max_restarts}", "--monitor-interval=0.5",
               "-m", "trainguard.trainer.train", "--run-dir", str(self.run_dir), "--policy",
               str(self.policy_path), *args]
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.trainers.append(process)
        return process

    # ------------------------------------------------------------------------------------ observe
    def rank_events(self, rank: int = 0) -> list[dict]:
        return [r for r in read_records(self.run_dir / "tls" / f"rank-{rank}.jsonl") if r.get("event")]

    def agent_events(self, node: str) -> list[dict]:
        return read_records(self.run_dir / "tls" / f"node-{node}-actions.jsonl")

    def wait_for_event(self, source, predicate, timeout: float, message: str) -> dict:
        def found():
            return next((r for r in source() if predicate(r)), None)
        try:
            return wait_for(found, timeout=timeout, interval=0.25, message=message)
        except TimeoutError:
            raise AssertionError(f"{message} not seen within {timeout:.0f}s\n{self.diagnostics()}") from None

    def wait_trainer(self, process: subprocess.Popen, timeout: float) -> int:
        try:
            return process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the trainer did not finish within {timeout:.0f}s\n{self.diagnostics()}") from None

    def firing_alerts(self) -> list[str]:
        status, _, body = http_get(f"{self.prometheus}/api/v1/alerts")
        return sorted(a["labels"]["alertname"] for a in json.loads(body)["data"]["alerts"] if a["state"] == "firing")

    def diagnostics(self) -> str:
        parts = []
        for path in sorted(self.tmp.glob("*.log")) + sorted(self.tmp.glob("*/*.log")):
            parts.append(f"--- {path.name} (tail) ---\n" + path.read_text(errors="replace")[-2500:])
        for path in sorted((self.run_dir / "tls").glob("node-*-actions.jsonl")):
            parts.append(f"--- {path.name} ---\n" + path.read_text(errors="replace")[-2500:])
        with contextlib.suppress(Exception):
            parts.append(f"--- Prometheus firing: {self.firing_alerts()}")
        return "\n".join(parts)

    def stop(self) -> None:
        for process in self.trainers:
            kill_tree(process)
        for server in (self.prometheus, self.alertmanager, *(a.server for a in self.agents)):
            if server is not None:
                server.stop()


def kill_tree(process: subprocess.Popen) -> None:
    """End a launcher and its workers: they run in sessions of their own, so the whole tree, not the group."""
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(process.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [line.record for line in tls.iter_lines(path) if line.record is not None]


@contextlib.contextmanager
def stack(tmp_path: Path, policy: dict | None = None):
    run_dir = tmp_path / "run"
    (run_dir / "tls").mkdir(parents=True)
    policy_path = run_dir / "policy.yaml"      # given to the agent and the trainer (the trainer signs it there)
    policy_path.write_text(yaml.safe_dump(merge(BASE_POLICY, policy or {})))
    token_file = tmp_path / "webhook.token"
    token_file.write_text("e2e-" + os.urandom(16).hex() + "\n")
    token_file.chmod(0o600)
    s = Stack(tmp_path, run_dir, policy_path, token_file)
    try:
        yield s
    finally:
        s.stop()


def post(url: str, body: bytes, headers: dict) -> int:
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def record_timing(scenario: str, **seconds: float) -> None:
    """Append a scenario's fault-to-action times to $TRAINGUARD_TIMINGS (when set)."""
    target = os.environ.get("TRAINGUARD_TIMINGS")
    if not target:
        return
    with open(target, "a") as handle:
        handle.write(json.dumps({"scenario": scenario, **{k: round(v, 2) for k, v in seconds.items()}}) + "\n")
