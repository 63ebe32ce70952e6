"""The agent's `restore` in-process (agent/recover_in_process.py, the handler in agent/handlers.py): under
`recovery.mode: in_process` the ranks are asked, with a signed request, to recover in their own processes,
and none is ended when they do; when they do not, the restart path follows (the ranks ended, as before).
The ranks here are stand-ins: a thread reads the requests as a rank's watcher does (request.py) and writes
the `in_process_restart` event a recovered rank writes. The rank's side: tests/trainer/test_recovery_hang.py."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainguard import actions, event_types, rundir, tls
from trainguard.agent import handlers, recover_in_process, restore
from trainguard.agent.executor import Executor
from trainguard.decide.ledger import Ledger, Notice
from trainguard.runtime import cordon_key
from trainguard.runtime.checkpoint import keys
from trainguard.runtime.resilience import request as requests


class Log:
    def __getattr__(self, level):
        return lambda *args, **fields: None


def setup(tmp_path: Path, world: int = 2, mode: str = "in_process", barrier: float = 5.0):
    run = tmp_path / "run"
    (run / "tls").mkdir(parents=True)
    key_file = tmp_path / "key"
    cordon_key.signing_key(key_file, create=True)
    now = time.time()
    for rank in range(world):
        rundir.write_rank_file(run, rank, {"rank": rank, "pid": os.getpid(), "host": "n1", "started_at": now - 5})
        rundir.rank_log(run, rank).write_text(json.dumps({"step": 25, "metrics": {}}) + "\n")
    infos, _ = restore.read_ranks(run)
    ended = []
    node = SimpleNamespace(run_dir=run, node="n1", host="n1", clock=time.time, checkpoint_key_file=key_file,
                           recovery=SimpleNamespace(mode=mode, barrier_seconds=barrier), grace=0.0,
                           live=lambda verdict: infos, trust=lambda: None, count_refusal=lambda reason: None)
    verdict = SimpleNamespace(action=actions.RESTORE, reason="no step for 6 s",
                              notice=SimpleNamespace(starts_at=now, reason="no step for 6 s"))
    return run, node, verdict, ended


@pytest.fixture
def no_ending(monkeypatch):
    """The restart path's hands, recorded instead of signalling anything."""
    ended = []

    def end_local_ranks(run_dir, host, **kwargs):
        ended.append(host)
        return {"ended": [{"rank": 0, "pid": 1}], "skipped": [], "refused": []}
    monkeypatch.setattr(restore, "end_local_ranks", end_local_ranks)
    return ended


def ranks_recovering(run: Path, key: bytes, world: int, stop: threading.Event) -> threading.Thread:
    """Stand-in ranks: rank 0's watcher takes the request; every rank then records its recovery."""
    def serve():
        watch = requests.RequestWatch(run, key, 0, log=Log())
        while not stop.wait(0.05):
            taken = watch.poll()
            if taken is None:
                continue
            for rank in range(world):
                event = {"type": event_types.IN_PROCESS_RESTART, "request": taken["id"], "generation": 1,
                         "restored_step": 20, "steps_lost": 4}
                with rundir.rank_log(run, rank).open("a") as handle:
                    handle.write(json.dumps(tls.make_record(timestamp=time.time(), event=event)) + "\n")
            return
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_a_restore_asks_the_ranks_to_recover_in_process_and_ends_none(tmp_path, no_ending):
    run, node, verdict, _ = setup(tmp_path)
    key = cordon_key.signing_key(node.checkpoint_key_file)[0]
    stop = threading.Event()
    ranks_recovering(run, key, 2, stop)
    result = {}
    try:
        handlers.restore_ranks(node, verdict, result)
    finally:
        stop.set()
    assert no_ending == []                                             # no process ended
    assert result["recovery"] == "in_process" and result["ended"] == [] and result["refused"] == []
    record = result["in_process"]
    assert record["result"] == "recovered" and record["request"] == "restore-step25-attempt0"
    assert record["asked"] and record["ranks"] == [0, 1]
    assert record["restored_step"] == 20 and record["steps_lost"] == 4 and record["generation"] == 1
    written = requests.read(run, record["request"])
    assert requests.check(key, written, run, record["request"]) is None     # signed with the run's key
    assert written["by"] == "agent:n1" and written["reason"] == "no step for 6 s"
    assert written["key_id"] == keys.key_id(key)


def test_ranks_that_do_not_take_the_request_are_ended_as_before(tmp_path, no_ending, monkeypatch):
    monkeypatch.setattr(recover_in_process, "ACK_SECONDS", 0.3)
    run, node, verdict, _ = setup(tmp_path)
    result = {}
    handlers.restore_ranks(node, verdict, result)
    assert no_ending == ["n1"] and result["ended"] == [{"rank": 0, "pid": 1}]
    assert result["recovery"] == "restart"
    assert result["in_process"]["result"] == "failed"
    assert "no rank took the request" in result["in_process"]["why"]


def test_a_rank_that_took_it_but_never_recorded_its_recovery_is_ended_after_the_bound(tmp_path, no_ending,
                                                                                       monkeypatch):
    monkeypatch.setattr(recover_in_process, "RESULT_GRACE_SECONDS", 0.2)
    run, node, verdict, _ = setup(tmp_path, barrier=0.3)
    key = cordon_key.signing_key(node.checkpoint_key_file)[0]
    rundir.recovery_requests_dir(run).mkdir(parents=True)
    requests.acknowledge(run, "restore-step25-attempt0", 0, time.time())   # taken, then stuck at the barrier
    result = {}
    handlers.restore_ranks(node, verdict, result)
    assert no_ending == ["n1"] and result["recovery"] == "restart"
    assert "did not record the recovery within" in result["in_process"]["why"]
    assert requests.check(key, requests.read(run, "restore-step25-attempt0"), run, "restore-step25-attempt0") is None


def test_not_tried_in_restart_mode_for_a_world_of_one_or_during_an_eviction(tmp_path, no_ending):
    _, node, verdict, _ = setup(tmp_path / "restart", mode="restart")
    result = {}
    handlers.restore_ranks(node, verdict, result)
    assert no_ending == ["n1"] and "in_process" not in result and "recovery" not in result   # today's record

    run, node, verdict, _ = setup(tmp_path / "one", world=1)
    assert recover_in_process.why_not(node, verdict) == "a world of one rank: no process group to re-form"

    run, node, verdict, _ = setup(tmp_path / "evict")
    from trainguard.agent import evict

    evict.cordon(run, "n1", incident=None, reason="culprit", by="agent:n2", key_file=node.checkpoint_key_file)
    result = {}
    handlers.restore_ranks(node, verdict, result)
    assert result["in_process"]["result"] == "not_tried" and "eviction is under way" in result["in_process"]["why"]
    assert not rundir.recovery_requests_dir(run).exists()             # nothing asked


def test_two_agents_of_one_stall_wait_on_one_request_and_a_later_stall_gets_its_own(tmp_path):
    run, node, verdict, _ = setup(tmp_path)
    key = cordon_key.signing_key(node.checkpoint_key_file)[0]
    now = time.time()
    assert recover_in_process._ask(node, verdict, key, now) == ("restore-step25-attempt0", True)
    other = SimpleNamespace(**{**vars(node), "node": "n2"})
    assert recover_in_process._ask(other, verdict, key, now + 1) == ("restore-step25-attempt0", False)
    later = now + node.recovery.barrier_seconds + recover_in_process.RESULT_GRACE_SECONDS + 1
    assert recover_in_process._ask(node, verdict, key, later) == ("restore-step25-attempt0.1", True)


def test_shadow_mode_requests_nothing(tmp_path):
    run, node, _, _ = setup(tmp_path)
    executor = Executor(run, "n1", Ledger(shadow=True), checkpoint_key_file=node.checkpoint_key_file,
                        recovery=node.recovery)
    [verdict] = executor.submit([Notice(alertname="TrainingStalled", status="firing", action=actions.RESTORE,
                                        key="s@1", starts_at=time.time() + 5)])
    assert verdict.shadow and not rundir.recovery_requests_dir(run).exists()
