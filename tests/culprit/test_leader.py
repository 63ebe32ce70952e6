"""A stall's incident gets its verdict even when the agent leading it dies (agent/culprit.py, agent/claims.py,
trainguard/decide/leader.py).

The leader of the first life is a real process (an Investigator in a subprocess) killed with SIGKILL while it
waits for the other node's evidence, after it claimed the incident and wrote its own node's evidence. The
other agents are Investigators on threads of this process, on the same run directory: real files, no fakes.

Before (main at 5c2d9d8, these tests run against main's agent/culprit.py and agent/claims.py): the claim was
an unsigned file naming only the incident id. Every other agent, and the leader's restarted agent, waited
``2 x evidence_seconds + 15`` s for a verdict nobody wrote and restored in place without one (the first two
tests: no ``incident.json``). A stranger who pre-created that file chose the incident, so a verdict it had
written there was acted on (the third: the forged verdict was read, no verdict of the agents was written).
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from trainguard import actions, incidents, rundir
from trainguard.agent import claims
from trainguard.agent.culprit import Investigator
from trainguard.decide import leader
from trainguard.decide.ledger import Notice
from trainguard.policy import RestorePolicy

TOKEN = b"the-job-webhook-token"
EVIDENCE_SECONDS = 1.0
KEY = "step0-attempt0"          # no rank logged a step yet, launcher attempt 0
RECORDED = Path(__file__).parent / "recorded" / "hang-evict" / "incidents" / "20261201T195351Z-hang-2f8a"

# The leader's first life: claims, writes its node's evidence, then waits for the other nodes' (killed there).
FIRST_LIFE = """
import inspect, sys
from trainguard.agent.culprit import Investigator
from trainguard.decide.ledger import Notice
from trainguard.policy import RestorePolicy
run, host, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
signing = {"claim_secret": b"the-job-webhook-token"}
kwargs = signing if "claim_secret" in inspect.signature(Investigator).parameters else {}
Investigator(run, host, RestorePolicy(evidence_seconds=seconds), **kwargs).investigate(
    Notice(alertname="TrainingStalled", status="firing", action="restore", key="stall", source="embedded"), [])
"""


def stall() -> Notice:
    return Notice(alertname="TrainingStalled", status="firing", action=actions.RESTORE, key="stall",
                  source="embedded", reason="no step for 60s")


def register(run: Path, hosts: list[str], pids: list[int] | None = None) -> None:
    """Rank r on hosts[r], as the launchers register them (the job's nodes, as the leader reads them)."""
    for rank, host in enumerate(hosts):
        rundir.write_rank_file(run, rank, {"rank": rank, "pid": pids[rank] if pids else 4_000_000 + rank,
                                           "host": host, "started_at": time.time()})


def investigator(run: Path, host: str, records: list | None = None) -> Investigator:
    """An agent's Investigator, signing with the job's token (main's had no such argument: built without)."""
    signing = {"claim_secret": TOKEN, "lead_timeout": EVIDENCE_SECONDS}
    accepted = inspect.signature(Investigator).parameters
    return Investigator(run, host, RestorePolicy(evidence_seconds=EVIDENCE_SECONDS),
                        record=None if records is None else records.extend,
                        **{k: v for k, v in signing.items() if k in accepted})


def first_life_dies_leading(run: Path, host: str) -> str:
    """Start the leader's first life, kill it once it waits for the others; the incident it named."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    child = subprocess.Popen([sys.executable, "-c", FIRST_LIFE, str(run), host, str(EVIDENCE_SECONDS)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not list(incidents.incidents_dir(run).glob(f"*/node-{host}.json")):
            assert child.poll() is None, child.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the first life wrote no evidence within 60 s"
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    [evidence] = incidents.incidents_dir(run).glob(f"*/node-{host}.json")
    assert not (evidence.parent / "incident.json").exists()          # died before the verdict
    return evidence.parent.name


def investigate_together(agents: list[Investigator], live: dict | None = None) -> list:
    results: list = [None] * len(agents)

    def one(i: int) -> None:
        results[i] = agents[i].investigate(stall(), (live or {}).get(agents[i].host, []))
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(agents))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "an investigation did not end within 120 s"
    return results


def verdicts(run: Path) -> dict[str, dict]:
    return {path.parent.name: json.loads(path.read_text())
            for path in incidents.incidents_dir(run).glob("*/incident.json")}


def taken_over(agents: list[Investigator]) -> int:
    return sum(getattr(agent, "claims", None) and agent.claims.taken_over or 0 for agent in agents)


# --------------------------------------------------------------------------------------- the rule

def test_the_rule_over_a_found_claim():
    assert leader.standing(mine=True, done=False, renewed=False, taken_over_since=False) == leader.LEAD
    assert leader.standing(mine=True, done=False, renewed=False, taken_over_since=True) == leader.NEXT
    assert leader.standing(mine=True, done=True, renewed=False, taken_over_since=True) == leader.LEAD
    assert leader.standing(mine=False, done=True, renewed=False, taken_over_since=False) == leader.FOLLOW
    assert leader.standing(mine=False, done=False, renewed=True, taken_over_since=False) == leader.FOLLOW
    assert leader.standing(mine=False, done=False, renewed=False, taken_over_since=False) == leader.TAKE_OVER
    me = leader.Claimant("n1", 200, 1000.0)
    assert leader.restarted(leader.Claimant("n1", 100, 900.0), me)
    assert leader.restarted(leader.Claimant("n1", 200, 900.0), me)          # the pid reused by another life
    assert not leader.restarted(leader.Claimant("n1", 200, 1000.0), me)
    assert not leader.restarted(leader.Claimant("n2", 100, 900.0), me)      # another host's: not ours
    assert leader.renewed_within(seen_since=10.0, now=14.9, timeout=5.0)
    assert not leader.renewed_within(seen_since=10.0, now=15.0, timeout=5.0)


def test_a_claim_names_its_claimant_and_the_callers_fields_signed(tmp_path):
    made = claims.Claims(tmp_path, "n1", TOKEN).take("incident-x", time.time(), {"incident": "i-1"})
    record = json.loads(rundir.claim_path(tmp_path, "incident-x").read_text())
    assert (record["node"], record["pid"], record["incident"]) == ("n1", os.getpid(), "i-1")
    assert record["started_at"] == pytest.approx(claims.this_agent("n1").started_at)
    found = claims.Claims(tmp_path, "n2", TOKEN).take("incident-x", time.time(), {"incident": "other"})
    assert (found.mine, found.fields, made.fields) == (False, {"incident": "i-1"}, {"incident": "i-1"})


# ------------------------------------------------------------------------------ a dead leader

@pytest.fixture
def ranks():
    """Two live processes standing for the ranks (py-spy dumps them); killed after the test."""
    sleeping = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for _ in range(2)]
    yield [p.pid for p in sleeping]
    for process in sleeping:
        process.kill()
        process.wait()


def test_a_restarted_leader_leads_its_incident_again_and_names_the_culprit(tmp_path, ranks):
    run = tmp_path / "run"
    register(run, ["n1", "n2"], ranks)
    incident_id = first_life_dies_leading(run, "n1")
    for name in ("rank-0.fr.json", "rank-1.fr.json"):   # the ranks' Flight Recorder dumps of a recorded hang
        shutil.copy(RECORDED / name, incidents.incidents_dir(run) / incident_id / name)
    live = {info.host: [info] for info in rundir.read_ranks(run)[0]}
    records: list = []
    agents = [investigator(run, "n1", records), investigator(run, "n2")]        # n1: its second life
    investigate_together(agents, live)
    assert list(verdicts(run)) == [incident_id]                          # the same incident, decided once
    verdict = verdicts(run)[incident_id]
    assert verdict["detected_by"] == "agent:n1" and taken_over(agents) == 0
    assert verdict["culprit"]["rank"] == 1 and verdict["culprit"]["node"] == "n2"
    assert [r["event"]["incident"] for r in records] == [incident_id]   # the culprit event, once


def test_a_dead_leader_is_taken_over_by_exactly_one_agent_which_writes_the_verdict(tmp_path):
    run = tmp_path / "run"
    register(run, ["n1", "n2", "n3"])
    incident_id = first_life_dies_leading(run, "n1")                     # n1's agent never comes back
    agents = [investigator(run, "n2"), investigator(run, "n3")]
    started = time.monotonic()
    investigate_together(agents)
    assert list(verdicts(run)) == [incident_id]
    assert verdicts(run)[incident_id]["detected_by"] in ("agent:n2", "agent:n3")
    assert taken_over(agents) == 1
    assert time.monotonic() - started < 2 * EVIDENCE_SECONDS + 15        # well before the old wait ran out


# ---------------------------------------------------------------------------- a forged claim

def forged_claim(run: Path, how: str, incident_id: str) -> None:
    """A stranger who can write the run directory claims the incident, pointing at a verdict of its own."""
    if how == "unsigned":
        body = {"request_id": f"incident-{KEY}", "generation": 0, "node": "stranger", "claimed_at": time.time(),
                "renewals": 0, "incident": incident_id}
    else:          # a valid claim of another stall, copied to this one's name
        claims.Claims(run, "n9", TOKEN).take("incident-step7-attempt0", time.time(), {"incident": incident_id})
        body = json.loads(rundir.claim_path(run, "incident-step7-attempt0").read_text())
    for path in (rundir.claim_path(run, f"incident-{KEY}"), incidents.incidents_dir(run) / ".claims" / KEY):
        path.parent.mkdir(parents=True, exist_ok=True)     # where the claim is now, and where main kept it
        path.write_text(json.dumps(body) if path.parent.name == "claims" else incident_id)


@pytest.mark.parametrize("how", ["unsigned", "copied"])
def test_a_forged_or_copied_leader_claim_neither_suppresses_nor_steers_the_verdict(tmp_path, how):
    run = tmp_path / "run"
    register(run, ["n1", "n2"])
    steered = incidents.new_id("hang", time.time() - 60)
    incidents.write_incident(run, incidents.Incident(           # the verdict the stranger wants acted on
        id=steered, kind="hang", detected_at=time.time(), detected_by="agent:n2", culprit={"rank": 0, "node": "n1"},
        confidence=1.0, reasons=["forged"], action="evict"))
    forged_claim(run, how, steered)
    records: list = []
    agents = [investigator(run, "n1", records), investigator(run, "n2", records)]
    investigate_together(agents)
    decided = {i: v for i, v in verdicts(run).items() if i != steered}
    assert len(decided) == 1 and verdicts(run)[steered]["reasons"] == ["forged"]   # the forged one untouched
    [(incident_id, verdict)] = decided.items()
    assert verdict["detected_by"] in ("agent:n1", "agent:n2") and verdict["action"] != "evict"
    assert [r["event"]["incident"] for r in records] == [incident_id]
    refused = {reason for agent in agents for reason, n in agent.claims.refused.items() if n}
    assert refused == {"unsigned" if how == "unsigned" else "not_bound"}
