"""`trainguard preflight` end to end on this machine, and the agent collector that exports its result."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from tests.servers import require_binary
from trainguard.agent.collector import Context
from trainguard.agent.collectors.preflight import PreflightCollector
from trainguard.cli import main
from trainguard.runtime.preflight_result import ResultError

QUICK = ["--skip", "collective", "--skip", "checkpoint_drill"]


def test_passes_on_this_machine_with_a_fresh_lock(tmp_path, capsys):
    run, lock = tmp_path / "run", tmp_path / "env.lock"
    assert main(["preflight", "--run-dir", str(run), "--write-lock", str(lock)]) == 0
    table = capsys.readouterr().out
    assert f"result written to {run / 'preflight.json'}" in table
    names = ("environment", "nccl_env", "gpus", "storage", "checkpoint_drill", "collective")
    skipped = [words[0] for words in map(str.split, table.splitlines()) if words[:1] and words[0] in names
               and words[1] == "skip"]
    if skipped:     # no NVML here: the verdict names what it did not check, never "all checks passed"
        assert "all checks passed" not in table and f"skipped, so not checked: {', '.join(skipped)}" in table
    else:
        assert "all 6 checks passed" in table
    for name in ("environment", "nccl_env", "gpus", "storage", "checkpoint_drill", "collective"):
        assert name in table
    assert main(["preflight", "--run-dir", str(run), "--expect", str(lock), "--json", *QUICK]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] is True and out["written_to"] == str(run / "preflight.json")
    statuses = {c["name"]: c["status"] for c in out["checks"]}
    assert statuses["environment"] == "pass" and statuses["storage"] == "pass"
    assert statuses["gpus"] in ("pass", "skip")       # skip: no NVML on this machine
    assert json.loads((run / "preflight.json").read_text())["lock_hash"] == out["lock_hash"]


def test_a_changed_lock_exits_1_and_shows_the_difference(tmp_path, capsys):
    lock = tmp_path / "env.lock"
    assert main(["preflight", "--write-lock", str(lock), *QUICK, "--skip", "storage"]) == 0
    pinned = yaml.safe_load(lock.read_text())
    found = pinned["python"]
    pinned["python"] = "3.10.14"
    lock.write_text(yaml.safe_dump(pinned))
    capsys.readouterr()
    assert main(["preflight", "--expect", str(lock), "--json", *QUICK, "--skip", "storage"]) == 1
    out = json.loads(capsys.readouterr().out)
    environment = next(c for c in out["checks"] if c["name"] == "environment")
    assert environment["message"] == f"differs from {lock}: python: expected '3.10.14', found '{found}'"
    assert out["passed"] is False


def test_an_unwritable_checkpoint_dir_exits_1(tmp_path, capsys):
    (tmp_path / "checkpoints").write_text("oops")
    assert main(["preflight", "--checkpoint-dir", str(tmp_path / "checkpoints"), *QUICK]) == 1
    text = " ".join(capsys.readouterr().out.split())       # the table wraps long messages
    assert "FAILED: storage" in text and f"{tmp_path / 'checkpoints'} exists and is not a directory" in text


def scrape(collector) -> str:
    registry = CollectorRegistry()

    class Families:
        def __init__(self, families):
            self.families = families

        def collect(self):
            return self.families

    registry.register(Families(collector.update().families))
    return generate_latest(registry).decode()


def test_the_agent_exports_the_last_result(tmp_path, capsys):
    run = tmp_path / "run"
    collector = PreflightCollector(Context(run_dir=run))
    assert collector.update().families == []                   # preflight has not run: nothing to say
    (tmp_path / "checkpoints").write_text("oops")
    main(["preflight", "--run-dir", str(run), "--checkpoint-dir", str(tmp_path / "checkpoints"), *QUICK])
    text = scrape(collector)
    assert "trainguard_preflight_success 0.0" in text
    assert 'trainguard_preflight_check_success{check="storage"} 0.0' in text
    assert 'trainguard_preflight_check_success{check="nccl_env"} 1.0' in text
    assert 'check="collective"' not in text                    # skipped checks are absent
    result = json.loads((run / "preflight.json").read_text())
    assert f'lock_hash="{result["lock_hash"]}"' in text and f'torch_version="{result["environment"]["torch"]}"' in text
    promtool = require_binary("promtool")
    checked = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert collector.update().tls["system"]["preflight_passed"] is False


def test_a_file_that_is_no_result_fails_the_update_naming_the_field(tmp_path):
    path = tmp_path / "preflight.json"
    path.write_text(json.dumps({"schema": "trainguard.preflight/1", "timestamp": 1.0, "passed": "yes"}))
    collector = PreflightCollector(Context(options={"path": str(path)}))
    with pytest.raises(ResultError, match=f"{path}: passed: missing or of the wrong type"):
        collector.update()
