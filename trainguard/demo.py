"""`trainguard demo`: the whole product on one machine, no servers needed.

It trains the tiny model (CPU, or GPU when present) with the agent beside it, injects faults the guard
must handle (a NaN step, then a burst of loss spikes that forces a rollback to the last stable
checkpoint), writes `report.html` and prints where everything is. With `--with-prometheus` it also runs
Prometheus and Alertmanager with the generated rules and route, so an alert fires, reaches the agent's
webhook and acts on the run.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from trainguard import rundir, safe_read
from trainguard import actions
from trainguard import tls

STEPS = 240
FAULTS = ("nan@40", "spike@150", "spike@151", "spike@152")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", type=Path, help="where to put the run (default: ./runs/demo-<time>)")
    parser.add_argument("--with-prometheus", action="store_true",
                        help="also run Prometheus and Alertmanager (Debian packages) with the generated rules")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"training steps (default {STEPS})")


def run(args: argparse.Namespace) -> int:
    run_dir = (args.run_dir or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    if args.with_prometheus:
        from trainguard.stack import run_full_stack_demo

        return run_full_stack_demo(run_dir, args.steps)
    return run_local_demo(run_dir, args.steps)


def trainguard_command(*words: str) -> list[str]:
    return [sys.executable, "-m", "trainguard.cli", *words]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# The demo run lasts a minute, so the agent samples and joins its node record every second or two.
DEMO_AGENT_CONFIG = {
    "nodelog": {"interval": 2},
    "collectors": {"training": {"interval": 1}, "host": {"interval": 1}, "io": {"interval": 2}},
}


def start_agent(run_dir: Path, port: int, *extra: str) -> subprocess.Popen:
    """The sidecar, waited for until /healthz answers. If it cannot start, the run goes on without it."""
    import urllib.request

    import yaml

    log_path = run_dir / "agent.log"
    config_path = rundir.agent_dir(run_dir) / "demo-agent.yaml"
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(yaml.safe_dump(DEMO_AGENT_CONFIG))
    with open(log_path, "ab") as log:
        agent = subprocess.Popen(trainguard_command("agent", "--run-dir", str(run_dir), "--listen",
                                                    f"127.0.0.1:{port}", "--config", str(config_path), *extra),
                                 stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and agent.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
                return agent
        except OSError:
            time.sleep(0.2)
    tail = safe_read.read_text(log_path, safe_read.LEDGER_BYTES, "agent log", errors="replace")[-1500:]
    say(f"the agent did not start (training goes on without it); its log {log_path} ends:\n{tail}")
    return agent


def stop(process: subprocess.Popen, timeout: float = 10.0) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run_local_demo(run_dir: Path, steps: int) -> int:
    port = free_port()
    say(f"run directory     {run_dir}")
    agent = start_agent(run_dir, port)
    say(f"agent             http://127.0.0.1:{port}/metrics  (log: {run_dir / 'agent.log'})")
    train = trainguard_command("train", "--run-dir", str(run_dir), "--steps", str(steps),
                               "--checkpoint-every", "25", *sum((["--inject", f] for f in FAULTS), []))
    say(f"training          {steps} steps of the tiny GPT, faults injected: {', '.join(FAULTS)}")
    try:
        code = subprocess.call(train, env={**os.environ, "TRAINGUARD_LOG_JSON": "0"})
        time.sleep(1.5)  # one more agent interval, so the node log holds the end of the run
    finally:
        stop(agent)
    return finish(run_dir, code)


def finish(run_dir: Path, code: int) -> int:
    from trainguard.report.cli import write_report

    report = write_report(run_dir, rundir.report_path(run_dir))
    print_story(run_dir)
    say(f"TLS logs          {run_dir / 'tls'}")
    say(f"checkpoints       {run_dir / 'checkpoints'}   (trainguard checkpoint list {run_dir})")
    say(f"report            {report}")
    say(f"replay it         trainguard replay {run_dir}")
    if code != 0:
        say(f"training exited with code {code}; see the messages above")
    return code


# Events that tell the demo's story; checkpoints and evaluations are in the report.
STORY = {
    "run_start": ("resumed_from", "restart_count"),
    "fault_injected": ("fault",),
    actions.SKIP_STEP: ("reason",),
    actions.ROLLBACK: ("reason", "restored_step", "steps_lost", "lr_scale"),
    actions.RESTORE: ("reason", "restored_step"),
    "action": ("action", "alertname", "reason"),
    "alert": ("alertname", "status"),
    "run_end": ("reason",),
}


def print_story(run_dir: Path) -> None:
    """What the guard and the actions did, from the rank-0 log: the demo's point, in a few lines."""
    path = rundir.rank_log(run_dir, 0)
    if not path.exists():
        return
    last = None
    say("what happened (rank 0):")
    for line in tls.iter_lines(path):
        record = line.record
        if record is None:
            say(f"  unreadable line: {line.error}")
            continue
        event = record.get("event")
        if event and event["type"] == "run_start" and not event.get("resumed_from"):
            continue
        if event and event["type"] in STORY:
            fields = ", ".join(f"{k}={event[k]}" for k in STORY[event["type"]] if event.get(k) is not None)
            say(f"  step {record.get('step', '?'):>5}  {event['type']:<15} {fields}")
        elif "metrics" in record:
            last = record
    if last:
        say(f"final step        {last.get('step')}  loss {last['metrics'].get('loss'):.4f}")


def say(text: str) -> None:
    print(f"[trainguard demo] {text}", flush=True)
