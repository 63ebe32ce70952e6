"""Hot spare nodes (trainer/spare.py): what wakes a spare, what never does, and the cordon check before each
rendezvous round. Unit level: the run directory, signed cordons, a fake rendezvous handler; no torch launcher
(tests/e2e/test_spare_node.py runs the whole thing)."""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.agent.test_cordon_signed import forge
from trainguard import cli, cordon, event_types, rundir, tls
from trainguard.runtime.checkpoint import keys
from trainguard.runtime.cordon_key import checker, write_cordon
from trainguard.trainer import launch, spare



@pytest.fixture
def run(tmp_path):
    path = tmp_path / "run"
    (path / "tls").mkdir(parents=True)
    return path


def joined(run, *hosts):
    """The job's nodes, as their launchers record themselves."""
    for host in hosts:
        path = rundir.launcher_path(run, host)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"host": host, "pid": 1, "started_at": 0, "min_nodes": 1, "max_nodes": 2}))


def cordon_node(run, host, key_file, **fields):
    return write_cordon(run, host, keys.load_key(key_file), incident=None, reason="node_risk", by=f"agent:{host}",
                        **fields)


def test_an_honoured_cordon_of_a_node_of_the_job_is_a_vacancy_and_one_spare_claims_it(run, key_file):
    joined(run, "n1", "n2")
    assert spare.vacancies(run, "n3", checker()) == []
    cordon_node(run, "n2", key_file)
    [vacancy] = spare.vacancies(run, "n3", checker())
    assert (vacancy.node, vacancy.reason) == ("n2", "node_risk")
    assert vacancy.cordon_id == json.loads(rundir.cordon_path(run, "n2").read_text())["cordon_id"]
    assert spare.claim(run, vacancy, "n3") is True
    assert spare.claim(run, vacancy, "n4") is False              # a second spare does not take it too
    assert spare.vacancies(run, "n4", checker()) == []
    assert json.loads(spare.claim_path(run, vacancy).read_text())["spare"] == "n3"


@pytest.mark.parametrize("make", ["unsigned", "forged", "expired", "not_of_the_job"])
def test_a_cordon_that_is_not_honoured_or_not_of_the_job_wakes_no_spare(run, key_file, make):
    joined(run, "n1", "n2")
    if make == "unsigned":
        forge(run, "n2", reason="node_risk")
    elif make == "forged":
        write_cordon(run, "n2", os.urandom(32), incident=None, reason="node_risk", by="stranger")
    elif make == "expired":
        cordon_node(run, "n2", key_file, lifetime_seconds=-1.0)
    else:
        cordon_node(run, "n9", key_file)                         # a node that never joined this job
    assert spare.vacancies(run, "n3", checker()) == []


def test_a_revoked_cordon_put_back_wakes_no_spare(run, key_file):
    joined(run, "n1", "n2")
    copy = cordon_node(run, "n2", key_file).read_bytes()
    assert cli.main(["uncordon", str(run), "n2"]) == 0
    rundir.cordon_path(run, "n2").write_bytes(copy)
    assert cordon.read_one(run, "n2", checker()).refused == cordon.REVOKED
    assert spare.vacancies(run, "n3", checker()) == []


class Polls:
    """A clock and a sleep that run `actions[i]` at the i-th poll instead of sleeping."""

    def __init__(self, *actions):
        self.actions, self.now, self.polls = list(actions), 1000.0, 0

    def clock(self):
        return self.now

    def sleep(self, seconds):
        self.polls += 1
        self.now += seconds
        if self.actions:
            self.actions.pop(0)()
        elif self.polls > 50:
            raise AssertionError("the spare kept waiting")


def wait(run, polls):
    return spare.wait_for_vacancy(run, "n3", checker, clock=polls.clock, sleep=polls.sleep)


def test_the_spare_waits_until_the_cordon_and_then_joins_in_its_place(run, key_file):
    joined(run, "n1", "n2")
    polls = Polls(lambda: None, lambda: cordon_node(run, "n2", key_file))
    outcome = wait(run, polls)
    assert outcome.vacancy.node == "n2" and not outcome.cordoned and not outcome.completed
    assert polls.polls == 2 and outcome.waited_seconds == 2 * spare.POLL_SECONDS
    path = spare.record_joined(run, "n3", outcome)
    [record] = tls.read_records(path)
    assert record["event"]["type"] == event_types.SPARE_JOINED and record["node"] == "n3"
    assert record["event"]["replaces"] == "n2" and record["event"]["cordon_reason"] == "node_risk"


def test_a_forged_cordon_never_wakes_the_spare_and_it_ends_when_the_job_completes(run, key_file):
    joined(run, "n1", "n2")

    def complete():
        record = {**tls.event(event_types.RUN_END, reason="completed", step=10), "rank": 0}
        with open(rundir.rank_log(run, 0), "ab") as handle:
            handle.write(tls.encode(record))

    polls = Polls(lambda: write_cordon(run, "n2", os.urandom(32), incident=None, reason="x", by="stranger"),
                  lambda: None, complete)
    outcome = wait(run, polls)
    assert outcome.completed and outcome.vacancy is None
    assert not spare.claim_path(run, spare.Vacancy("n2", "x", "", 0.0)).parent.exists()


def test_an_earlier_completed_run_does_not_end_a_spare_started_after_it(run, key_file):
    record = {**tls.event(event_types.RUN_END, reason="completed", step=10), "rank": 0}
    record["timestamp"] = time.time() - 3600
    rundir.rank_log(run, 0).write_bytes(tls.encode(record))
    assert spare.job_completed(run, time.time()) is False
    assert spare.job_completed(run, time.time() - 7200) is True


def test_a_spare_that_is_itself_cordoned_does_not_join(run, key_file, monkeypatch):
    joined(run, "n1", "n2")
    cordon_node(run, "n2", key_file)
    cordon_node(run, "n3", key_file)
    outcome = wait(run, Polls())
    assert outcome.cordoned and outcome.vacancy is None
    monkeypatch.setenv("TRAINGUARD_NODE", "n3")
    assert launch.wait_as_spare(run, None) == launch.EXIT_CORDONED
    assert not rundir.spare_claims_dir(run).exists()             # n2's place is left for another spare


def test_launchers_wait_as_spare_returns_the_node_it_replaces_and_records_it(run, key_file, monkeypatch):
    monkeypatch.setenv("TRAINGUARD_NODE", "n3")
    joined(run, "n1", "n2")
    cordon_node(run, "n1", key_file)
    assert launch.wait_as_spare(run, None) == "n1"
    path = launch.write_launcher_file(run, launch.Nodes(1, 2), replaces="n1")
    assert json.loads(path.read_text())["spare"] is True and json.loads(path.read_text())["replaces"] == "n1"
    [record] = tls.read_records(rundir.launcher_log(run, "n3"))
    assert record["event"]["replaces"] == "n1"


# ------------------------------------------------------------------ the cordon check at each rendezvous

class FakeHandler:
    """torch's DynamicRendezvousHandler as GuardedRendezvous uses it: the public calls, and the exit operation
    run through its operation executor."""

    def __init__(self):
        self.calls = []
        self._op_executor = self

    def run(self, op, deadline):
        self.calls.append(type(op).__name__)

    def next_rendezvous(self):
        self.calls.append("next")
        return "round"

    def shutdown(self):
        self.calls.append("shutdown")
        return True

    def _stop_heartbeats(self):
        self.calls.append("stop_heartbeats")


def test_a_cordoned_node_leaves_the_rendezvous_without_closing_it():
    cordoned = [False]
    guarded = spare.make_guarded(FakeHandler(), lambda: cordoned[0])
    assert guarded.next_rendezvous() == "round" and guarded.get_backend() == spare.BACKEND
    cordoned[0] = True
    with pytest.raises(spare.Cordoned):
        guarded.next_rendezvous()
    assert guarded.left and guarded.inner.calls == ["next", "stop_heartbeats", "_RendezvousExitOp"]
    assert guarded.shutdown() is True and "shutdown" not in guarded.inner.calls   # the job's rendezvous stays open


def test_a_node_that_is_not_cordoned_shuts_down_as_torch_does():
    guarded = spare.make_guarded(FakeHandler(), lambda: False)
    assert guarded.shutdown() is True and guarded.inner.calls == ["shutdown"]


def test_the_cordon_watch_ends_the_launcher_once_the_cordon_is_honoured():
    state, fired = [False], []
    watch = spare.CordonWatch(lambda: state[0], lambda: fired.append(1), poll_seconds=0.01).start()
    time.sleep(0.05)
    assert fired == []
    state[0] = True
    deadline = time.time() + 10
    while not fired and time.time() < deadline:
        time.sleep(0.01)
    watch.stop()
    assert fired == [1] and watch.fired


def test_honoured_cordon_is_quiet_about_a_forged_one(run, key_file, monkeypatch, capsys):
    monkeypatch.setenv("TRAINGUARD_NODE", "n2")
    assert launch.honoured_cordon(run) is False
    forge(run, "n2", reason="x")
    assert launch.honoured_cordon(run) is False
    assert capsys.readouterr().err == "" and not rundir.launcher_log(run, "n2").exists()
    cordon_node(run, "n2", key_file)
    assert launch.honoured_cordon(run) is True


# ----------------------------------------------------------------------------------------- the flag

@pytest.mark.parametrize("flags, message", [
    ([], "--spare needs --nnodes"),
    (["--nnodes", "1"], "a spare takes the place of another node"),
])
def test_spare_without_a_multi_node_job_is_bad_input(tmp_path, capsys, flags, message):
    code = cli.main(["train", "--run-dir", str(tmp_path / "run"), "--spare", *flags])
    assert code == 2 and message in capsys.readouterr().err
