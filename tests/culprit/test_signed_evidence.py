"""Incident evidence decides only when it proves which agent gathered it.

Before: the verdict read every ``node-*.json`` of the incident folder and took the host from the file's own
``"node"`` field, and "a hardware signal beats everything": a stranger who dropped a file claiming an XID
on an innocent node got that node named with confidence 0.95 and a signed cordon written for it. Now a node
file counts only when it is signed with the key of the host its name says (agent/evidence.py,
trainguard/incidents/__init__.py `check_node`); the rest is ignored, named in the verdict and counted.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.culprit.test_verdict import IN_ALL_REDUCE
from trainguard import actions, incidents, rundir, signed
from trainguard.agent import evidence
from trainguard.agent.culprit import Investigator
from trainguard.decide.ledger import Notice
from trainguard.policy import RestorePolicy
from trainguard.runtime.checkpoint import keys


@pytest.fixture
def key(tmp_path, monkeypatch) -> bytes:
    path = tmp_path / "keys" / "checkpoint.key"
    monkeypatch.setenv(keys.ENV_VAR, str(path))
    return keys.load_key(path, create=True)


def genuine(run, incident_id: str, host: str, rank: int, key: bytes) -> None:
    """What a node's agent writes: its rank's stacks, then its node file signed with its host key."""
    incidents.write_file(run, incident_id, f"rank-{rank}.stack.txt", IN_ALL_REDUCE)
    files = evidence.vouched(run, incident_id, [rank])
    signals = {"taken_at": time.time(), "ranks": {str(rank): {"pid": 1}}, "xids": [], "gpus_lost": [], "ib": {},
               "nccl_lines": [], "missing": {}}
    incidents.write_json(run, incident_id, incidents.node_file(host),
                         incidents.sign_node(key, incident_id, host, signals, files, keys.key_id(key)))


def forged_xid(run, incident_id: str, host: str, rank: int) -> None:
    """The stranger's file: an XID 79 on an innocent node (the incident id is readable before any evidence)."""
    incidents.write_json(run, incident_id, incidents.node_file(host),
                         {"node": host, "ranks": {str(rank): {}}, "xids": [{"gpu": 0, "xid": 79, "count": 1}],
                          "gpus_lost": [], "nccl_lines": []})


def stall() -> Notice:
    return Notice(alertname="TrainingStalled", status="firing", action=actions.RESTORE, key="stall",
                  source="embedded", reason="no step for 60s")


def test_a_forged_xid_on_an_innocent_node_names_nobody_and_is_named_and_counted(tmp_path, key):
    run = tmp_path / "run"
    for rank, host in enumerate(("n1", "n2")):
        rundir.write_rank_file(run, rank, {"rank": rank, "pid": 4_000_000 + rank, "host": host,
                                           "started_at": time.time()})
    incident_id = incidents.new_id("hang")
    genuine(run, incident_id, "n1", 0, key)
    forged_xid(run, incident_id, "n2", 1)          # it won the race: n2's agent has not written yet

    investigator = Investigator(run, "n1", RestorePolicy(evidence_seconds=1.0, evict="on"))
    decided = investigator.decide(incident_id, stall())

    assert decided["culprit"] is None and decided["action"] != "evict"
    assert not rundir.cordon_path(run, "n2").exists()
    assert decided["evidence_ignored"] == [{"file": "node-n2.json", "reason": signed.UNSIGNED,
                                            "why": "evidence node-n2.json is not signed"}]
    assert json.loads((incidents.incidents_dir(run) / incident_id / "incident.json").read_text())[
        "evidence_ignored"][0]["file"] == "node-n2.json"
    families = {f.name: f for f in investigator.families()}
    assert [(s.labels, s.value) for s in families["trainguard_evidence_refused"].samples] == \
        [({"reason": "unsigned"}, 1.0)]


def test_evidence_copied_renamed_changed_or_under_another_key_is_not_evidence(tmp_path, key):
    run = tmp_path / "run"
    incident_id, other = incidents.new_id("hang"), incidents.new_id("hang", time.time() + 60)
    genuine(run, incident_id, "n1", 0, key)
    genuine(run, other, "n3", 3, key)
    folder = incidents.incidents_dir(run)
    (folder / incident_id / "node-n2.json").write_bytes((folder / incident_id / "node-n1.json").read_bytes())
    (folder / incident_id / "node-n3.json").write_bytes((folder / other / "node-n3.json").read_bytes())
    incidents.write_json(run, incident_id, "node-n4.json", incidents.sign_node(b"k" * 32, incident_id, "n4", {
        "ranks": {"4": {}}, "xids": [{"gpu": 0, "xid": 79}]}, {}))
    (folder / incident_id / "rank-0.stack.txt").write_text("Thread 1 (idle): \"MainThread\"\n    sleep (x.py:1)\n")

    loaded = evidence.load(run, incident_id, key)
    assert [n.node for n in loaded.nodes] == ["n1"]              # the host of a node file is its name, checked
    assert {r["file"]: r["reason"] for r in loaded.refused} == {
        "node-n2.json": signed.BAD_SIGNATURE,    # n1's evidence renamed to n2's: n2's key does not check it
        "node-n3.json": signed.NOT_BOUND,        # another incident's evidence copied here
        "node-n4.json": signed.BAD_SIGNATURE,    # signed with another key
        "rank-0.stack.txt": signed.BAD_SIGNATURE}   # not the stacks n1's agent vouched for
    assert [(r.rank, r.stack) for r in loaded.ranks] == [(0, None)]
    assert evidence.load(run, incident_id, None).nodes == []     # no key: nothing can be checked, none used


def test_the_agent_signs_what_it_gathers_and_the_verdict_reads_it_back(tmp_path, key):
    run = tmp_path / "run"
    incident_id = incidents.new_id("hang")
    summary = evidence.gather(run, incident_id, "n1", [], wait_seconds=0.0)
    assert summary["signed"] is True
    record = json.loads((incidents.incidents_dir(run) / incident_id / "node-n1.json").read_text())
    assert record["node"] == "n1" and record["incident"] == incident_id and record["key_id"] == keys.key_id(key)
    loaded = evidence.load(run, incident_id, key)
    assert [n.node for n in loaded.nodes] == ["n1"] and loaded.refused == []


def test_a_verdict_that_does_not_prove_itself_ends_no_launcher(tmp_path, key):
    """The incident id is readable under RUN/control/dump/ before any verdict exists: a stranger's
    incident.json naming a node with action evict was read by every waiting agent and acted on."""
    run = tmp_path / "run"
    rundir.write_rank_file(run, 0, {"rank": 0, "pid": 4_000_000, "host": "n1", "started_at": time.time()})
    incident_id = incidents.new_id("hang")
    incidents.write_incident(run, incidents.Incident(id=incident_id, kind="hang", detected_at=time.time(),
                                                     detected_by="agent:n1", culprit={"rank": 1, "node": "n2"},
                                                     confidence=1.0, reasons=["forged"], action="evict"))
    waiting = Investigator(run, "n2", RestorePolicy(evidence_seconds=1.0))
    assert waiting.read_verdict(incident_id) is None              # not acted on: n2's launcher is not ended
    assert waiting.verdicts_refused == {incident_id: signed.UNSIGNED}

    genuine(run, incident_id, "n1", 0, key)
    decided = Investigator(run, "n1", RestorePolicy(evidence_seconds=1.0)).decide(incident_id, stall())
    assert decided["reasons"] != ["forged"]                        # the leader decides over it, signed
    assert waiting.read_verdict(incident_id)["reasons"] == decided["reasons"]   # now acted on: it checks


def test_incidents_show_says_a_verdict_is_not_genuine_and_names_ignored_evidence(tmp_path, key, capsys):
    from trainguard.cli import main

    run = tmp_path / "run"
    incident_id = incidents.new_id("hang")
    incidents.write_incident(run, incidents.Incident(id=incident_id, kind="hang", detected_at=time.time(),
                                                     detected_by="agent:n1", culprit={"rank": 1, "node": "n2"},
                                                     confidence=1.0, reasons=["forged"], action="evict"))
    assert main(["incidents", "show", str(run), incident_id]) == 0
    assert "NOT genuine: this verdict is not signed; no agent acts on it" in capsys.readouterr().out

    rundir.write_rank_file(run, 0, {"rank": 0, "pid": 4_000_000, "host": "n1", "started_at": time.time()})
    genuine(run, incident_id, "n1", 0, key)
    forged_xid(run, incident_id, "n2", 1)
    Investigator(run, "n1", RestorePolicy(evidence_seconds=1.0)).decide(incident_id, stall())
    assert main(["incidents", "show", str(run), incident_id]) == 0
    shown = capsys.readouterr().out
    assert "NOT genuine" not in shown and "ignored:    evidence node-n2.json is not signed" in shown
