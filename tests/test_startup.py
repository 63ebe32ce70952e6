"""What a read-only command imports: only what it uses (bench/bench_startup.py times it; this pins the list).

Each command runs in a fresh interpreter through a wrapper that calls trainguard.cli.main as the console
script does, then writes sorted(sys.modules) to a file: the command's own output and exit status are its own.
structlog (and rich, which its console renderer imports) is for commands that log; yaml for a policy,
--expect or --rules file; torch, prometheus_client and the outer packages (agent, trainer, protect,
preflight) for the commands that train, export or protect.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainguard import tls

ROOT = Path(__file__).resolve().parent.parent
T0 = 1_710_512_538.0
OUTER = ("trainguard.runtime", "trainguard.agent", "trainguard.trainer", "trainguard.protect", "trainguard.preflight",
         "trainguard.demo")
HEAVY = ("structlog", "rich", "yaml", "torch", "prometheus_client")
WRAPPER = textwrap.dedent("""\
    import json, sys
    from trainguard.cli import main
    try:
        code = main(sys.argv[2:])
    except SystemExit as exc:
        code = exc.code
    with open(sys.argv[1], "w") as out:
        json.dump(sorted(sys.modules), out)
    sys.exit(code)
""")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory with one rank's three steps (and a NaN, so the guard has a decision to make)."""
    run = tmp_path_factory.mktemp("startup") / "run"
    (run / "tls").mkdir(parents=True)
    with tls.Writer(run / "tls" / "rank-0.jsonl") as writer:
        for i, loss in enumerate((2.0, float("nan"), 1.9)):
            writer.write({"timestamp": tls.format_timestamp(T0 + 5 * i), "node": "node-a", "rank": 0, "step": i,
                          "metrics": {"loss": loss, "grad_norm": 1.0}})
    return run


def command(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """The command's completed process and the modules loaded when it returned."""
    listing = tmp_path / "modules.json"
    done = subprocess.run([sys.executable, "-c", WRAPPER, str(listing), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    return done, set(json.loads(listing.read_text()))


def unneeded(modules: set[str], also: tuple[str, ...] = OUTER) -> list[str]:
    return sorted(m for m in modules if any(m == name or m.startswith(name + ".") for name in (*HEAVY, *also)))


def test_replay_of_a_log_imports_no_logging_yaml_torch_or_outer_package(run_dir, tmp_path):
    done, modules = command(tmp_path, "replay", str(run_dir / "tls" / "rank-0.jsonl"), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["records"] == 3
    assert unneeded(modules) == []
    assert {"numpy", "msgspec", "trainguard.decide.guard"} <= modules     # it did decide


def test_replay_of_a_run_directory_the_same(run_dir, tmp_path):
    done, modules = command(tmp_path, "replay", str(run_dir))
    assert done.returncode == 0, done.stderr
    assert "steps decided: 3" in done.stdout
    assert unneeded(modules) == []


def test_status_imports_neither_the_report_loader_nor_numpy(run_dir, tmp_path):
    done, modules = command(tmp_path, "status", str(run_dir))
    assert done.returncode == 0, done.stderr
    assert "training step 2" in done.stdout
    assert unneeded(modules, also=(*OUTER, "numpy", "trainguard.policy", "trainguard.report.data")) == []


@pytest.mark.parametrize("args", [["diagnose", "{run}"], ["report", "{run}", "-o", "{tmp}/report.html"]],
                         ids=["diagnose", "report"])
def test_diagnose_and_report_import_no_logging_yaml_torch_or_outer_package(run_dir, tmp_path, args):
    done, modules = command(tmp_path, *(a.format(run=run_dir, tmp=tmp_path) for a in args))
    assert done.returncode in (0, 1), done.stderr       # diagnose: 1 when it finds a problem
    assert unneeded(modules) == []


def test_incidents_imports_no_logging_yaml_or_torch(run_dir, tmp_path):
    """It checks cordons with the run's checkpoint key (trainguard.runtime.cordon_key), so the runtime's
    checkpoint package is loaded; torch and the trainer are not."""
    done, modules = command(tmp_path, "incidents", str(run_dir))
    assert done.returncode == 0, done.stderr
    assert "no incidents" in done.stdout
    assert unneeded(modules, also=tuple(name for name in OUTER if name != "trainguard.runtime")) == []


def test_help_lists_every_command_without_importing_one(tmp_path):
    from trainguard.cli import COMMANDS

    done, modules = command(tmp_path, "--help")
    assert done.returncode == 0, done.stderr
    assert all(name in done.stdout for name in COMMANDS)
    assert not {module for module, _ in COMMANDS.values()} & modules
    assert unneeded(modules, also=(*OUTER, "numpy", "msgspec")) == []


def test_a_command_missing_its_arguments_still_says_so(tmp_path):
    done, _ = command(tmp_path, "replay")
    assert done.returncode == 2
    assert "the following arguments are required: LOG_OR_RUN_DIR" in done.stderr


LOGS = textwrap.dedent("""\
    import sys
    from trainguard import log
    log.configure(json=True, stream=sys.stdout)
    assert "structlog" not in sys.modules, "configure() alone imports structlog"
    log.get("startup.test", run_id="r1").info("hello", step=3)
""")


def test_the_pipeline_is_built_at_the_first_logger_and_logs_json_lines():
    done = subprocess.run([sys.executable, "-c", LOGS], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout)
    assert line["event"] == "hello" and line["component"] == "startup.test" and line["run_id"] == "r1"
    assert line["step"] == 3 and line["level"] == "info" and line["timestamp"].endswith("Z")


def test_configure_applies_at_once_to_loggers_handed_out_before_it(capsys):
    """A logger made at import (before configure) logs through the pipeline configure() sets up later."""
    from trainguard import log

    early = log.get("startup.early")
    log.configure(json=True, level="warning", stream=sys.stdout)
    early.info("not shown")
    early.warning("shown", n=1)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(line["event"], line["level"], line["n"]) for line in lines] == [("shown", "warning", 1)]
