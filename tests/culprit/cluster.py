"""Simulated nodes on one machine: one `trainguard train --nnodes MIN:MAX` launcher and one agent per node.

Each node is a node name (TRAINGUARD_NODE, read by the ranks' files, the launcher's cordon check and the
agent), its own torch elastic launcher in the job's c10d rendezvous on loopback, and its own agent with
the embedded stall watchdog, all sharing one run directory, as nodes share it over a network filesystem.

The rendezvous store is torch's own TCPStore, served outside every launcher (``is_host=false`` on each),
as a production job puts its endpoint on a stable host: a node kept out must not take the store of the
job with it. It is served by the process that runs the cluster (the test's, the bench's): a process of
its own would spend a torch import (seconds of CPU) on every test for no other difference.
Also used by bench/bench_culprit.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.e2e.stack import kill_tree, merge
from tests.servers import free_port, spawn, wait_for
from trainguard import tls

ROOT = Path(__file__).resolve().parents[2]
TRAINGUARD = str(Path(sys.executable).with_name("trainguard"))

# A node whose launcher was ended leaves the rendezvous once its keep-alive has lapsed: torch's default
# (every 5 s, dead after 3 missed) holds the survivor's next round 15 s; 1 s x 5 is 5 s, still far above a
# launcher's heartbeat delay on a loaded machine (a thread that only writes to the store). The tests use
# it; bench/bench_culprit.py keeps torch's default, as a job would run.
FAST_KEEP_ALIVE = ("keep_alive_interval=1", "keep_alive_max_attempt=5")

POLICY = {
    "alerts": {"stall_seconds": 6.0, "action_cooldown_seconds": 5.0},
    "restore": {"evidence_seconds": 8.0},
}


@dataclass
class Cluster:
    tmp: Path
    run_dir: Path
    policy_path: Path
    endpoint: str = ""
    processes: list = field(default_factory=list)
    launchers: dict = field(default_factory=dict)
    agents: dict = field(default_factory=dict)
    addresses: dict = field(default_factory=dict)
    rdzv_conf: tuple = ()
    store: object = None

    def start_store(self) -> None:
        """The job's rendezvous store, listening once this returns; closed by `stop` (dropping the last
        reference to a master TCPStore ends its server)."""
        from torch.distributed import TCPStore

        port = free_port()
        self.store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
        self.endpoint = f"127.0.0.1:{port}"

    def wait_store(self) -> None:
        """The store takes connections (it listens once `start_store` returns: a check, no wait)."""
        host, port = self.endpoint.rsplit(":", 1)

        def answers() -> bool:
            with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=5):
                return True
            return False

        wait_for(answers, timeout=60, interval=0.2, message="rendezvous store")

    def start_agent(self, node: str, nvml_scenario: str | None = None) -> None:
        """The node's agent, started (ready once `wait_agent`); with `nvml_scenario`, its gpu collector reads
        the FAKE NVML (tests/fakes)."""
        address = f"127.0.0.1:{free_port()}"
        token = self.tmp / "webhook.token"
        if not token.exists():
            token.write_text("culprit-" + os.urandom(8).hex() + "\n")
            token.chmod(0o600)
        config = {"collectors": {"training": {"interval": 0.5}},
                  "nodelog": {"enabled": True, "interval": 1.0},      # the node's joined log, recorded
                  "webhook": {"token_file": str(token), "embedded": True}}
        env = {**os.environ, "TRAINGUARD_NODE": node, "TRAINGUARD_LOG_JSON": "1"}
        collectors = "training"
        if nvml_scenario:
            config["collectors"]["gpu"] = {"interval": 0.5, "nvml_module": "tests.fakes.fake_nvml", "kmsg": False}
            env.update(TRAINGUARD_FAKE_NVML=nvml_scenario, TRAINGUARD_FAKE_NVML_STEP_S="1",
                       PYTHONPATH=str(ROOT))
            collectors += ",gpu"
        path = self.tmp / f"agent-{node}.yaml"
        path.write_text(yaml.safe_dump(config))
        cmd = [TRAINGUARD, "agent", "--run-dir", str(self.run_dir), "--listen", address, "--node", node,
               "--config", str(path), "--collectors", collectors, "--policy", str(self.policy_path)]
        self.agents[node] = spawn(cmd, url=f"http://{address}", ready_url=f"http://{address}/healthz",
                                  log_path=self.tmp / f"agent-{node}.log", env=env, cwd=ROOT)
        self.addresses[node] = address

    def wait_agent(self, node: str) -> None:
        self.agents[node].wait_ready(timeout=90)

    def launch(self, node: str, *args: str, nnodes: str = "1:2", nproc: int = 1) -> subprocess.Popen:
        log = open(self.tmp / f"launcher-{node}.log", "ab")
        cmd = [TRAINGUARD, "train", "--run-dir", str(self.run_dir), "--policy", str(self.policy_path),
               "--nproc", str(nproc), "--nnodes", nnodes, "--rdzv-endpoint", self.endpoint,
               "--rdzv-id", "culprit", "--rdzv-conf", "is_host=false", "--rdzv-conf", "last_call_timeout=3",
               *[arg for conf in self.rdzv_conf for arg in ("--rdzv-conf", conf)],
               "--max-restarts", "3", *args]
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "TRAINGUARD_NODE": node, "OMP_NUM_THREADS": "1"})
        self.processes.append(process)
        self.launchers[node] = process
        return process

    # ------------------------------------------------------------------------------------ observe
    def incidents(self) -> list[dict]:
        from trainguard import incidents

        return [verdict for _, verdict, _ in incidents.scan(self.run_dir) if verdict is not None]

    def wait_incident(self, timeout: float) -> dict:
        try:
            return wait_for(lambda: (self.incidents() or [None])[0], timeout=timeout, interval=0.5,
                            message="an incident verdict")
        except TimeoutError:
            raise AssertionError(f"no incident within {timeout:.0f}s\n{self.diagnostics()}") from None

    def wait(self, node: str, timeout: float) -> int:
        try:
            return self.launchers[node].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"launcher {node} did not end within {timeout:.0f}s\n{self.diagnostics()}") from None

    def rank_of(self, rank: int) -> dict:
        return json.loads((self.run_dir / "control" / "ranks" / f"rank-{rank}.json").read_text())

    def records(self, name: str) -> list[dict]:
        path = self.run_dir / "tls" / name
        if not path.exists():
            return []
        return [line.record for line in tls.iter_lines(path) if line.record is not None]

    def events(self, name: str, kind: str) -> list[dict]:
        return [r for r in self.records(name) if (r.get("event") or {}).get("type") == kind]

    def diagnostics(self) -> str:
        parts = []
        for path in sorted(self.tmp.glob("*.log")):
            parts.append(f"--- {path.name} (tail) ---\n" + path.read_text(errors="replace")[-3000:])
        return "\n".join(parts)

    def stop(self) -> None:
        for process in self.processes:
            kill_tree(process)
        for server in self.agents.values():
            server.stop()
        self.store = None


@contextlib.contextmanager
def cluster(tmp_path: Path, policy: dict | None = None, nodes=("n1", "n2"), nvml: dict | None = None,
            rdzv_conf: tuple = ()):
    run_dir = tmp_path / "run"
    (run_dir / "tls").mkdir(parents=True)
    policy_path = run_dir / "policy.yaml"
    policy_path.write_text(yaml.safe_dump(merge(POLICY, policy or {})))
    c = Cluster(tmp_path, run_dir, policy_path, rdzv_conf=rdzv_conf)
    try:
        c.start_store()
        c.wait_store()
        for node in nodes:                  # the agents start side by side, then are waited for
            c.start_agent(node, (nvml or {}).get(node))
        for node in nodes:
            c.wait_agent(node)
        yield c
    finally:
        c.stop()


def wait_until(predicate, timeout: float, message: str, c: Cluster):
    try:
        return wait_for(predicate, timeout=timeout, interval=0.25, message=message)
    except TimeoutError:
        raise AssertionError(f"{message} not seen within {timeout:.0f}s\n{c.diagnostics()}") from None


def elapsed(since: float) -> float:
    return time.time() - since
