"""The full stack on one machine, for `trainguard demo --with-prometheus`.

Real Prometheus and Alertmanager (Debian packages `prometheus`, `prometheus-alertmanager`) on loopback,
with the generated rules and route, the agent with its webhook, and the trainer under torch's elastic
launcher. A hang is injected: the trainer stops stepping, Prometheus fires `TrainingStalled`,
Alertmanager posts it to the agent's webhook, the agent's `restore` ends the hung worker, the launcher
starts it again and it resumes from the latest verified checkpoint. The events name the alert.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from trainguard import event_types, rundir
from trainguard.demo import cli as demo

# Short intervals so the story plays out in a minute or two; a real run keeps the defaults.
DEMO_POLICY = {"alerts": {"for_short": "1s", "for_long": "5s", "stall_seconds": 10.0}}
FAULTS = ("nan@40", "hang@120")
BINARIES = {"prometheus": ("prometheus",), "alertmanager": ("prometheus-alertmanager", "alertmanager")}


class MissingBinary(RuntimeError):
    pass


def find_binary(role: str) -> str:
    for name in BINARIES[role]:
        path = shutil.which(name)
        if path:
            return path
    raise MissingBinary(f"{role} is not installed (looked for {', '.join(BINARIES[role])}); install the Debian "
                        "packages prometheus and prometheus-alertmanager, or run scripts/setup --servers")


@dataclass
class Service:
    name: str
    url: str
    process: subprocess.Popen

    def stop(self) -> None:
        demo.stop(self.process)


def start_service(name: str, cmd: list[str], url: str, ready_path: str, log_path: Path,
                  timeout: float = 60.0) -> Service:
    with open(log_path, "ab") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    service = Service(name, url, process)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(url + ready_path, timeout=1):
                return service
        except OSError:
            time.sleep(0.2)
    service.stop()
    raise RuntimeError(f"{name} was not ready within {timeout:.0f}s; see {log_path}")


def prometheus_config(targets: list[str], rule_files: list[Path], alertmanager: str,
                      interval: str = "1s") -> dict:
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval, "scrape_timeout": interval},
        "rule_files": [str(path) for path in rule_files],
        "scrape_configs": [{"job_name": "trainguard", "static_configs": [{"targets": targets}]}],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [alertmanager.split("://", 1)[-1]]}]}]},
    }


def start_prometheus(home: Path, targets: list[str], rule_files: list[Path], alertmanager: str) -> Service:
    home.mkdir(parents=True, exist_ok=True)
    (home / "prometheus.yml").write_text(yaml.safe_dump(prometheus_config(targets, rule_files, alertmanager)))
    port = demo.free_port()
    cmd = [find_binary("prometheus"), f"--config.file={home / 'prometheus.yml'}",
           f"--storage.tsdb.path={home / 'data'}", f"--web.listen-address=127.0.0.1:{port}"]
    return start_service("prometheus", cmd, f"http://127.0.0.1:{port}", "/-/ready", home / "prometheus.log")


def start_alertmanager(home: Path, config_text: str) -> Service:
    home.mkdir(parents=True, exist_ok=True)
    (home / "alertmanager.yml").write_text(config_text)
    port = demo.free_port()
    cmd = [find_binary("alertmanager"), f"--config.file={home / 'alertmanager.yml'}",
           f"--storage.path={home / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
           "--cluster.listen-address="]
    return start_service("alertmanager", cmd, f"http://127.0.0.1:{port}", "/-/ready", home / "alertmanager.log")


def run_full_stack_demo(run_dir: Path, steps: int) -> int:
    from trainguard.alerts import alertmanager, rules
    from trainguard.policy import load as load_policy

    try:
        for role in BINARIES:
            find_binary(role)
    except MissingBinary as exc:
        demo.say(str(exc))
        return 2
    policy_path = rundir.policy_path(run_dir)   # the trainer signs it there (trainguard/runpolicy.py)
    policy_path.write_text(yaml.safe_dump(DEMO_POLICY))
    token_file = rundir.webhook_token_path(run_dir)
    token_file.parent.mkdir(parents=True, exist_ok=True)
    if not token_file.exists():
        token_file.write_text(os.urandom(24).hex() + "\n")
    token_file.chmod(0o600)
    port = demo.free_port()
    agent_address = f"127.0.0.1:{port}"
    services: list[Service] = []
    agent = demo.start_agent(run_dir, port, "--policy", str(policy_path))   # given, not read unsigned from RUN/
    try:
        servers = run_dir / "servers"
        rule_files = rules.write(servers / "rules", load_policy(policy_path))
        timing = alertmanager.Timing(group_wait="1s", group_interval="1s", repeat_interval="1h")
        am = start_alertmanager(servers / "alertmanager",
                                alertmanager.render([agent_address], str(token_file), timing=timing))
        services.append(am)
        services.append(start_prometheus(servers / "prometheus", [agent_address], rule_files, am.url))
        demo.say(f"agent             http://{agent_address}/metrics  (webhook /api/v1/alerts, token {token_file})")
        demo.say(f"prometheus        {services[1].url}/alerts")
        demo.say(f"alertmanager      {am.url}")
        demo.say(f"training          {steps} steps under torch's elastic launcher; faults: {', '.join(FAULTS)}")
        demo.say("                  the hang should fire TrainingStalled -> webhook -> restore -> resume")
        train = demo.trainguard_command(
            "train", "--run-dir", str(run_dir), "--steps", str(steps), "--checkpoint-every", "20",
            "--nproc", "1", "--max-restarts", "2", "--policy", str(policy_path),
            *sum((["--inject", fault] for fault in FAULTS), []))
        code = subprocess.call(train, env={**os.environ, "TRAINGUARD_LOG_JSON": "0"})
        time.sleep(1.5)
    finally:
        for service in reversed(services):
            service.stop()
        demo.stop(agent)
    print_alert_actions(run_dir)
    return demo.finish(run_dir, code)


def print_alert_actions(run_dir: Path) -> None:
    """The agent's side of the story: which alerts arrived and what it did."""
    from trainguard import tls

    for path in sorted(rundir.tls_dir(run_dir).glob("node-*-actions.jsonl")):
        for line in tls.iter_lines(path):
            event = (line.record or {}).get("event") or {}
            if event.get("type") in (event_types.ALERT, event_types.ACTION):
                demo.say(f"  agent  {event['type']:<7} {event.get('alertname', '')} "
                         f"{event.get('action') or event.get('status') or ''} {event.get('outcome') or ''}".rstrip())
