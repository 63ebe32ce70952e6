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

from trainguard import actions, event_types
from trainguard import policy as policy_mod
from trainguard import rundir, safe_read
from trainguard import tls

STEPS = 240
# Where the faults go in the default 240 steps; a shorter run gets them at the same fractions of its length,
# and only those that can fire in it (`faults_for`).
NAN_AT, SPIKE_AT, SPIKE_LENGTH = 40, 150, 3
CHECKPOINT_EVERY = 25


def faults_for(steps: int, guard: policy_mod.GuardPolicy) -> tuple[list[str], str | None]:
    """The demo's `--inject` faults for a run of `steps`, and why a fault was left out (or None).

    The guard judges a loss spike only once it has learned `spike_min_steps` healthy losses (the NaN step
    is not learned), and the rollback needs a stable checkpoint before the burst: a burst too early for
    either would be announced and never fire, so it is left out and the reason said."""
    faults, left_out = [], None
    nan_at = steps * NAN_AT // STEPS
    if nan_at >= 1:
        faults.append(f"nan@{nan_at}")
    spike_at = steps * SPIKE_AT // STEPS
    fewest = guard.spike_min_steps + 4          # the NaN step, and a margin for a step the guard skipped
    if spike_at >= max(fewest, CHECKPOINT_EVERY + 1) and spike_at + SPIKE_LENGTH <= steps:
        faults += [f"spike@{spike_at + i}" for i in range(SPIKE_LENGTH)]
    else:
        need = -(-max(fewest, CHECKPOINT_EVERY + 1) * STEPS // SPIKE_AT)
        left_out = (f"no loss-spike burst: the guard judges a spike after {guard.spike_min_steps} healthy steps "
                    f"(--steps {need} or more shows it)")
    return faults, left_out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", type=Path, help="where to put the run (default: ./runs/demo-<time>)")
    parser.add_argument("--with-prometheus", action="store_true",
                        help="also run Prometheus and Alertmanager (Debian packages) with the generated rules")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"training steps (default {STEPS})")


def run(args: argparse.Namespace) -> int:
    if args.steps < 1:
        print(f"trainguard demo: --steps {args.steps}: must be at least 1", file=sys.stderr)
        return 2
    if args.with_prometheus:
        from trainguard.demo.stack import FAULTS as STACK_FAULTS

        last = max(int(fault.partition("@")[2]) for fault in STACK_FAULTS)
        if args.steps <= last:
            print(f"trainguard demo: --with-prometheus --steps {args.steps}: the full-stack demo's faults "
                  f"({', '.join(STACK_FAULTS)}) need more than {last} steps", file=sys.stderr)
            return 2
    run_dir = (args.run_dir or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    if args.with_prometheus:
        from trainguard.demo.stack import run_full_stack_demo

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
    faults, left_out = faults_for(steps, policy_mod.load(None).guard)
    train = trainguard_command("train", "--run-dir", str(run_dir), "--steps", str(steps),
                               "--checkpoint-every", str(CHECKPOINT_EVERY),
                               *sum((["--inject", f] for f in faults), []))
    say(f"training          {steps} steps of the tiny GPT, faults injected: {', '.join(faults) or 'none'}")
    if left_out:
        say(f"                  {left_out}")
    try:
        code = subprocess.call(train, env={**os.environ, "TRAINGUARD_LOG_JSON": "0"})
        time.sleep(1.5)  # one more agent interval, so the node log holds the end of the run
    finally:
        stop(agent)
    return finish(run_dir, code)


def finish(run_dir: Path, code: int) -> int:
    from trainguard.report.cli import write_report

    try:
        report = write_report(run_dir, rundir.report_path(run_dir))
    except FileNotFoundError as exc:         # training died before it wrote a record: say so, no traceback
        say(f"no report: {exc}")
        say(f"training exited with code {code}; see the messages above")
        return code or 1
    print_story(run_dir)
    say(f"TLS logs          {rundir.tls_dir(run_dir)}")
    say(f"checkpoints       {rundir.checkpoints_dir(run_dir)}   (trainguard checkpoint list {run_dir})")
    say(f"report            {report}")
    say(f"replay it         trainguard replay {run_dir}")
    if code != 0:
        say(f"training exited with code {code}; see the messages above")
    return code


# Events that tell the demo's story; checkpoints and evaluations are in the report.
STORY = {
    event_types.RUN_START: ("resumed_from", "restart_count"),
    event_types.FAULT_INJECTED: ("fault",),
    actions.SKIP_STEP: ("reason",),
    actions.ROLLBACK: ("reason", "restored_step", "steps_lost", "lr_scale"),
    actions.RESTORE: ("reason", "restored_step"),
    event_types.ACTION: ("action", "alertname", "reason"),
    event_types.ALERT: ("alertname", "status"),
    event_types.RUN_END: ("reason",),
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
        if event and event["type"] == event_types.RUN_START and not event.get("resumed_from"):
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
