"""A waiting hot spare advertises itself (trainer/spare.py `Advertiser`, trainguard/spares.py): a signed advert
whose heartbeat it refreshes while it waits, withdrawn when it joins, is cordoned, the job completes, or
its wait is ended. Unit level, on the spare's poll loop with a fake clock."""

from __future__ import annotations

import pytest

from tests.trainer.test_spare import Polls, cordon_node, joined
from trainguard import event_types, rundir, spares, tls
from trainguard.runtime.checkpoint import keys
from trainguard.runtime.cordon_key import checker
from trainguard.trainer import spare



@pytest.fixture
def run(tmp_path):
    path = tmp_path / "run"
    (path / "tls").mkdir(parents=True)
    joined(path, "n1", "n2")
    return path


def wait(run, polls):
    return spare.wait_for_vacancy(run, "n3", checker, clock=polls.clock, sleep=polls.sleep)


def seen(run, polls):
    """The adverts as an agent would check them at the fake clock's time: host -> (refused, heartbeat)."""
    return {a.host: (a.refused, a.record.get("heartbeat_at")) for a in spares.read_adverts(run, checker(), polls.now)}


def test_the_spare_advertises_while_it_waits_refreshes_its_heartbeat_and_withdraws_when_it_joins(run, key_file):
    beats = []
    polls = Polls()
    steps = [lambda: beats.append(seen(run, polls)) for _ in range(6)]
    polls.actions = steps + [lambda: cordon_node(run, "n2", key_file)]
    outcome = wait(run, polls)
    assert outcome.vacancy.node == "n2"
    # Heartbeats every REFRESH_SECONDS (2 s: every 4 polls of 0.5 s), each counted when it was read.
    assert [b["n3"] for b in beats] == [(None, 1000.0)] * 4 + [(None, 1002.0)] * 2
    assert not rundir.spare_advert_path(run, "n3").exists()          # joining: withdrawn
    assert spares.read_adverts(run, checker(), polls.now) == []


def test_a_cordoned_spare_withdraws_its_advert(run, key_file):
    polls = Polls(lambda: None, lambda: cordon_node(run, "n3", key_file))
    assert wait(run, polls).cordoned
    assert not rundir.spare_advert_path(run, "n3").exists()


def test_a_spare_whose_job_completed_withdraws_its_advert(run, key_file):
    def complete():
        assert rundir.spare_advert_path(run, "n3").exists()
        record = {**tls.event(event_types.RUN_END, reason="completed", step=10), "rank": 0}
        rundir.rank_log(run, 0).write_bytes(tls.encode(record))

    assert wait(run, Polls(complete)).completed
    assert not rundir.spare_advert_path(run, "n3").exists()


def test_a_spare_ended_while_it_waits_withdraws_its_advert(run, key_file):
    class Ended(BaseException):      # the launcher's SignalException on SIGTERM
        pass

    def end():
        assert rundir.spare_advert_path(run, "n3").exists()
        raise Ended

    with pytest.raises(Ended):
        wait(run, Polls(end))
    assert not rundir.spare_advert_path(run, "n3").exists()


def test_without_a_key_the_spare_waits_unadvertised_and_says_so_once(run, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(keys.ENV_VAR, str(tmp_path / "absent.key"))
    outcome = wait(run, Polls(*[lambda: None] * 5, lambda: rundir.rank_log(run, 0).write_bytes(tls.encode(
        {**tls.event(event_types.RUN_END, reason="completed", step=1), "rank": 0}))))
    assert outcome.completed
    assert not rundir.spare_adverts_dir(run).exists()
    said = capsys.readouterr()
    assert (said.out + said.err).count("cannot advertise") == 1
