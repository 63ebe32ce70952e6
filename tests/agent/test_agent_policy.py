"""Where the agent and `trainguard replay RUN` take their policy from.

Before: the agent used ``RUN/policy.yaml`` whenever it was there and no policy was configured, so a file anyone
dropped there chose its cost budget; `replay RUN` ignored the run's policy altogether. Now both use it only
when rank 0's signature on it checks with the run's checkpoint key (trainguard/runpolicy.py), and say which
policy they used and why a present one was not.
"""

from __future__ import annotations

import json

import pytest

from tests.agent.test_training_collector import TINY_BUDGET
from trainguard import policy as policy_mod
from trainguard import rundir, runpolicy
from trainguard.agent.config import AgentConfig
from trainguard.agent.runner import choose_policy
from trainguard.runtime.checkpoint import keys

OWN = policy_mod.from_mapping({"alerts": {"stall_seconds": 77}})


@pytest.fixture
def key(tmp_path, monkeypatch) -> bytes:
    path = tmp_path / "keys" / "checkpoint.key"
    monkeypatch.setenv(keys.ENV_VAR, str(path))
    return keys.load_key(path, create=True)


def agent_policy(run) -> runpolicy.Choice:
    return choose_policy(AgentConfig(run_dir=run))


def test_a_planted_policy_is_not_the_agents_and_it_says_why(tmp_path, key):
    run = tmp_path / "run"
    run.mkdir()
    rundir.policy_path(run).write_text(TINY_BUDGET)
    chosen = agent_policy(run)
    assert chosen.policy == policy_mod.Policy() and chosen.path is None
    assert chosen.describe() == f"defaults ({rundir.policy_path(run)} not used: policy.sig.json is missing: " \
                                f"nobody signed it)"


def test_the_runs_signed_policy_is_used_and_a_changed_or_forged_one_is_not(tmp_path, key):
    run = tmp_path / "run"
    runpolicy.write(run, OWN, key, key_id=keys.key_id(key), by="trainer:run")
    chosen = agent_policy(run)
    assert chosen.policy == OWN and chosen.path == rundir.policy_path(run)
    assert chosen.why == f"the run's policy, signed by trainer:run (key {keys.key_id(key)})"

    with open(rundir.policy_path(run), "a") as handle:      # a tiny budget appended after it was signed
        handle.write(TINY_BUDGET)
    assert "was changed since it was signed" in agent_policy(run).why and agent_policy(run).path is None

    runpolicy.write(run, policy_mod.from_mapping({"cost": {"budget_per_1k_steps": 0.01}}), b"x" * 32, key_id=None,
                    by="trainer:run")                          # a stranger's key
    assert "signed with another key" in agent_policy(run).why and agent_policy(run).policy == policy_mod.Policy()

    runpolicy.write(tmp_path / "other", OWN, key, key_id=None, by="trainer:other")   # another run's, copied in
    for name in ("policy.yaml", "policy.sig.json"):
        (run / name).write_bytes((tmp_path / "other" / name).read_bytes())
    assert "signed for another name" in agent_policy(run).why


def test_the_agents_own_policy_wins(tmp_path, key):
    run = tmp_path / "run"
    runpolicy.write(run, OWN, key, key_id=None, by="trainer:run")
    own = tmp_path / "agent-policy.yaml"
    own.write_text(TINY_BUDGET)
    chosen = choose_policy(AgentConfig(run_dir=run, policy=own))
    assert chosen.path == own and chosen.policy.cost.budget_per_1k_steps == 100.0


def test_the_trainer_signs_the_policy_it_trains_with_and_replay_uses_it(tmp_path, key, capsys):
    """`replay RUN` uses the run's own policy when it can be authenticated, and prints which."""
    from tests.trainer.helpers import train
    from trainguard.cli import main

    run, given = tmp_path / "run", tmp_path / "given.yaml"
    given.write_text("alerts: {stall_seconds: 77}\n")
    assert train(run, "--steps", "2", "--policy", str(given)) == 0
    assert json.loads(rundir.policy_signature_path(run).read_text())["by"].startswith("trainer:")
    assert agent_policy(run).policy.alerts.stall_seconds == 77

    capsys.readouterr()
    assert main(["replay", str(run), "--json"]) == 0
    assert f"trainguard replay: policy: {rundir.policy_path(run)} (the run's policy, signed by trainer:" in \
        capsys.readouterr().err

    rundir.policy_path(run).write_text(TINY_BUDGET)            # planted over it
    assert main(["replay", str(run), "--json"]) == 0
    assert f"trainguard replay: policy: defaults ({rundir.policy_path(run)} not used: it was changed since it " \
           f"was signed)" in capsys.readouterr().err
