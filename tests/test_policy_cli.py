"""`trainguard policy show|check`: the policy a run acts under with every key, and a policy file checked on its
own, the first problem named with the file and key."""

from __future__ import annotations

import os

import pytest
import yaml

from trainguard import cli, runpolicy
from trainguard import policy as policy_mod
from trainguard.runtime.checkpoint import keys

OWN = policy_mod.from_mapping({"alerts": {"stall_seconds": 77}, "cost": {"tiers": {"warn": 0.2}}})


@pytest.fixture
def key(tmp_path, monkeypatch) -> bytes:
    path = tmp_path / "keys" / "checkpoint.key"
    monkeypatch.setenv(keys.ENV_VAR, str(path))
    return keys.load_key(path, create=True)


def policy(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    status = cli.main(["policy", *map(str, argv)])
    out, err = capsys.readouterr()
    return status, out, err


def test_show_without_a_run_is_every_key_of_the_defaults_as_a_policy_file(capsys, tmp_path):
    status, out, err = policy(capsys, "show")
    assert status == 0 and "defaults (no run directory given)" in err
    assert policy_mod.from_mapping(yaml.safe_load(out)) == policy_mod.Policy()     # a file that loads as itself
    assert "spike_sigma:" in out and "stall_seconds:" in out and "budget_per_1k_steps:" in out


def test_show_of_a_run_is_its_signed_policy_and_says_so(capsys, tmp_path, key):
    run = tmp_path / "run"
    runpolicy.write(run, OWN, key, key_id=keys.key_id(key), by="trainer:run")
    status, out, err = policy(capsys, "show", run)
    assert status == 0 and policy_mod.from_mapping(yaml.safe_load(out)) == OWN
    assert f"the run's policy, signed by trainer:run (key {keys.key_id(key)})" in err
    status, out, _ = policy(capsys, "show", run, "--changed")
    defaults = policy_mod.Policy()
    assert status == 0 and out.splitlines() == [f"cost.tiers.warn: 0.2 (default: {defaults.cost.tiers.warn})",
                                                f"alerts.stall_seconds: 77.0 (default: {defaults.alerts.stall_seconds})"]


def test_show_of_a_run_whose_policy_was_changed_after_signing_is_the_defaults_and_says_why(capsys, tmp_path, key):
    run = tmp_path / "run"
    runpolicy.write(run, OWN, key, key_id=None, by="trainer:run")
    with open(run / "policy.yaml", "a") as handle:
        handle.write("cost: {budget_per_1k_steps: 0.01}\n")
    status, out, err = policy(capsys, "show", run, "--changed")
    assert status == 0 and out == "" and "changed since it was signed" in err


def test_check_names_what_a_valid_file_changes(capsys, tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text("guard: {spike_sigma: 4.5}\nalerts: {for_short: 10s}\n")
    status, out, _ = policy(capsys, "check", path)
    assert status == 0
    defaults = policy_mod.Policy()
    assert out.splitlines() == [f"{path}: a valid policy; 2 keys differ from the defaults:",
                                f"  guard.spike_sigma: 4.5 (default: {defaults.guard.spike_sigma})",
                                f"  alerts.for_short: 10s (default: {defaults.alerts.for_short})"]
    path.write_text("{}\n")
    assert policy(capsys, "check", path)[1] == f"{path}: a valid policy; 0 keys differ from the defaults\n"


@pytest.mark.parametrize("text, named", [
    ("guard: {spike_sigmaa: 6}\n", "guard.spike_sigmaa: unknown key"),
    ("cost: {tiers: {warn: high}}\n", "cost.tiers.warn"),
    ("guard: [\n", "not valid YAML"),
])
def test_check_and_show_refuse_a_file_that_is_not_a_policy_naming_the_key(capsys, tmp_path, text, named):
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    for argv in (("check", path), ("show", "--policy", path)):
        status, out, err = policy(capsys, *argv)
        assert status == 2 and out == "" and str(path) in err and named in err, err
        assert "Traceback" not in err and "internal error" not in err


def test_what_is_not_there_is_bad_input(capsys, tmp_path):
    for argv in (("check", tmp_path / "none.yaml"), ("show", tmp_path / "no-run")):
        status, _, err = policy(capsys, *argv)
        assert status == 2 and "no such" in err and "internal error" not in err


def test_a_fifo_is_named_for_what_it_is_not_read(capsys, tmp_path):
    """tests/test_paths.py's rule for every command that opens what it is given: look before opening."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for argv, what in ((("show", fifo), "not a run directory"), (("check", fifo), "not a policy file"),
                       (("show", "--policy", fifo), "not a policy file")):
        status, _, err = policy(capsys, *argv)
        assert status == 2 and f"{fifo}: is a FIFO, {what}" in err, err
