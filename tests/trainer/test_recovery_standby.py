"""Warm standbys (runtime/resilience/standby.py): the supervisor, the hand-over to a standby, the barrier's
join, the rank's registration under a supervisor, and the agent's proof of such a rank.

Real processes throughout (fork, signals, a gloo group on loopback); the whole path through `trainguard
train` is tests/trainer/test_recovery_e2e.py's run (its SIGKILLed rank is replaced by its standby).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest

from tests.servers import free_port
from trainguard.agent import restore
from trainguard.node import node_name
from trainguard.rundir import read_rank_file, rank_file
from trainguard.runtime.resilience.inprocess import ProcessGroups

ROOT = Path(__file__).resolve().parents[2]

LOG = """
class Log:
    def __getattr__(self, level):
        return lambda event, **fields: print(json.dumps({"level": level, "event": event, **fields}),
                                             file=sys.stderr, flush=True)
"""

# A supervisor whose rank and standby only write files: argv OUT MODE MAX_PROMOTIONS STANDBYS.
# MODE: exit (the rank exits 7 once OUT/go exists), kill (the rank SIGKILLs itself; the promoted standby
# exits 5 once OUT/go exists), kill-twice (the promoted standby SIGKILLs itself too), sleep (both wait).
SUPERVISED = """
import json, os, signal, sys, time
from pathlib import Path
from trainguard.runtime.resilience.standby import Supervisor
""" + LOG + """
out, mode = Path(sys.argv[1]), sys.argv[2]

def wait_for_go():
    while not (out / "go").exists():
        time.sleep(0.02)

def run_rank():
    (out / f"rank-{os.getpid()}").write_text("")
    if mode == "exit":
        wait_for_go()
        return 7
    if mode.startswith("kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)
    return 0

def replace_rank(identity):
    (out / f"promoted-{os.getpid()}").write_text(json.dumps(identity))
    if mode == "kill-twice":
        os.kill(os.getpid(), signal.SIGKILL)
    wait_for_go()
    return 5

sys.exit(Supervisor(run_rank, replace_rank, max_promotions=int(sys.argv[3]), standbys=int(sys.argv[4]), log=Log(),
                    warm_modules=()).run())
"""

IDENTITY = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}


def python(tmp_path: Path, name: str, code: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    script = tmp_path / name
    script.write_text(textwrap.dedent(code))
    return subprocess.Popen([sys.executable, str(script), *args], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})})


def supervise(tmp_path: Path, mode: str, max_promotions: int = 3, standbys: int = 1) -> subprocess.Popen:
    return python(tmp_path, "supervised.py", SUPERVISED, str(tmp_path), mode, str(max_promotions), str(standbys),
                  env=IDENTITY)


def wait_until(condition, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        assert time.monotonic() < deadline, what
        time.sleep(0.02)
    return found


def children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return []


def gone(processes: list[psutil.Process]) -> bool:
    _, alive = psutil.wait_procs(processes, timeout=30)
    return not alive


def promoted(tmp_path: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(tmp_path.glob("promoted-*"))]


# ------------------------------------------------------------------------------------------ the supervisor

def test_the_ranks_exit_status_is_the_supervisors_and_the_unused_standby_ends_with_it(tmp_path):
    supervisor = supervise(tmp_path, "exit")
    rank_and_standby = wait_until(lambda: len(children(supervisor.pid)) == 2 and children(supervisor.pid),
                                  "the supervisor forks its rank and one standby")
    (tmp_path / "go").write_text("")
    assert supervisor.wait(timeout=60) == 7, supervisor.stderr.read()
    assert gone(rank_and_standby) and promoted(tmp_path) == []


def test_a_killed_rank_is_replaced_by_its_standby_which_takes_its_identity_and_a_new_standby_is_forked(tmp_path):
    supervisor = supervise(tmp_path, "kill")
    [identity] = wait_until(lambda: promoted(tmp_path), "the standby is promoted")
    assert identity == IDENTITY
    # the promoted standby and, forked after the hand-over, the next standby
    after = wait_until(lambda: len(children(supervisor.pid)) == 2 and children(supervisor.pid), "a new standby")
    promoted_pid = int(next(tmp_path.glob("promoted-*")).name.split("-")[1])
    assert promoted_pid in {child.pid for child in after}
    (tmp_path / "go").write_text("")
    assert supervisor.wait(timeout=60) == 5            # the promoted rank's exit status
    log = supervisor.stderr.read()
    assert "its standby takes its place" in log and '"signal": "SIGKILL"' in log
    assert gone(after)


def test_past_the_budget_a_killed_rank_ends_the_supervisor_by_the_same_signal(tmp_path):
    """What the launcher sees without a supervisor: a worker killed by SIGKILL, so it restarts every worker."""
    supervisor = supervise(tmp_path, "kill-twice", max_promotions=1)
    assert supervisor.wait(timeout=60) == -signal.SIGKILL
    assert len(promoted(tmp_path)) == 1
    assert "1 promotions (the budget) spent" in supervisor.stderr.read()


def test_without_a_standby_a_killed_rank_ends_the_supervisor_by_the_same_signal(tmp_path):
    supervisor = supervise(tmp_path, "kill", standbys=0)
    assert supervisor.wait(timeout=60) == -signal.SIGKILL
    assert promoted(tmp_path) == []
    assert "no standby" in supervisor.stderr.read()


def test_sigterm_reaches_the_rank_and_the_standby_and_nothing_is_promoted(tmp_path):
    supervisor = supervise(tmp_path, "sleep")
    rank_and_standby = wait_until(lambda: len(children(supervisor.pid)) == 2 and children(supervisor.pid),
                                  "the supervisor forks its rank and one standby")
    supervisor.send_signal(signal.SIGTERM)
    assert supervisor.wait(timeout=60) == -signal.SIGTERM
    assert gone(rank_and_standby) and promoted(tmp_path) == []


def test_the_rank_and_the_standby_die_with_their_supervisor(tmp_path):
    supervisor = supervise(tmp_path, "sleep")
    rank_and_standby = wait_until(lambda: len(children(supervisor.pid)) == 2 and children(supervisor.pid),
                                  "the supervisor forks its rank and one standby")
    supervisor.kill()
    supervisor.wait(timeout=60)
    assert gone(rank_and_standby)


@pytest.mark.slow     # imports torch._dynamo: seconds
def test_warming_up_starts_no_thread_the_forked_children_would_lack():
    code = ("import os, torch\nfrom trainguard.runtime.resilience import standby\n"
            "before = len(os.listdir('/proc/self/task'))\nstandby.warm_up()\n"
            "print(before, len(os.listdir('/proc/self/task')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    before, after = out.stdout.split()
    assert before == after, out.stderr


# -------------------------------------------------------------------------------- the barrier's join

class FakeLog:
    def __getattr__(self, level):
        return lambda *args, **kwargs: None


def groups_on(store, world: int, rank: int) -> ProcessGroups:
    groups = ProcessGroups(store, "gloo", rank, world, timeout=timedelta(seconds=5), barrier_seconds=5, log=FakeLog())
    groups.replacing = True
    return groups


def test_a_standby_joins_the_generation_whose_barrier_the_survivors_wait_at(monkeypatch):
    import torch.distributed as dist

    store = dist.HashStore()
    # generation 0 recovered (both arrived); in generation 1 the survivor reported a failure and waits
    store.set("trainguard/recovery/0/fault", json.dumps({"rank": 0, "cause": "earlier"}))
    store.add("trainguard/recovery/0/arrived", 2)
    store.set("trainguard/recovery/1/fault", json.dumps({"rank": 0, "cause": "Connection reset by peer"}))
    store.add("trainguard/recovery/1/arrived", 1)
    groups = groups_on(store, 2, 1)
    formed = []
    monkeypatch.setattr(groups, "form", lambda: formed.append(groups.generation))
    monkeypatch.setattr(groups, "watch", lambda: formed.append("watching"))
    timings = groups.join("rank 1's process died")
    assert formed == [2, "watching"] and groups.generation == 2 and not groups.replacing
    assert store.add("trainguard/recovery/1/arrived", 0) == 2            # the survivor's barrier is met
    # the first word stands in the store; the rank that failed is the one replaced (a survivor reported
    # first only that its peer's connection closed)
    assert json.loads(store.get("trainguard/recovery/1/fault"))["rank"] == 0
    assert timings["failed_rank"] == 1 and timings["cause"] == "rank 1's process died"
    assert timings["first_reported"] == {"rank": 0, "cause": "Connection reset by peer"}


def test_the_survivors_name_the_rank_a_standby_replaced_not_the_one_that_reported_first(monkeypatch):
    """The soak's kills: the survivor whose collective broke first wrote the fault, and every survivor's
    `in_process_restart` named it as `failed_rank`; the standby's record, read past the barrier, names the dead rank."""
    import torch.distributed as dist

    store = dist.HashStore()
    store.set("trainguard/recovery/0/fault", json.dumps({"rank": 0, "cause": "Connection reset by peer"}))
    store.set("trainguard/recovery/0/replaced", json.dumps({"rank": 1, "cause": "rank 1's process died"}))
    store.add("trainguard/recovery/0/arrived", 1)                 # the standby is at the barrier
    survivor = ProcessGroups(store, "gloo", 0, 2, timeout=timedelta(seconds=5), barrier_seconds=5, log=FakeLog())
    monkeypatch.setattr(survivor, "abort", lambda generation: None)
    monkeypatch.setattr(survivor, "form", lambda: None)
    timings = survivor.recover(RuntimeError("Connection reset by peer"))
    assert (timings["failed_rank"], timings["cause"]) == (1, "rank 1's process died")
    assert timings["first_reported"]["rank"] == 0


def test_a_standby_that_arrives_first_reports_the_failure_for_the_survivors_watchers(monkeypatch):
    import torch.distributed as dist

    store = dist.HashStore()
    store.add("trainguard/recovery/0/arrived", 1)       # the survivor is at generation 0's barrier already
    groups = groups_on(store, 2, 1)
    monkeypatch.setattr(groups, "form", lambda: None)
    monkeypatch.setattr(groups, "watch", lambda: None)
    timings = groups.join("rank 1's process died; a standby took its place")
    assert json.loads(store.get("trainguard/recovery/0/fault")) == {
        "rank": 1, "cause": "rank 1's process died; a standby took its place"}
    assert timings["generation"] == 1 and timings["failed_rank"] == 1


def test_a_standby_whose_survivors_never_arrive_fails_the_recovery(monkeypatch):
    import torch.distributed as dist

    from trainguard.runtime.resilience.inprocess import RecoveryFailed

    groups = groups_on(dist.HashStore(), 2, 1)
    groups.barrier_seconds = 0.2
    monkeypatch.setattr(groups, "form", lambda: pytest.fail("formed without the survivors"))
    with pytest.raises(RecoveryFailed, match="1 of 2 ranks met"):
        groups.join("rank 1's process died")


# --------------------------------------------------------------------------------- the real hand-over

HANDOVER = """
import json, os, signal, sys, time
from datetime import timedelta
from pathlib import Path
import torch
import torch.distributed as dist
from trainguard.runtime.resilience.inprocess import ProcessGroups
from trainguard.runtime.resilience.standby import Supervisor
""" + LOG + """
out, rank = Path(sys.argv[1]), int(os.environ["RANK"])

def groups():
    return ProcessGroups.from_env("gloo", rank, 2, timeout=timedelta(seconds=60), barrier_seconds=60, log=Log())

def survivor():
    g = groups(); g.form(); g.watch()
    try:
        while True:                          # steps until the peer's process dies under the collective
            dist.all_reduce(torch.ones(1)); time.sleep(0.02)
    except Exception as exc:
        timings = g.recover(exc)
    total = torch.full((1,), 10.0); dist.all_reduce(total)
    (out / "survivor.json").write_text(json.dumps({"generation": g.generation, "sum": total.item()}))
    dist.barrier(); g.close(); dist.destroy_process_group()
    return 0

def doomed():
    g = groups(); g.form()
    for _ in range(3):
        dist.all_reduce(torch.ones(1))
    (out / "doomed").write_text(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGKILL)

def replacement(identity):
    g = groups(); g.replacing = True
    timings = g.join("rank 1's process died")
    total = torch.full((1,), 100.0); dist.all_reduce(total)
    (out / "replacement.json").write_text(json.dumps({"generation": g.generation, "sum": total.item(),
                                                       "identity": identity, "pid": os.getpid()}))
    dist.barrier(); g.close(); dist.destroy_process_group()
    return 0

if rank == 0:
    code = survivor()
else:
    code = Supervisor(doomed, replacement, max_promotions=1, log=Log(), warm_modules=()).run()
sys.stdout.flush(); os._exit(code)
"""


@pytest.mark.slow     # two processes on a gloo group
def test_a_standby_takes_a_killed_ranks_place_in_the_survivors_group(tmp_path):
    """Rank 1 (under its supervisor) is SIGKILLed mid-training; rank 0 never ends: it recovers in-process and
    its next collective is with rank 1's standby, in the re-formed group."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    ranks = [python(tmp_path, "handover.py", HANDOVER, str(tmp_path), env={**env, "RANK": str(rank)})
             for rank in range(2)]
    codes = [rank.wait(timeout=180) for rank in ranks]
    assert codes == [0, 0], [rank.stderr.read()[-3000:] for rank in ranks]
    survivor = json.loads((tmp_path / "survivor.json").read_text())
    replacement = json.loads((tmp_path / "replacement.json").read_text())
    assert survivor == {"generation": 1, "sum": 110.0}
    assert replacement["generation"] == 1 and replacement["sum"] == 110.0
    assert replacement["identity"]["RANK"] == "1" and replacement["pid"] != int((tmp_path / "doomed").read_text())


# ------------------------------------------------------------------ registration and the agent's proof

# A worker entry point (registered with the agent as this script) whose rank, forked by a supervisor,
# registers as the bundled trainer's ranks do, and waits.
SUPERVISED_RANK = """
import json, os, sys, time
from trainguard.runtime.control import write_rank_file
from trainguard.runtime.resilience.standby import Supervisor
""" + LOG + """
run_dir = sys.argv[sys.argv.index("--run-dir") + 1]

def rank():
    write_rank_file(run_dir, int(os.environ.get("RANK", "0")))
    time.sleep(300)
    return 0

if "--unsupervised" in sys.argv:
    sys.exit(rank())
sys.exit(Supervisor(rank, lambda identity: rank(), max_promotions=1, log=Log(), warm_modules=()).run())
"""

# The launcher the agent is told to trust (webhook.restore_launchers): it starts the worker and waits.
LAUNCHER = """
import subprocess, sys
sys.exit(subprocess.call([sys.executable, *sys.argv[1:]]))
"""


# what torch's elastic agent tells its workers: restarts are left, so a restore may end the rank
ELASTIC = {"TORCHELASTIC_RUN_ID": "standby-test", "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "0"}


@pytest.fixture
def tree(tmp_path):
    """launcher.py -> supervised_rank.py (the supervisor) -> its rank and standby; what the agent trusts."""
    run_dir = tmp_path / "run"
    (tmp_path / "supervised_rank.py").write_text(textwrap.dedent(SUPERVISED_RANK))
    started = []

    def start(*extra: str, under_launcher: bool = True) -> dict:
        worker = [str(tmp_path / "supervised_rank.py"), "--run-dir", str(run_dir), *extra]
        program = python(tmp_path, "launcher.py", LAUNCHER, *worker, env=ELASTIC) if under_launcher else \
            subprocess.Popen([sys.executable, *worker], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **ELASTIC})
        started.append(program)
        wait_until(lambda: rank_file(run_dir, 0).exists(), "the rank registers")
        return {"run_dir": run_dir, "top": program, "info": read_rank_file(rank_file(run_dir, 0)),
                "trust": restore.Trust.for_run(run_dir, entry_points=(str(tmp_path / "supervised_rank.py"),),
                                               launchers=("launcher.py",))}

    yield start
    for program in started:
        end_tree(program)


def end_tree(program: subprocess.Popen) -> None:
    try:
        family = psutil.Process(program.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    for process in family:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    program.kill()
    program.wait()


def test_a_supervised_rank_registers_its_launcher_and_its_supervisor(tree):
    started = tree()
    launcher = psutil.Process(started["top"].pid)
    [supervisor] = launcher.children()
    info = json.loads(rank_file(started["run_dir"], 0).read_text())
    assert info["pid"] in {child.pid for child in supervisor.children()}
    assert (info["launcher_pid"], info["supervisor_pid"]) == (launcher.pid, supervisor.pid)
    assert restore.same_tick(info["launcher_create_time"], launcher.create_time())


def test_the_agent_proves_a_supervised_rank_and_ends_its_supervisor_first(tree):
    started = tree()
    launcher = psutil.Process(started["top"].pid)
    [supervisor] = launcher.children()
    family = supervisor.children()                                   # the rank and its standby
    proof = restore.prove_rank(started["info"], started["trust"])
    assert (proof.process.pid, proof.launcher.pid, proof.supervisor.pid) == (
        started["info"].pid, launcher.pid, supervisor.pid)
    result = restore.end_local_ranks(started["run_dir"], node_name(), trust=started["trust"])
    assert result["ended"] == [{"rank": 0, "pid": started["info"].pid, "supervisor_pid": supervisor.pid}]
    # no standby took the rank's place: the supervisor is gone, and the launcher sees its worker die
    assert gone([supervisor, *family])
    assert started["top"].wait(timeout=60) != 0


def test_a_supervised_rank_without_a_launcher_is_still_refused_and_nothing_is_signalled(tree):
    started = tree(under_launcher=False)
    supervisor = psutil.Process(started["top"].pid)
    with pytest.raises(restore.Refused) as refused:
        restore.prove_rank(started["info"], started["trust"])
    assert refused.value.reason == "no_launcher"
    result = restore.end_local_ranks(started["run_dir"], node_name(), trust=started["trust"])
    assert result["ended"] == [] and [r["reason"] for r in result["refused"]] == ["no_launcher"]
    assert supervisor.is_running() and psutil.Process(started["info"].pid).is_running()


def test_a_parent_that_is_no_supervisor_of_this_run_is_never_signalled(tmp_path):
    """A rank under the launcher through a process that is not this run's worker entry point (a stranger's
    wrapper): the rank is proven and ended as before; its parent is left alone."""
    wrapper = tmp_path / "wrapper.py"
    # it outlives its child, as a shell would: whether it is signalled is what the test looks at
    wrapper.write_text("import subprocess, sys, time\nsubprocess.call([sys.executable, *sys.argv[1:]])\ntime.sleep(300)\n")
    run_dir = tmp_path / "run"
    (tmp_path / "supervised_rank.py").write_text(textwrap.dedent(SUPERVISED_RANK))
    program = python(tmp_path, "launcher.py", LAUNCHER, str(wrapper), str(tmp_path / "supervised_rank.py"),
                     "--run-dir", str(run_dir), "--unsupervised", env=ELASTIC)
    try:
        wait_until(lambda: rank_file(run_dir, 0).exists(), "the rank registers")
        # its launcher is the wrapper's parent (the registration names the parent: say which one it is)
        path = rank_file(run_dir, 0)
        path.write_text(json.dumps({**json.loads(path.read_text()), "launcher_pid": program.pid,
                                    "launcher_create_time": psutil.Process(program.pid).create_time()}))
        info = read_rank_file(path)
        trust = restore.Trust.for_run(run_dir, entry_points=(str(tmp_path / "supervised_rank.py"),),
                                      launchers=("launcher.py",))
        stranger = psutil.Process(info.pid).parent()
        proof = restore.prove_rank(info, trust)
        assert proof.supervisor is None and proof.launcher.pid == program.pid
        result = restore.end_local_ranks(run_dir, node_name(), trust=trust)
        assert result["ended"] == [{"rank": 0, "pid": info.pid}]
        assert stranger.is_running() and stranger.pid != program.pid
    finally:
        end_tree(program)
