"""`trainguard policy show|check`: which policy acts, with every key, and whether a policy file is one.

Every threshold that decides an action is a key of the policy (trainguard/policy.py; each key in
docs/policy.md), yet a file was checked only as a side effect of another command (`alerts render
--policy`), and which policy a run's replay or agent acts under, and with which values, was one stderr line.
It lives with replay (as report/status_cli.py lives with the report): `show RUN` is replay's own choice of
policy (`choose_policy`).

    trainguard policy show [RUN_DIR] [--policy FILE] [--key-file K] [--changed]
        the policy `replay RUN_DIR` acts under (the run's own RUN/policy.yaml when rank 0's signature checks,
        else the defaults; `--policy FILE` that file), as the YAML a policy file is written in, every key
        with its value; where it comes from on stderr. `--changed`: only the keys that differ from the
        defaults, each with its default.
    trainguard policy check FILE
        whether FILE is a valid policy (the first problem named with the file and key), and the keys it
        changes from the defaults.

Exit codes: 0 shown, or valid; 2 bad input (a policy file that is not one, no such run directory, a
--key-file that cannot be read).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from trainguard import paths
from trainguard import policy as policy_mod

EXIT_OK, EXIT_USAGE = 0, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = "exit codes: 0 shown or valid, 2 a policy file that is not one, or no such run directory"
    sub = parser.add_subparsers(dest="policy_command", metavar="show|check", required=True)
    show = sub.add_parser("show", help="the policy replay (and an agent without its own) acts under, every key",
                          description="the policy replay acts under, every key with its value, as YAML")
    show.add_argument("run_dir", nargs="?", metavar="RUN_DIR", type=Path,
                      help="a run directory: its own signed policy when the signature checks (default: the "
                           "built-in policy)")
    show.add_argument("--policy", metavar="FILE", help="this policy file instead")
    show.add_argument("--key-file", metavar="FILE",
                      help="the run's checkpoint key, to check the run's policy with (default: where "
                           "`trainguard train` looks for it)")
    show.add_argument("--changed", action="store_true",
                      help="only the keys that differ from the defaults, each with its default")
    check = sub.add_parser("check", help="whether a file is a valid policy, and what it changes",
                           description="whether a file is a valid policy, and the keys it changes")
    check.add_argument("file", metavar="FILE", help="the policy YAML")


def run(args: argparse.Namespace) -> int:
    if args.policy_command == "check":
        return check(args.file)
    return show(args.run_dir, args.policy, args.key_file, args.changed)


def show(run_dir: Path | None, given: str | None, key_file: str | None, changed_only: bool) -> int:
    from trainguard.replay.cli import choose_policy     # the choice replay makes, made the same way

    try:
        if run_dir is not None:
            paths.run_dir(run_dir, "run directory")
        chosen = choose_policy([str(run_dir)] if run_dir is not None else [], given, key_file)
    except (policy_mod.PolicyError, OSError) as exc:     # not a policy; no such run, an unreadable key
        return usage(str(exc))
    print(f"trainguard policy: {chosen.describe()}", file=sys.stderr)
    if changed_only:
        sys.stdout.write("".join(f"{line}\n" for line in changes(chosen.policy)))
    else:
        sys.stdout.write(policy_mod.dump(chosen.policy))
    return EXIT_OK


def check(path: str) -> int:
    try:
        policy = policy_mod.load(path)
    except policy_mod.PolicyError as exc:
        return usage(str(exc))
    changed = changes(policy)
    print(f"{path}: a valid policy; {len(changed)} key{'s' if len(changed) != 1 else ''} differ"
          f"{'s' if len(changed) == 1 else ''} from the defaults" + (":" if changed else ""))
    for line in changed:
        print(f"  {line}")
    return EXIT_OK


def changes(policy: policy_mod.Policy) -> list[str]:
    """`section.key: value (default: value)` for each key that differs from the built-in policy."""
    ours, defaults = flat(policy.to_dict()), flat(policy_mod.Policy().to_dict())
    return [f"{key}: {_yaml(value)} (default: {_yaml(defaults.get(key))})"
            for key, value in ours.items() if defaults.get(key) != value]


def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"guard.spike_sigma": 5.0, ...}: the dotted keys a policy error names."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _yaml(value: Any) -> str:
    """A value as the policy file writes it (one line)."""
    import json

    return json.dumps(value) if not isinstance(value, str) else value


def usage(message: str) -> int:
    print(f"trainguard policy: {message}", file=sys.stderr)
    return EXIT_USAGE
