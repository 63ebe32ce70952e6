"""`trainguard agent` beside a real run in a test: started on a free loopback port, stopped at the end."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

TRAINGUARD = [sys.executable, "-m", "trainguard.cli"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_agent(run_dir: Path, config: Path) -> tuple[subprocess.Popen, int]:
    """The agent on RUN, its log in RUN/agent.log; waits until /healthz answers."""
    port = free_port()
    with open(run_dir / "agent.log", "wb") as log:
        agent = subprocess.Popen(TRAINGUARD + ["agent", "--run-dir", str(run_dir), "--listen", f"127.0.0.1:{port}",
                                               "--config", str(config)], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and agent.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
                return agent, port
        except OSError:
            time.sleep(0.2)
    stop(agent)
    raise AssertionError(f"the agent did not start: {(run_dir / 'agent.log').read_text()[-2000:]}")


def stop(agent: subprocess.Popen) -> None:
    if agent.poll() is None:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(15)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
