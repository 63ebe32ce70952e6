"""A job-level action's claim proves itself (agent/claims.py): a forged one stops nothing, two agents still
act once, and a claimant that died mid-action is taken over exactly once.

Before: the claim was any file at RUN/control/claims/<request id>; whoever could write the run directory
could pre-create it and no agent acted (a job-level restore of a hung job never happened).
"""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.alerts.helpers import read_jsonl
from trainguard import actions, rundir, signed
from trainguard.agent.action_log import alert_record
from trainguard.agent import claims
from trainguard.agent.config import AgentConfig, ConfigError
from trainguard.agent.executor import Executor, WebhookSettings, request_id
from trainguard.policy import Policy
from trainguard.decide.ledger import Ledger, Notice, NoticeVerdict

TOKEN = b"the-job-webhook-token"


def job_alert(key="fp-job@1") -> Notice:
    """JobStalledEverywhere as Alertmanager sends it: no instance label, so job-level."""
    return Notice(alertname="JobStalledEverywhere", status="firing", action=actions.COST_WARN, key=key,
                  source="alertmanager", labels={"alertname": "JobStalledEverywhere", "job": "trainguard"})


def the_id(notice: Notice) -> str:
    return request_id(NoticeVerdict(notice, "act", notice.action or "", "", 0.0))


def outcomes(run, node) -> list[str]:
    return [r["event"]["outcome"] for r in read_jsonl(rundir.node_actions_log(run, node))
            if r["event"]["type"] == "action"]


def refused(executor) -> dict[str, float]:
    family = next(f for f in executor.families() if f.name == "trainguard_claims_refused")
    return {s.labels["reason"]: s.value for s in family.samples if s.value}


def test_a_forged_claim_does_not_stop_the_action_and_is_counted_once(tmp_path):
    notice = job_alert()
    forged = rundir.claim_path(tmp_path, the_id(notice))
    forged.parent.mkdir(parents=True)
    forged.write_text(json.dumps({"node": "stranger", "claimed_at": time.time()}))   # the round-1 form
    executor = Executor(tmp_path, "n1", Ledger(), claim_secret=TOKEN)
    executor.submit([notice])
    assert outcomes(tmp_path, "n1") == ["issued"]
    assert [r["action"] for r in rundir.read_requests(tmp_path)] == [actions.COST_WARN]
    assert refused(executor) == {signed.UNSIGNED: 1}
    executor.claims.take(the_id(notice), time.time())        # seen again: logged and counted once
    assert refused(executor) == {signed.UNSIGNED: 1}


def test_a_claim_signed_with_another_token_or_copied_from_another_request_is_refused(tmp_path):
    stranger = claims.Claims(tmp_path, "stranger", b"another-token")
    stranger.take("cost-cost_warn", time.time())             # a valid claim, under the wrong token
    mine = claims.Claims(tmp_path, "n1", TOKEN)
    mine.take("restore-0001", time.time())
    copy = rundir.claim_path(tmp_path, "restore-0002")
    copy.write_bytes(rundir.claim_path(tmp_path, "restore-0001").read_bytes())   # a real claim, copied
    other = claims.Claims(tmp_path, "n2", TOKEN)
    assert other.take("cost-cost_warn", time.time()).mine
    assert other.take("restore-0002", time.time()).mine
    assert {k: v for k, v in other.refused.items() if v} == {signed.BAD_SIGNATURE: 1, signed.NOT_BOUND: 1}


def test_two_agents_on_one_alert_act_exactly_once(tmp_path):
    agents = [Executor(tmp_path, f"n{i}", Ledger(), claim_secret=TOKEN) for i in (1, 2)]
    barrier = threading.Barrier(2)

    def deliver(executor):
        barrier.wait()
        executor.submit([job_alert()])

    threads = [threading.Thread(target=deliver, args=(a,)) for a in agents]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes(tmp_path, "n1") + outcomes(tmp_path, "n2")) == ["claimed", "issued"]
    assert len(rundir.read_requests(tmp_path)) == 1
    [claim] = [p for p in rundir.claims_dir(tmp_path).iterdir()]
    record = json.loads(claim.read_text())
    assert record["done_at"] >= record["claimed_at"] and signed.check(TOKEN, claims.PURPOSE, record, {}) is None


def test_a_claimant_that_died_mid_action_is_taken_over_exactly_once(tmp_path):
    notice = job_alert()
    dead = claims.Claims(tmp_path, "n0", TOKEN)
    assert dead.take(the_id(notice), time.time()).mine       # n0 claimed it, then died before acting
    agents = [Executor(tmp_path, f"n{i}", Ledger(), claim_secret=TOKEN, claim_timeout_seconds=1.0) for i in (1, 2, 3)]
    for executor in agents:
        executor.submit([notice])                            # each finds n0's claim, fresh: n0 is at work
    assert all(outcomes(tmp_path, f"n{i}") == ["claimed"] for i in (1, 2, 3))
    deadline = time.time() + 20
    while sum(e.claims.taken_over for e in agents) == 0:
        assert time.time() < deadline, "nobody took the abandoned claim over"
        time.sleep(0.1)
    time.sleep(1.5)       # every watcher has looked again by now (timeout 1 s): none may act a second time
    taken = [e.node for e in agents if e.claims.taken_over]
    assert len(taken) == 1
    assert outcomes(tmp_path, taken[0]) == ["claimed", "issued"]
    assert [r["action"] for r in rundir.read_requests(tmp_path)] == [actions.COST_WARN]
    names = sorted(p.name for p in rundir.claims_dir(tmp_path).iterdir())
    assert names[0] == the_id(notice) and names[1].startswith(f"{the_id(notice)}.takeover-1-") and len(names) == 2


def test_a_claimant_that_finished_or_is_still_within_the_timeout_is_never_taken_over(tmp_path):
    notice = job_alert()
    first = Executor(tmp_path, "n1", Ledger(), claim_secret=TOKEN, claim_timeout_seconds=1.0)
    first.submit([notice])                                   # claimed and done
    second = Executor(tmp_path, "n2", Ledger(), claim_secret=TOKEN, claim_timeout_seconds=1.0)
    second.submit([notice])
    time.sleep(1.5)
    assert outcomes(tmp_path, "n2") == ["claimed"] and second.claims.taken_over == 0
    assert len(rundir.read_requests(tmp_path)) == 1


@pytest.mark.parametrize("webhook, message", [
    ({"claim_timeout_seconds": 0}, "webhook.claim_timeout_seconds: expected seconds >= 1"),
    ({"claim_timeout_seconds": True}, "webhook.claim_timeout_seconds"),
    ({"checkpoint_key_file": 5}, "webhook.checkpoint_key_file: expected a path"),
])
def test_bad_claim_and_key_settings_are_named(tmp_path, webhook, message):
    with pytest.raises(ConfigError, match=message):
        WebhookSettings.from_config(AgentConfig(run_dir=tmp_path, webhook=webhook))


def test_claim_and_key_settings_reach_the_executor(tmp_path):
    settings = WebhookSettings.from_config(AgentConfig(run_dir=tmp_path, webhook={
        "claim_timeout_seconds": 5, "checkpoint_key_file": "~/k"}))
    executor = Executor.for_agent(AgentConfig(run_dir=tmp_path, node="n1"), Policy(), settings, claim_secret=TOKEN)
    assert executor.claims.timeout == 5.0 and str(executor.node_actions.checkpoint_key_file).endswith("/k")


# ------------------------------------------------------------------- a slow claimant, a restarted agent

def test_a_claimant_slower_than_the_timeout_renews_its_claim_and_is_not_taken_over(tmp_path):
    """n1 claims, then its action blocks for 3.5 timeouts: the trainer's control file is held under its
    lock (a slow reader, a slow NFS server). n1 renews its claim meanwhile, so n2, which watches the claim,
    never takes it over. Before: n2 took over after 1 s and carried the action out too (for a job-level
    restore: two nodes' ranks ended for one alert)."""
    notice = job_alert()
    claimant = Executor(tmp_path, "n1", Ledger(), claim_secret=TOKEN, claim_timeout_seconds=1.0)
    watcher = Executor(tmp_path, "n2", Ledger(), claim_secret=TOKEN, claim_timeout_seconds=1.0)
    control = rundir.requests_path(tmp_path)
    control.parent.mkdir(parents=True, exist_ok=True)
    with open(control, "a+b") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)        # the claimant's append waits for this lock
        acting = threading.Thread(target=claimant.submit, args=([notice],))
        acting.start()
        wait_until(lambda: rundir.claim_path(tmp_path, the_id(notice)).exists(), "n1's claim")
        watcher.submit([notice])                        # claimed by n1: n2 watches it
        time.sleep(3.5)
        fcntl.flock(held.fileno(), fcntl.LOCK_UN)
    acting.join(10)
    time.sleep(1.5)                                     # n2 looks again once more after n1 finished
    assert outcomes(tmp_path, "n1") == ["issued"] and outcomes(tmp_path, "n2") == ["claimed"]
    assert watcher.claims.taken_over == 0
    assert [p.name for p in rundir.claims_dir(tmp_path).iterdir()] == [the_id(notice)]
    record = json.loads(rundir.claim_path(tmp_path, the_id(notice)).read_text())
    assert record["done_at"] and record["renewals"] >= 3
    assert signed.check(TOKEN, claims.PURPOSE, record, {"request_id": the_id(notice), "generation": 0}) is None


# The first agent of the restart test: records `claimed` (n0's claim, fresh) and exits, as a crash would.
FIRST_LIFE = """
import sys, os
from trainguard.agent.executor import Executor
from trainguard.decide.ledger import Ledger
from tests.fleet.test_claims import TOKEN, job_alert
Executor(sys.argv[1], "n1", Ledger(), claim_secret=TOKEN, claim_timeout_seconds=1.0).submit([job_alert()])
os._exit(0)
"""


def test_an_agent_restarted_after_recording_claimed_watches_the_claim_again_and_takes_it_over(tmp_path):
    notice = job_alert()
    assert claims.Claims(tmp_path, "n0", TOKEN).take(the_id(notice), time.time()).mine   # n0 then dies
    subprocess.run([sys.executable, "-c", FIRST_LIFE, str(tmp_path)], check=True, timeout=120,
                   cwd=Path(__file__).parents[2])
    assert outcomes(tmp_path, "n1") == ["claimed"]       # n1's first life watched n0's claim, then ended
    again = Executor(tmp_path, "n1", Ledger(), claim_secret=TOKEN, claim_timeout_seconds=1.0)
    wait_until(lambda: again.claims.taken_over == 1, "the takeover by the restarted agent")
    wait_until(lambda: outcomes(tmp_path, "n1") == ["claimed", "issued"], "the action's record")
    assert [r["action"] for r in rundir.read_requests(tmp_path)] == [actions.COST_WARN]


def test_an_agent_restarted_after_its_claimant_finished_does_not_act(tmp_path):
    notice = job_alert()
    subprocess.run([sys.executable, "-c", FIRST_LIFE.replace('"n1"', '"n2"'), str(tmp_path)], check=True,
                   timeout=120, cwd=Path(__file__).parents[2])         # n2 claims, acts, is done
    first = Executor(tmp_path, "n1", Ledger(), claim_secret=TOKEN, claim_timeout_seconds=1.0)
    first.submit([notice])
    restarted = Executor(tmp_path, "n1", Ledger(), claim_secret=TOKEN, claim_timeout_seconds=1.0)
    time.sleep(1.5)
    assert restarted.claims.taken_over == 0 and first.claims.taken_over == 0
    assert outcomes(tmp_path, "n1") == ["claimed"] and len(rundir.read_requests(tmp_path)) == 1


def wait_until(check, what, timeout=20.0):
    deadline = time.time() + timeout
    while not check():
        assert time.time() < deadline, f"no {what} within {timeout}s"
        time.sleep(0.05)


def test_an_agent_restarted_after_claiming_acts_once_unless_its_claim_was_taken_over_meanwhile(tmp_path):
    notice = job_alert()
    other = Notice(alertname="JobStalledEverywhere", status="firing", action=actions.RESTORE, key="fp-job@2",
                   source="alertmanager", labels={"alertname": "JobStalledEverywhere", "job": "trainguard"})
    first = Executor(tmp_path, "n1", Ledger(), claim_secret=TOKEN)
    verdicts = first.ledger.decide_all([notice, other], now=time.time())
    first.records.append([alert_record(v, time.time(), first.node) for v in verdicts])   # decided, then ...
    for v in verdicts:
        assert first.claims.take(request_id(v), time.time()).mine                   # claimed, and died
    # n2 took the second one over while n1 was down (n1's claim neither renewed nor done for the timeout)
    n2 = claims.Claims(tmp_path, "n2", TOKEN, timeout_seconds=1.0)
    n2.take(request_id(verdicts[1]), time.time())
    taken = n2.take(request_id(verdicts[1]), time.time() + 2)
    assert taken.mine and taken.generation == 1
    n2.hold(request_id(verdicts[1]), taken).done(time.time())
    Executor(tmp_path, "n1", Ledger(), claim_secret=TOKEN)                          # n1's next start
    assert outcomes(tmp_path, "n1") == ["issued", "claimed"]
    assert [r["id"] for r in rundir.read_requests(tmp_path)] == [request_id(verdicts[0])]   # n2 ran no trainer here
    assert json.loads(rundir.claim_path(tmp_path, request_id(verdicts[0])).read_text())["done_at"]
