"""`trainguard` command line: a thin dispatcher.

Each command lives in the package that does its work, as its `cli.py` (a second command of the same
package: `<command>_cli.py`), a module with `add_arguments(parser)` and `run(args) -> int`; they are
imported only when used, so `trainguard replay` never imports torch (docs/architecture.md, "Where a
command lives").
"""

from __future__ import annotations

import argparse
import importlib
import sys

from trainguard import __version__
from trainguard.exits import guarded

# name -> (module, one-line help)
COMMANDS = {
    "demo": ("trainguard.demo.cli", "train the tiny model with the agent beside it, inject a fault, write a report"),
    "train": ("trainguard.trainer.cli", "the bundled GPT pretraining loop (DDP through torchrun)"),
    "agent": ("trainguard.agent.cli", "the per-node sidecar: collectors, /metrics, TLS node log, webhook"),
    "replay": ("trainguard.replay.cli", "recorded TLS logs through the guard, cost policy and alert rules"),
    "report": ("trainguard.report.cli", "self-contained HTML report of a run"),
    "status": ("trainguard.report.status_cli", "the run at a glance, in the terminal"),
    "checkpoint": ("trainguard.runtime.checkpoint.cli", "list, verify or restore checkpoints"),
    "dashboards": ("trainguard.dashboards.cli", "render or push the Grafana dashboards"),
    "alerts": ("trainguard.alerts.cli", "render or test the Prometheus rules and Alertmanager config"),
    "diagnose": ("trainguard.diagnose.cli", "rank the likely causes of lost throughput in a run"),
    "preflight": ("trainguard.preflight.cli", "check a node before a long run"),
    "goodput": ("trainguard.goodput.cli", "goodput and badput of a run, by cause"),
    "incidents": ("trainguard.incidents.cli", "culprit verdicts of hangs, with their evidence"),
    "cordon": ("trainguard.cordon.cli", "keep a node out of the job by hand (a signed cordon)"),
    "uncordon": ("trainguard.cordon.uncordon_cli", "let a node kept out of the job join it again"),
    "convert": ("trainguard.formats.cli", "TensorBoard, trainer_state.json, Megatron or torchtitan logs as TLS"),
    "policy": ("trainguard.replay.policy_cli", "the policy a run acts under, every key; check a policy file"),
}


def build_parser(only: str | None = None, others: bool = True) -> argparse.ArgumentParser:
    """Every command by name and help line (`others=False`: `only` alone); the arguments of `only`, whose
    module is imported for them. Without `only` (`trainguard --help`, a mistyped command) no command module
    is imported: the list of commands is all argparse shows, and it needs none of them."""
    parser = argparse.ArgumentParser(
        prog="trainguard", description="Observability and self-protection for large-model pretraining.")
    parser.add_argument("--version", action="version", version=f"trainguard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        if not others and name != only:
            continue
        command = sub.add_parser(name, help=help_text, description=help_text)
        if name == only:
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as exc:
                if exc.name and module_name.startswith(exc.name):
                    raise SystemExit(f"trainguard {name}: not available in this build ({exc.name})") from None
                raise
            module.add_arguments(command)
            command.set_defaults(_run=module.run)
    return parser


@guarded   # exit statuses (0 ok, 1 found, 2 bad input, 70 crash) and escaped output: trainguard/exits.py
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    only = chosen if chosen in COMMANDS else None
    # With the command first argparse hands everything after it to the command's parser: the others'
    # entries (a parser each, ~5 ms of argparse and gettext) would serve only the list of commands.
    parser = build_parser(only=only, others=only is None or argv[0] != only)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    from trainguard import log

    log.configure()
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `trainguard ... | head`: the reader left; that is not an error of ours
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
