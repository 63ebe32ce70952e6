"""The rank's side of an agent's in-process recovery request (runtime/resilience/request.py): only a request
signed with the run's key is taken, once; and a rank hung outside any collective is interrupted so that it
joins the recovery (two real processes on a gloo group). The agent's side: tests/agent/test_restore_in_process.py;
the whole path, agents and all: tests/culprit/test_two_nodes_culprit.py (eviction off)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.servers import free_port, wait_for
from trainguard import event_types, rundir, signed
from trainguard.runtime.resilience import request as requests
from trainguard.runtime.resilience.inprocess import ProcessGroups

KEY = b"k" * 32
ROOT = Path(__file__).resolve().parents[2]


class Log:
    def __init__(self):
        self.lines: list[tuple[str, str, dict]] = []

    def __getattr__(self, level):
        return lambda message, **fields: self.lines.append((level, message, fields))


def run_dir(tmp_path) -> Path:
    found = tmp_path / "run"
    found.mkdir()
    return found


def watch(run, clock=None, rank=0):
    log, events = Log(), []
    found = requests.RequestWatch(run, KEY, rank, log=log, emit=lambda kind, **f: events.append((kind, f)),
                                  clock=clock or time.time, monotonic=iter(range(0, 10**6, 10)).__next__)
    return found, log, events


def ask(run, request_id, key=KEY, issued_at=None, **changes) -> dict:
    record = requests.sign(key, run, request_id, by="agent:n1", reason="stalled", culprit_rank=1,
                           issued_at=issued_at or time.time() + 1)
    record.update(changes)
    assert requests.write(run, record)
    return record


def test_a_signed_request_is_taken_once_and_acknowledged(tmp_path):
    run = run_dir(tmp_path)
    rank, log, events = watch(run, rank=2)
    assert rank.poll() is None                                         # no directory yet: nothing
    record = ask(run, "restore-step25-attempt0")
    taken = rank.poll()
    assert taken == record and taken["culprit_rank"] == 1
    assert requests.acknowledged(run, "restore-step25-attempt0") == {2}
    assert [kind for kind, _ in events] == [event_types.RECOVERY_REQUEST]
    assert events[0][1]["request"] == "restore-step25-attempt0" and events[0][1]["by"] == "agent:n1"
    assert rank.poll() is None                                         # served: never taken again
    assert not requests.write(run, record)                            # one request per id: a second agent joins


def test_a_forged_or_copied_request_is_refused_loudly_and_taken_by_no_rank(tmp_path):
    run = run_dir(tmp_path)
    rank, log, events = watch(run)
    ask(run, "unsigned", signature=None)
    ask(run, "other-key", key=b"x" * 32)
    ask(run, "changed", reason="something else")                       # changed after it was signed
    copied = requests.sign(KEY, run, "original", by="agent:n1", issued_at=time.time() + 1)
    requests.request_path(run, "copy").parent.mkdir(parents=True, exist_ok=True)
    requests.request_path(run, "copy").write_text(json.dumps(copied))
    requests.request_path(run, "garbage").write_text("{not json")
    assert rank.poll() is None
    refused = {f["file"]: f["reason"] for kind, f in events if kind == event_types.RECOVERY_REQUEST_REFUSED}
    assert refused == {"unsigned.json": signed.UNSIGNED, "other-key.json": signed.BAD_SIGNATURE,
                       "changed.json": signed.BAD_SIGNATURE, "copy.json": signed.NOT_BOUND,
                       "garbage.json": signed.UNREADABLE}
    assert sum(level == "error" for level, _, _ in log.lines) == 5
    assert not any(p.name.endswith(".ack") for p in rundir.recovery_requests_dir(run).iterdir())
    assert rank.poll() is None and len(events) == 5                    # said once per file, not every read


def test_a_request_from_before_this_process_or_its_last_recovery_is_served(tmp_path):
    run = run_dir(tmp_path)
    now = [1000.0]
    rank, _, events = watch(run, clock=lambda: now[0])
    ask(run, "old", issued_at=999.0)                                   # to an earlier attempt of the job
    assert rank.poll() is None and events == []
    ask(run, "a", issued_at=1001.0)
    ask(run, "b", issued_at=1002.0)                                    # two agents of one stall: the newest
    assert rank.poll()["id"] == "b" and rank.poll() is None
    now[0] = 1010.0
    rank.settled()                                                     # a recovery ended at 1010
    ask(run, "late", issued_at=1005.0)
    assert rank.poll() is None
    ask(run, "next", issued_at=1011.0)
    assert rank.poll()["id"] == "next"


def test_a_request_is_written_as_the_generations_fault_and_aborts(tmp_path):
    import torch.distributed as dist

    run = run_dir(tmp_path)
    store = dist.HashStore()
    groups = ProcessGroups(store, "gloo", 0, 2, timeout=None, barrier_seconds=5, log=Log())
    groups.requests, _, _ = watch(run)
    assert not groups._requested(0)
    ask(run, "restore-x")
    assert groups._requested(0)
    fault = json.loads(store.get("trainguard/recovery/0/fault"))
    assert fault == {"rank": 1, "request": "restore-x", "cause": "the agent's request restore-x: stalled"}
    store.add("trainguard/recovery/0/arrived", 1)                      # the other rank is at the barrier
    groups.form = lambda: None
    found = groups.recover(RuntimeError("Connection closed by peer"))
    assert found["request"] == "restore-x" and found["failed_rank"] == 1 and found["generation"] == 1


def test_the_interrupt_raises_only_when_armed_and_not_during_a_recovery():
    interrupt = requests.MainThreadInterrupt.install()
    try:
        interrupt._handle(0, None)                                     # a stray signal: nothing
        interrupt.armed = True
        try:
            raise RuntimeError("a collective failed")
        except RuntimeError:
            interrupt._handle(0, None)                                 # on its way into the recovery: nothing
        with pytest.raises(requests.RecoveryInterrupted):
            interrupt._handle(0, None)
        assert not interrupt.armed
    finally:
        import signal

        signal.signal(requests.INTERRUPT_SIGNAL, signal.SIG_DFL)


RANK = """
import json, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from trainguard.runtime.resilience.inprocess import ProcessGroups
from trainguard.runtime.resilience.request import RequestWatch

class Log:
    def __getattr__(self, level):
        return lambda message, **fields: print(level, message, json.dumps(fields, default=str), file=sys.stderr,
                                               flush=True)

rank, port, run = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
groups = ProcessGroups(store, "gloo", rank, 2, timeout=timedelta(minutes=5), barrier_seconds=60, log=Log())
groups.form()
groups.watch()
groups.requests = RequestWatch(run, b"k" * 32, rank, log=Log())
dist.all_reduce(torch.ones(1))
print("ready", flush=True)
try:
    if rank == 0:
        while True:                   # the `hang` fault: stuck outside any collective
            time.sleep(3600)
    dist.all_reduce(torch.ones(1))    # blocked: rank 0 never joins
except Exception as failure:
    found = groups.recover(failure)
    total = torch.ones(1)
    dist.all_reduce(total)            # the re-formed group works
    print(json.dumps({"failure": type(failure).__name__, "request": found.get("request"),
                      "generation": found["generation"], "sum": total.item()}), flush=True)
groups.close()
dist.destroy_process_group()
"""


@pytest.mark.timeout(400)
def test_a_hung_rank_is_interrupted_and_both_recover_in_the_same_processes(tmp_path):
    """Rank 0 sleeps forever (no collective), rank 1 waits in an all-reduce for it: a forged request moves
    neither; the signed one releases rank 1 (abort) and interrupts rank 0, and the group re-forms."""
    run, port = run_dir(tmp_path), free_port()
    outs = [tmp_path / f"rank-{r}.out" for r in range(2)]
    errs = [tmp_path / f"rank-{r}.err" for r in range(2)]
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(port), str(run)], cwd=ROOT,
                              stdout=open(outs[r], "w"), stderr=open(errs[r], "w")) for r in range(2)]
    try:
        wait_for(lambda: all("ready" in out.read_text() for out in outs), timeout=120, interval=0.2,
                 message="both ranks formed their group")
        ask(run, "forged", key=b"x" * 32)
        wait_for(lambda: all("recovery request refused" in err.read_text() for err in errs), timeout=60,
                 interval=0.2, message="both watchers refused the forged request")
        assert [rank.poll() for rank in ranks] == [None, None]
        assert requests.acknowledged(run, "forged") == set()
        ask(run, "restore-step7-attempt0")
        codes = [rank.wait(timeout=120) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert codes == [0, 0], [err.read_text()[-2000:] for err in errs]
    results = [json.loads(out.read_text().splitlines()[-1]) for out in outs]
    assert results[0]["failure"] == "RecoveryInterrupted"
    assert results[1]["failure"] != "RecoveryInterrupted"              # released from the collective by the abort
    assert {r["request"] for r in results} == {"restore-step7-attempt0"}
    assert all(r["generation"] == 1 and r["sum"] == 2.0 for r in results)
    assert requests.acknowledged(run, "restore-step7-attempt0")        # one taker is enough: the store tells the rest
    assert "interrupting it" in errs[0].read_text()


def test_a_request_issued_before_a_recovery_ended_is_served_by_it_not_taken_again(tmp_path):
    """Seen in the bench: rank 2 saw another rank's fault in the store first, re-formed, then read the same
    request and started a second recovery. A request issued before the abort (or while the group re-forms)
    is the one this recovery serves."""
    import torch.distributed as dist

    run = run_dir(tmp_path)
    store = dist.HashStore()
    groups = ProcessGroups(store, "gloo", 2, 4, timeout=None, barrier_seconds=5, log=Log())
    groups.requests, _, events = watch(run)
    ask(run, "restore-y", issued_at=time.time() - 0.5)
    groups.requests.since = time.time() - 1                            # the process began before the request
    store.set("trainguard/recovery/0/fault", json.dumps({"rank": 1, "request": "restore-y", "cause": "x"}))
    assert groups.abort(0)                                             # the watcher saw the store's fault first
    assert not groups._requested(0)                                    # mid-recovery: nothing is taken
    store.add("trainguard/recovery/0/arrived", 3)
    groups.form = lambda: None
    groups.recover(RuntimeError("Connection closed by peer"))
    assert not groups._requested(1) and events == []                   # served: generation 1 stays healthy


def test_a_signal_not_ours_goes_to_the_handler_the_loop_had():
    import signal

    seen = []
    before = signal.signal(requests.INTERRUPT_SIGNAL, lambda signum, frame: seen.append(signum))
    try:
        interrupt = requests.MainThreadInterrupt.install()
        interrupt._handle(requests.INTERRUPT_SIGNAL, None)
        assert seen == [requests.INTERRUPT_SIGNAL]
    finally:
        signal.signal(requests.INTERRUPT_SIGNAL, before)
