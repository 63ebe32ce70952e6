"""`trainguard agent`: the per-node sidecar (collectors, /metrics, /healthz, the node TLS log, the webhook).

    trainguard agent --run-dir /data/runs/gpt --listen 127.0.0.1:9655 --config /etc/trainguard/agent.yaml

Flags override the config file. SIGTERM or SIGINT stops it cleanly. This module parses; agent/app.py
builds every part from the config and runs them.
"""

from __future__ import annotations

import argparse
import os
import threading
from pathlib import Path

from trainguard import log as tglog
from trainguard.agent import config as agent_config

def _names(value: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in value.split(",") if name.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", help="the training run's directory (RUN/tls, RUN/control, RUN/checkpoints)")
    parser.add_argument("--runs-root", help="instead of --run-dir: the directory the runs appear under, one "
                        "directory per job; the agent follows this node's run as runs come and go (a DaemonSet)")
    parser.add_argument("--coexist", choices=("auto", "on", "off"),
                        help="leave out the DCGM_* and node_* families dcgm-exporter and node_exporter already "
                             "export on this node (auto: when they answer on their ports; default auto)")
    parser.add_argument("--listen", help=f"HOST:PORT to serve /metrics and /healthz (default {agent_config.DEFAULT_LISTEN})")
    parser.add_argument("--config", help="YAML config file (see agent/configs/agent.yaml)")
    parser.add_argument("--procfs", help="procfs root (default /proc; /host/proc in a container)")
    parser.add_argument("--sysfs", help="sysfs root (default /sys)")
    parser.add_argument("--devfs", help="devfs root (default /dev)")
    parser.add_argument("--node", help="node name in records and labels (default: the host name)")
    parser.add_argument("--collectors", type=_names, help="run exactly these collectors (comma-separated)")
    parser.add_argument("--disable", type=_names, help="turn these collectors off (comma-separated)")
    parser.add_argument("--interval", type=float, help="sampling interval of every collector, seconds")
    parser.add_argument("--policy", help="policy file (cost budget tiers), default: RUN/policy.yaml or built-in")
    parser.add_argument("--nodelog-max-bytes", help="rotate the node TLS log past this size (e.g. 64MiB)")
    parser.add_argument("--webhook-token-file", help="bearer token file of POST /api/v1/alerts "
                        "(default RUN/agent/webhook.token, created 0600)")
    parser.add_argument("--shadow", "--dry-run", dest="shadow", action="store_true", default=None,
                        help="shadow mode: decide every action and record it as a shadow_action event, carry out "
                             "none (the policy's actions.mode: shadow; --dry-run is its older name)")
    parser.add_argument("--create", action="store_true",
                        help="make --run-dir if it does not exist yet (else a missing one is refused: a typo "
                             "would leave the agent watching an empty directory)")
    parser.add_argument("--list-collectors", action="store_true", help="list the collectors and exit")


def build_config(args: argparse.Namespace, known: set[str]) -> agent_config.AgentConfig:
    config = agent_config.load(args.config, known)
    for flag in ("collectors", "disable"):
        unknown = sorted(set(getattr(args, flag) or ()) - known)
        if unknown:
            raise agent_config.ConfigError(f"--{flag}: unknown collector(s) {', '.join(unknown)} "
                                           f"(known: {', '.join(sorted(known))})")
    return agent_config.with_flags(
        config, listen=args.listen, run_dir=args.run_dir, procfs=args.procfs, sysfs=args.sysfs, devfs=args.devfs,
        node=args.node, runs_root=args.runs_root, coexist=args.coexist, only=args.collectors, disabled=args.disable, interval=args.interval, policy=args.policy,
        nodelog_max_bytes=args.nodelog_max_bytes, webhook=_webhook_flags(config, args))


def _webhook_flags(config: agent_config.AgentConfig, args: argparse.Namespace) -> dict | None:
    """--webhook-token-file and --shadow over the config file's `webhook:` section."""
    flags = {"token_file": args.webhook_token_file, "shadow": args.shadow}
    flags = {key: value for key, value in flags.items() if value is not None}
    return {**config.webhook, **flags} if flags else None


def run(args: argparse.Namespace) -> int:
    from trainguard.agent import collectors
    from trainguard.agent.collector import REGISTRY

    known = set(REGISTRY) | set(collectors.MODULES)
    if args.list_collectors:
        for name in sorted(known):
            cls = REGISTRY.get(name)
            state = (f"default {'on' if cls.default_enabled else 'off'}, every {cls.interval:g}s" if cls
                     else f"unavailable: {collectors.UNAVAILABLE.get(name, 'not registered')}")
            print(f"{name:10s} {state}")
        return 0
    log = tglog.get("agent")
    try:
        config = build_config(args, known)
    except agent_config.ConfigError as exc:
        log.error(f"bad configuration: {exc}")
        return 2
    problem = check_run_dir(config.run_dir, create=args.create) or check_runs_root(config.runs_root)
    if problem:
        log.error(problem)
        return 2
    return serve(config)


def check_runs_root(root) -> str | None:
    if root is None or Path(root).is_dir():
        return None
    return f"--runs-root {root}: no such directory"


def check_run_dir(run_dir, create: bool) -> str | None:
    """Why `run_dir` cannot be watched, or None (made first with `create`)."""
    if run_dir is None:
        return None
    path = Path(run_dir)
    if path.is_dir():
        if not os.access(path, os.W_OK | os.X_OK):
            # The agent writes its node log, its actions, its offsets and the incidents there: on a read-only
            # run directory it would watch, decide and record nothing, and say so only in errors later.
            return f"--run-dir {path}: not writable (a read-only filesystem or no permission): the agent " \
                   f"writes its node log, actions and incidents there"
        return None
    if path.exists():
        return f"--run-dir {path}: not a directory"
    if not create:
        return f"--run-dir {path}: no such run directory (a typo? pass --create to make it)"
    try:
        path.mkdir(parents=True)
    except OSError as exc:
        return f"--run-dir {path}: cannot create it: {exc.strerror or exc}"
    return None


def serve(config: agent_config.AgentConfig, stop: threading.Event | None = None) -> int:
    """Build the agent (agent/app.py) and run it until SIGTERM/SIGINT (or `stop` is set); the exit status."""
    from trainguard.agent import app

    try:
        built = app.build(config)
    except app.CannotListen as exc:
        tglog.get("agent", node=config.node).error(str(exc))
        return 1
    return built.run(stop)
