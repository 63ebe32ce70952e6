"""`trainguard alerts render|test`: generate the rule files and Alertmanager config; lint and unit-test them.

    trainguard alerts render --out DIR [--policy FILE] [--agent HOST:PORT ...] [--token-file FILE]
    trainguard alerts test [--dir DIR]

`test` runs the real tools: `promtool check rules` on every rule file, `promtool test rules` on the
unit tests in alerts/tests/ (they pin the default policy's thresholds, so they run against the
checked-in files), and `amtool check-config` on alertmanager.yml.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from trainguard import policy as policy_mod
from trainguard.alerts import alertmanager, rules

PACKAGE_DIR = Path(__file__).resolve().parent
TESTS_DIR = PACKAGE_DIR / "tests"
AM_FILE = "alertmanager.yml"


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
    render.add_argument("--human-webhook", metavar="URL", help="where the human receiver sends every alert")
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


def render(args: argparse.Namespace) -> int:
    try:
        policy = policy_mod.load(args.policy)
    except policy_mod.PolicyError as exc:
        print(f"trainguard alerts render: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    written = rules.write(out, policy, rules.CONCERNS + rules.FLEET_CONCERNS)
    timing = alertmanager.Timing(args.group_wait, args.group_interval, args.repeat_interval)
    am_path = out / AM_FILE
    am_path.write_text(alertmanager.render(args.agent, args.token_file, args.human_webhook, timing))
    for path in [*written, am_path]:
        print(path)
    return 0


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
    return commands


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
