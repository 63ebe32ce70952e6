"""`trainguard alerts render|test`: generate the rule files and Alertmanager config; lint and unit-test them.

    trainguard alerts render --out DIR [--policy FILE] [--mixin FILE] [--agent HOST:PORT ...] [--token-file FILE]
                             [--merge-into ALERTMANAGER.YML | --standalone]
    trainguard alerts test [--dir DIR]

`render` writes the rule files and alertmanager-routes.yml: trainguard's routes and receivers, to merge into
the Alertmanager configuration a cluster already has (`--merge-into FILE` writes that merge as
alertmanager.yml; `--standalone` a whole alertmanager.yml for an Alertmanager of trainguard's own).
`--mixin` (alerts/mixin.py): job selectors, runbook base, the self-handled alerts' severity.

`test` runs the real tools: `promtool check rules` on every rule file, `promtool test rules` on the
unit tests in alerts/tests/ (they pin the default policy's thresholds, so they run against the
checked-in files), and `amtool check-config` on alertmanager.yml, or on alertmanager-routes.yml merged
into a minimal configuration.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from trainguard import policy as policy_mod
from trainguard.alerts import alertmanager, rules
from trainguard.alerts import mixin as mixin_mod

PACKAGE_DIR = Path(__file__).resolve().parent
TESTS_DIR = PACKAGE_DIR / "tests"
AM_FILE = "alertmanager.yml"
AM_ROUTES_FILE = "alertmanager-routes.yml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="alerts_command", metavar="render|test", required=True)
    render = sub.add_parser("render", help="write the rule files and alertmanager.yml")
    render.add_argument("--policy", help="policy YAML whose thresholds the rules use (default: built-in)")
    # Required: the default was the installed package's folder, which a user's render would overwrite (and
    # a wheel's site-packages is no place for a user's files). The repository's own: --out alerts.
    render.add_argument("--out", required=True, metavar="DIR", help="output directory (created if missing)")
    render.add_argument("--agent", action="append", metavar="HOST:PORT",
                        help="an agent's listen address (repeat per node; the first gets run-wide actions; "
                             f"default {alertmanager.DEFAULT_AGENT})")
    render.add_argument("--token-file", default=alertmanager.DEFAULT_TOKEN_FILE,
                        help="file holding the webhook bearer token, as Alertmanager reads it (default: %(default)s)")
    render.add_argument("--human-webhook", metavar="URL", help="--standalone: where the human receiver sends "
                        "every alert that pages (all but severity info)")
    render.add_argument("--mixin", metavar="FILE", help="selectors, runbook URL base, severity of the alerts "
                        "trainguard handles itself (alerts/mixin.py)")
    whole = render.add_mutually_exclusive_group()
    whole.add_argument("--merge-into", metavar="ALERTMANAGER.YML", help="also write alertmanager.yml: this "
                       "existing configuration with trainguard's routes and receivers merged in")
    whole.add_argument("--standalone", action="store_true", help="also write a whole alertmanager.yml (an "
                       "Alertmanager of trainguard's own, with a human receiver)")
    defaults = alertmanager.Timing()
    for name in ("group_wait", "group_interval", "repeat_interval"):
        render.add_argument("--" + name.replace("_", "-"), default=getattr(defaults, name),
                            help="Alertmanager route timing (default: %(default)s)")
    test = sub.add_parser("test", help="promtool check rules, promtool test rules, amtool check-config")
    test.add_argument("--dir", default=str(PACKAGE_DIR), help="rendered directory to check (default: %(default)s)")


def main(argv: list[str]) -> int:
    """`trainguard alerts ARGV...` in-process (tests, scripts)."""
    parser = argparse.ArgumentParser(prog="trainguard alerts")
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    if args.alerts_command == "render":
        return render(args)
    return test(Path(args.dir))


def check_agent(address: str) -> str | None:
    """Why `address` is no agent address (HOST:PORT), or None: a route to an agent without its port would
    send every action to port 80, where no agent listens."""
    host, sep, port = address.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536 or \
            (host.count(":") and not host.startswith("[")):
        return (f"--agent {address}: expected HOST:PORT, the agent's listen address (its default port is "
                f"{alertmanager.DEFAULT_AGENT.rpartition(':')[2]})")
    return None


def render(args: argparse.Namespace) -> int:
    problem = next(filter(None, map(check_agent, args.agent or [])), None)
    if problem:
        print(f"trainguard alerts render: {problem}", file=sys.stderr)
        return 2
    try:
        policy = policy_mod.load(args.policy)
        mixin = mixin_mod.load(args.mixin)
        existing = _existing(args.merge_into) if args.merge_into else None
    except (policy_mod.PolicyError, mixin_mod.MixinError, ValueError) as exc:
        print(f"trainguard alerts render: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    written = rules.write(out, policy, rules.CONCERNS + rules.FLEET_CONCERNS, mixin)
    timing = alertmanager.Timing(args.group_wait, args.group_interval, args.repeat_interval)
    routes_path = out / AM_ROUTES_FILE
    routes_path.write_text(alertmanager.render_fragment(args.agent, args.token_file, timing))
    written.append(routes_path)
    if args.standalone:
        written.append(out / AM_FILE)
        written[-1].write_text(alertmanager.render(args.agent, args.token_file, args.human_webhook, timing))
    elif existing is not None:
        merged = alertmanager.merge(existing, alertmanager.fragment(args.agent, args.token_file, timing))
        written.append(out / AM_FILE)
        written[-1].write_text(rules.dump(merged))
    for path in written:
        print(path)
    return 0


def _existing(path: str) -> dict:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--merge-into {path}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("route"), dict):
        raise ValueError(f"--merge-into {path}: not an Alertmanager configuration (no `route:` mapping)")
    return data


def _tool(name: str, *alternatives: str) -> str | None:
    for candidate in (name, *alternatives):
        found = shutil.which(candidate)
        if found:
            return found
    return None


def checks(rule_dir: Path) -> list[list[str]]:
    """The commands `alerts test` runs for `rule_dir` (raises FileNotFoundError when a tool is missing)."""
    promtool, amtool = _tool("promtool"), _tool("amtool")
    missing = [name for name, path in (("promtool", promtool), ("amtool", amtool)) if not path]
    if missing:
        raise FileNotFoundError(f"{' and '.join(missing)} not installed (scripts/setup --servers installs them)")
    rule_files = sorted(str(p) for p in rule_dir.glob("*.rules.yml"))
    if not rule_files:
        raise FileNotFoundError(f"{rule_dir}: no *.rules.yml files (run `trainguard alerts render --out {rule_dir}`)")
    commands = [[promtool, "check", "rules", *rule_files]]
    if rule_dir.resolve() == PACKAGE_DIR:
        commands.append([promtool, "test", "rules", *sorted(str(p) for p in TESTS_DIR.glob("*.test.yml"))])
    if (rule_dir / AM_FILE).exists():
        commands.append([amtool, "check-config", str(rule_dir / AM_FILE)])
    elif (rule_dir / AM_ROUTES_FILE).exists():
        commands.append([amtool, "check-config", merged_example(rule_dir / AM_ROUTES_FILE)])
    return commands


MINIMAL_AM = {"route": {"receiver": "default"}, "receivers": [{"name": "default"}]}


def merged_example(routes_file: Path) -> str:
    """alertmanager-routes.yml merged into a minimal configuration, in a temporary file: what amtool checks."""
    part = yaml.safe_load(routes_file.read_text())
    handle = tempfile.NamedTemporaryFile("w", prefix="alertmanager-merged-", suffix=".yml", delete=False)
    with handle:
        handle.write(rules.dump(alertmanager.merge(MINIMAL_AM, part)))
    return handle.name


def test(rule_dir: Path) -> int:
    try:
        commands = checks(rule_dir)
    except FileNotFoundError as exc:
        print(f"trainguard alerts test: {exc}", file=sys.stderr)
        return 2
    failed = 0
    for command in commands:
        result = subprocess.run(command, capture_output=True, text=True)
        verdict = "ok" if result.returncode == 0 else "FAILED"
        print(f"== {' '.join(Path(command[0]).name if i == 0 else c for i, c in enumerate(command[:3]))}: {verdict}")
        if result.returncode != 0:
            failed += 1
            sys.stdout.write(result.stdout + result.stderr)
    return 1 if failed else 0
