"""Replay of recorded incidents and a recorded hang: the same verdicts and the same stall decision."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.culprit.cluster import TRAINGUARD
from trainguard import incidents, tls
from trainguard.agent import evidence
from trainguard.decide import culprit
from trainguard.decide.stall import replay
from trainguard.replay import stall_pass
from trainguard.runtime.checkpoint import keys

RECORDED = Path(__file__).parent / "recorded"
SCENARIOS = {"hang-evict": ("n2", 1), "hang-evict-off": ("n2", 1), "all-in-collective": (None, None),
             "xid-node": ("n1", 0)}


@pytest.fixture
def key(tmp_path, monkeypatch) -> bytes:
    path = tmp_path / "keys" / "checkpoint.key"
    monkeypatch.setenv(keys.ENV_VAR, str(path))
    return keys.load_key(path, create=True)


def signed_copy(scenario: str, into: Path, key: bytes) -> Path:
    """The recorded run with its node files signed as its agents sign them today (they were recorded before
    evidence was signed: as recorded, the verdict uses none of it)."""
    run = into / scenario
    shutil.copytree(RECORDED / scenario, run)
    for folder in incidents.incidents_dir(run).iterdir():
        for path in folder.glob("node-*.json"):
            host, signals = path.name[len("node-"):-len(".json")], json.loads(path.read_text())
            files = evidence.vouched(run, folder.name, [int(r) for r in signals.get("ranks") or {}])
            path.write_text(json.dumps(incidents.sign_node(key, folder.name, host, signals, files)))
    return run


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_a_recorded_incident_is_decided_again_to_the_same_verdict(scenario, tmp_path, key):
    as_recorded = RECORDED / scenario
    [(incident_id, stored, problem)] = list(incidents.scan(as_recorded))
    assert problem is None
    assert evidence.load(as_recorded, incident_id, key).nodes == []     # unsigned: decides nothing
    again = culprit.decide(*evidence.load(signed_copy(scenario, tmp_path, key), incident_id, key))
    assert again.culprit == stored["culprit"] and again.confidence == stored["confidence"]
    node, rank = SCENARIOS[scenario]
    assert (again.node, again.ranks[0] if again.ranks else None) == (node, rank)


def test_the_incidents_replay_command_agrees_on_every_recorded_incident(capsys, tmp_path, key):
    from trainguard.cli import main

    first, *others = SCENARIOS
    done = subprocess.run([TRAINGUARD, "incidents", "replay", str(signed_copy(first, tmp_path, key)), "--json"],
                          capture_output=True, text=True, timeout=60)      # the installed command, once
    assert done.returncode == 0, done.stderr
    assert all(r["same"] and r["ignored"] == [] for r in json.loads(done.stdout))
    for scenario in others:                                                # the same command in this process
        assert main(["incidents", "replay", str(signed_copy(scenario, tmp_path, key)), "--json"]) == 0
        assert all(r["same"] for r in json.loads(capsys.readouterr().out))


def _records(name: str) -> list[dict]:
    with gzip.open(RECORDED / name) as handle:
        return [tls.decode(line) for line in handle if line.strip()]


def _stalls(logs: list[Path], stall_seconds: float) -> list:
    """The stalls replay decides over these logs (its stall pass, merged as it merges them)."""
    return replay(stall_pass.streamed(logs, False, stall_seconds), stall_seconds)


def _unpacked(name: str, folder: Path) -> Path:
    path = folder / name.removesuffix(".gz")
    path.write_bytes(gzip.decompress((RECORDED / name).read_bytes()))
    return path


def test_a_recorded_hang_replays_to_restore_from_the_node_log_that_kept_coming(tmp_path):
    node_log = _unpacked("hang-node-n1.jsonl.gz", tmp_path)
    assert all("event" not in r for r in _records("hang-node-n1.jsonl.gz"))   # hardware/step samples, every second
    first = _stalls([node_log], 6.0)[0]
    assert (first.action, first.step) == ("restore", 24)
    rank_log = _unpacked("hang-rank-0.jsonl.gz", tmp_path)
    stalls = _stalls([node_log, rank_log], 6.0)               # with the rank's log, the end is known
    assert [(s.action, s.step) for s in stalls] == [("restore", 24)]
