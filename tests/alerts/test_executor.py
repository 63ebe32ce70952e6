"""The executor: durable records, control requests, ending real rank processes, recovery after a crash."""

import json
import socket
import time

import pytest

from tests.alerts.helpers import read_jsonl
from tests.alerts.ranks import STANDIN, Ranks, alive, rewrite
from tests import signing
from trainguard import actions
from trainguard import rundir
from trainguard.agent.action_log import ActionLog, alert_record
from trainguard.agent.executor import Executor, request_id
from trainguard.decide.ledger import Ledger, Limits, Notice
from trainguard.runtime.control import ControlChannel

HOST = socket.gethostname()


def notice(name="LossSpike", action=actions.ROLLBACK, key="fp@1", starts_at=None, status="firing"):
    return Notice(alertname=name, status=status, action=action, key=key, starts_at=starts_at)


def actions_log(run_dir, node="n1"):
    return [r["event"] for r in read_jsonl(run_dir / "tls" / f"node-{node}-actions.jsonl")]


def requests(run_dir):
    return read_jsonl(run_dir / "control" / "actions.jsonl")


@pytest.fixture
def ranks():
    """Real stand-in ranks under real torchrun (tests/alerts/ranks.py); every launcher is reaped at the end."""
    launched = Ranks()
    yield launched
    launched.stop()


def executor_for(run_dir, **kwargs) -> Executor:
    """An executor that accepts the stand-in rank as a registered user entry point."""
    return Executor(run_dir, "n1", kwargs.pop("ledger", None) or Ledger(), entry_points=(STANDIN,), **kwargs)


def restore_notice(key="s@1", starts_at=None):
    return notice("TrainingStalled", actions.RESTORE, key, starts_at=time.time() + 5 if starts_at is None else starts_at)


def wait_dead(pid, timeout=20):
    deadline = time.time() + timeout
    while alive(pid):
        assert time.time() < deadline, f"pid {pid} still alive"
        time.sleep(0.05)


def test_a_decision_is_on_disk_before_its_action_and_names_the_alert(tmp_path):
    executor = Executor(tmp_path, "n1", Ledger())
    [verdict] = executor.submit([notice()])
    alert_event, action_event = actions_log(tmp_path)
    assert alert_event["type"] == "alert" and alert_event["outcome"] == "act"
    assert alert_event["request_id"] == action_event["id"] == request_id(verdict)
    assert action_event["type"] == "action" and action_event["alertname"] == "LossSpike"
    assert action_event["outcome"] == "issued" and action_event["appended"] is True
    [request] = requests(tmp_path)
    assert {k: v for k, v in request.items() if k not in ("signature", "key_id")} == {
        "id": request_id(verdict), "action": "rollback", "alertname": "LossSpike", "reason": "LossSpike",
        "issued_at": request["issued_at"], "run": tmp_path.name, "by": "agent:n1"}
    assert rundir.check_request(signing.key(), request, tmp_path) is None     # signed: the trainer acts on it


def test_the_trainer_control_channel_reads_what_the_executor_writes(tmp_path):
    Executor(tmp_path, "n1", Ledger()).submit(
        [notice("CostBudgetWarn", actions.COST_WARN, "c1"), notice("CostBudgetThrottle", actions.COST_THROTTLE, "c2")])
    channel = ControlChannel(tmp_path, rank=0, key=signing.key())
    codes = [channel.poll()[0] for _ in range(3)]
    assert codes == [2, 3, 0]     # cost_warn, cost_throttle, then nothing


def test_cost_tiers_from_two_agents_on_one_run_reach_the_trainer_once(tmp_path):
    # the job's agents share the webhook token, which signs their claims (agent/claims.py)
    first, second = (Executor(tmp_path, node, Ledger(), claim_secret=b"job-token") for node in ("n1", "n2"))
    first.submit([notice("CostBudgetWarn", actions.COST_WARN, "embedded:cost_warn")])
    second.submit([notice("CostBudgetWarn", actions.COST_WARN, "embedded:cost_warn")])
    assert [r["action"] for r in requests(tmp_path)] == ["cost_warn"]
    # A job-level alert (no instance): the second agent finds the first's claim and leaves it (docs/scale.md).
    assert actions_log(tmp_path, "n2")[-1]["outcome"] == "claimed"
    assert actions_log(tmp_path, "n2")[-1]["claimed_by"] == "n1"


def test_append_request_skips_an_id_already_there(tmp_path):
    path = rundir.requests_path(tmp_path)
    assert rundir.append_request(tmp_path, {"id": "a", "action": "rollback"})
    path.open("a").write("not json\n")
    assert not rundir.append_request(tmp_path, {"id": "a", "action": "rollback"})
    assert rundir.append_request(tmp_path, {"id": "b", "action": "rollback"})
    assert [json.loads(line)["id"] for line in path.read_text().splitlines() if line.startswith("{")] == ["a", "b"]


def test_shadow_records_what_it_would_have_done_and_executes_nothing(tmp_path, ranks):
    [rank] = ranks.start(tmp_path)
    executor = executor_for(tmp_path, ledger=Ledger(shadow=True))
    verdicts = executor.submit([notice(), restore_notice("s")])
    assert [v.action for v in verdicts] == ["rollback", "restore"]
    assert requests(tmp_path) == []
    log = actions_log(tmp_path)
    assert [e["type"] for e in log] == ["alert", "alert", "shadow_action", "shadow_action"]
    assert all(e["shadow"] for e in log if e["type"] == "alert")
    shadowed = [e for e in log if e["type"] == "shadow_action"]
    assert [(e["action"], e["source"], e["would_have"]) for e in shadowed] == [
        ("rollback", "alertmanager", True), ("restore", "alertmanager", True)]
    assert all(e["alertname"] and e["id"] and e["key"] for e in shadowed)      # its evidence
    assert executor.counts.executed == {} and executor.counts.shadowed == {"rollback": 1, "restore": 1}
    [family] = [f for f in executor.families() if f.name == "trainguard_actions_shadowed"]
    assert {s.labels["action"]: s.value for s in family.samples} == {"restore": 1, "rollback": 1}
    time.sleep(0.2)
    assert alive(rank["pid"])


def test_restore_ends_this_hosts_proven_ranks_that_were_running_when_the_alert_began(tmp_path, ranks):
    hung = ranks.start(tmp_path, 4)
    alert_began = time.time() + 0.01
    rewrite(tmp_path, 2, started_at=alert_began + 1)                 # restarted after the alert began
    rewrite(tmp_path, 3, host="other-node")
    executor = executor_for(tmp_path, restore_grace_seconds=5)
    executor.submit([restore_notice(starts_at=alert_began)])
    action = actions_log(tmp_path)[-1]
    assert sorted(e["rank"] for e in action["ended"]) == [0, 1]
    # another host's rank is not this node's to end, nor listed (at 1,000 nodes: 7,992 entries an action)
    assert {s["rank"]: s["why"] for s in action["skipped"]} == {2: "started after the alert began"}
    assert action["refused"] == [] and action["outcome"] == "issued"
    for rank in hung[:2]:
        wait_dead(rank["pid"])
    assert requests(tmp_path)[0]["action"] == "restore"


def test_restore_ends_ranks_with_sigkill_by_default_and_the_launcher_restarts_them(tmp_path, ranks):
    [hung] = ranks.start(tmp_path, max_restarts=1)
    before = {"rank-0.json": (tmp_path / "control" / "ranks" / "rank-0.json").stat().st_mtime_ns}
    executor_for(tmp_path).submit([restore_notice("s")])
    wait_dead(hung["pid"])
    [again] = ranks.wait_registered(tmp_path, 1, before)
    assert again["pid"] != hung["pid"] and again["restarts_left"] == 0 and again["max_restarts"] == 1


def test_restore_with_a_grace_kills_a_rank_that_ignores_sigterm(tmp_path, ranks):
    [stubborn] = ranks.start(tmp_path, ignore_term=True)
    executor_for(tmp_path, restore_grace_seconds=0.3).submit([restore_notice()])
    time.sleep(0.2)
    assert alive(stubborn["pid"])            # SIGTERM ignored ...
    wait_dead(stubborn["pid"])               # ... SIGKILL after the grace


def test_restore_never_signals_a_reused_pid(tmp_path, ranks):
    [young] = ranks.start(tmp_path)
    rewrite(tmp_path, 0, create_time=young["create_time"] - 100)   # describes an older process with that pid
    executor = executor_for(tmp_path)
    executor.submit([restore_notice("s")])
    time.sleep(0.2)
    assert alive(young["pid"])
    assert [r["reason"] for r in actions_log(tmp_path)[-1]["refused"]] == ["start_time_mismatch"]


def test_a_restarted_agent_acts_on_nothing_twice(tmp_path):
    Executor(tmp_path, "n1", Ledger(Limits(cooldown_seconds=120))).submit(
        [notice(key="a"), notice("CostBudgetStop", actions.COST_STOP, "c")])
    again = Executor(tmp_path, "n1", Ledger(Limits(cooldown_seconds=120)))
    outcomes = [v.outcome for v in again.submit([notice(key="a"), notice(key="b"),
                                                 notice("CostBudgetWarn", actions.COST_WARN, "w")])]
    assert outcomes == ["duplicate", "coalesced", "superseded"]
    assert len(requests(tmp_path)) == 2


def test_an_action_decided_but_not_done_before_a_crash_is_redone_once(tmp_path):
    executor = Executor(tmp_path, "n1", Ledger())
    [verdict] = executor.ledger.decide_all([notice()], now=time.time())
    executor.records.append([alert_record(verdict, time.time(), executor.node)])     # crash right after the intent
    assert requests(tmp_path) == []
    recovered = Executor(tmp_path, "n1", Ledger())
    assert [r["id"] for r in requests(tmp_path)] == [request_id(verdict)]
    assert recovered.recover() == 0
    assert len(requests(tmp_path)) == 1


def test_a_torn_last_line_does_not_stop_recovery(tmp_path):
    Executor(tmp_path, "n1", Ledger()).submit([notice(key="a")])
    with open(tmp_path / "tls" / "node-n1-actions.jsonl", "ab") as handle:
        handle.write(b'{"timestamp": 1, "event": {"type": "al')
    again = Executor(tmp_path, "n1", Ledger())
    assert again.submit([notice(key="a")])[0].outcome == "duplicate"


def test_verdicts_and_actions_are_counted_for_metrics(tmp_path):
    executor = Executor(tmp_path, "n1", Ledger())
    executor.submit([notice(key="a"), notice(key="a"), notice("GPUOverheating", None, "g")])
    verdicts, executed, *_ = executor.families()
    assert {s.labels["outcome"]: s.value for s in verdicts.samples} == {"act": 1, "duplicate": 1, "no_action": 1}
    assert {s.labels["action"]: s.value for s in executed.samples} == {"rollback": 1}


def test_event_log_fsyncs_whole_records(tmp_path):
    log = ActionLog(tmp_path / "x.jsonl", b"k" * 32, "n1")
    log.append([{"timestamp": 1.0, "event": {"type": "alert", "key": "k"}}])
    log.append([])
    assert [e["key"] for e in log.events()] == ["k"]


def test_a_decision_appended_to_the_actions_log_by_anyone_else_is_not_redone(tmp_path):
    """`recover()` redoes what the log says was decided and not done. A stranger's line there (a
    cost_stop "decided before a restart") was carried out at the agent's next start, signed by the agent."""
    Executor(tmp_path, "n1", Ledger()).submit([notice("CostBudgetWarn", actions.COST_WARN, "c1")])
    forged = {"timestamp": 1.0, "node": "n1", "event": {
        "type": "alert", "alertname": "CostBudgetStop", "status": "firing", "outcome": "act", "action": "cost_stop",
        "requested": "cost_stop", "key": "embedded:cost_stop", "source": "embedded", "reason": "over budget",
        "request_id": "cost-cost_stop", "decided_at": 1.0}}
    with open(tmp_path / "tls" / "node-n1-actions.jsonl", "a") as handle:
        handle.write(json.dumps(forged) + "\n")
    restarted = Executor(tmp_path, "n1", Ledger())
    assert [r["action"] for r in requests(tmp_path)] == ["cost_warn"]          # no cost_stop issued
    assert restarted.records.refused == {"unsigned": 1}
    families = {f.name: f for f in restarted.families()}
    assert [(s.labels, s.value) for s in families["trainguard_action_records_refused"].samples] == \
        [({"reason": "unsigned"}, 1.0)]


def test_a_wall_clock_stepped_since_the_registration_does_not_unprove_the_rank(tmp_path, ranks):
    """The suite's hung run stayed hung: the wall clock stepped 2.00 s between the ranks' registration and
    the agent's restore, psutil's create_time (start tick since boot + btime) moved with it, and both ranks
    were refused as `start_time_mismatch`. Registered with the btime it read against, a rank's start is
    compared since boot: a registration written 2 s behind the clock now is the same process; one whose
    start since boot differs is still another."""
    [hung] = ranks.start(tmp_path)
    registered = json.loads((tmp_path / "control" / "ranks" / "rank-0.json").read_text())
    assert registered["boot_time"] > 0
    stepped = {key: registered[key] - 2.0 for key in ("create_time", "launcher_create_time", "boot_time",
                                                      "supervisor_create_time") if key in registered}
    rewrite(tmp_path, 0, **stepped)                 # every start time it read, 2 s behind today's clock
    executor_for(tmp_path).submit([restore_notice("stepped")])
    wait_dead(hung["pid"])


def test_a_start_since_boot_that_differs_is_another_process_whatever_the_boot_time_says(tmp_path, ranks):
    [young] = ranks.start(tmp_path)
    registered = json.loads((tmp_path / "control" / "ranks" / "rank-0.json").read_text())
    rewrite(tmp_path, 0, create_time=young["create_time"] - 100, boot_time=registered["boot_time"])
    executor_for(tmp_path).submit([restore_notice("reused")])
    time.sleep(0.2)
    assert alive(young["pid"])
    assert [r["reason"] for r in actions_log(tmp_path)[-1]["refused"]] == ["start_time_mismatch"]
