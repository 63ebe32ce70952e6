"""Ranks in pods: their own host name and PID namespace, matched to the node by the agent on the host.

A rank in a pod registers its pod's host name and a pid of its pod's PID namespace (runtime/control.py, as
anywhere). The agent, on the host, must find that process among the node's (agent/procfs.py
`PidNamespaces`), prove it and end exactly it, refuse an impostor with a reason, and say loudly when a
registration belongs to no known node. The end-to-end tests run real ranks under real torchrun inside
`unshare --pid --fork --mount-proc --uts` with another host name: what a pod is, to the kernel.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.alerts.ranks import STANDIN, TORCHRUN, alive
from trainguard import rundir
from trainguard.agent import procfs, restore

NODE = "node-1"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "--uts", "true"],
                          capture_output=True).returncode == 0


needs_namespaces = pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare(1) for PID/UTS namespaces")


class Pod:
    """A command in a new PID and UTS namespace with host name `host` (and HOSTNAME, as the kubelet sets it),
    and, in its own mount namespace, an /etc/hosts that resolves that name (a pod's, as the kubelet writes it:
    torchrun's rendezvous connects to its own host name)."""

    def __init__(self, host: str, command: list[str], scratch: Path, mounts: dict | None = None):
        hosts = scratch / f"hosts-{host}"
        hosts.write_text(f"127.0.0.1 localhost\n127.0.1.1 {host}\n")
        binds = "".join(f" && mount --bind {source} {target}" for source, target in (mounts or {}).items())
        script = f"hostname {host} && mount --bind {hosts} /etc/hosts{binds} && exec \"$@\""
        self.process = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", "--uts", "sh", "-c", script, "sh", *command],
            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, "HOSTNAME": host, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT})

    def stop(self) -> None:
        try:
            os.killpg(self.process.pid, 9)
        except ProcessLookupError:
            pass
        self.process.wait()


@pytest.fixture
def pods(tmp_path):
    started: list[Pod] = []

    def start(host, command, mounts=None):
        started.append(Pod(host, command, tmp_path, mounts))
        return started[-1]
    yield start
    for pod in started:
        pod.stop()


def wait_for(path: Path, timeout: float = 120) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            time.sleep(0.05)
    raise AssertionError(f"{path} not written in {timeout}s")


def in_pod(pod: Pod, words: str, timeout: float = 60) -> psutil.Process:
    """The pod's process whose command line holds `words` (the command, once exec'd), seen from the node."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for child in psutil.Process(pod.process.pid).children(recursive=True):
            try:
                if words in " ".join(child.cmdline()):
                    return child
            except psutil.Error:
                continue
        time.sleep(0.05)
    raise AssertionError(f"no process running {words!r} in the pod")


def innermost(pid: int) -> int:
    return procfs.read_nspid("/proc", pid)[-1]


@needs_namespaces
def test_a_rank_in_a_pod_is_this_nodes_proven_and_ended_exactly(tmp_path, pods):
    run = tmp_path / "run"
    run.mkdir()
    pods("pod-a", [*TORCHRUN, "--standalone", "--nproc-per-node=1", "--max-restarts=1", "--monitor-interval=0.5",
                   STANDIN, "--run-dir", str(run)])
    registered = wait_for(rundir.rank_file(run, 0))
    assert registered["host"] == "pod-a"                  # the pod's, not the node's

    [info] = rundir.RankFiles(run, {NODE}, adopt=procfs.PidNamespaces(run, NODE).adopt).read()
    assert (info.host, info.ns_host, info.ns_pid) == (NODE, "pod-a", registered["pid"])
    assert innermost(info.pid) == registered["pid"] and info.pid != registered["pid"]
    assert innermost(info.launcher_pid) == registered["launcher_pid"]
    assert procfs.RankPids(run, NODE).get() == {0: info.pid}          # what the collectors sample

    trust = restore.Trust.for_run(run, entry_points=(STANDIN,))
    proof = restore.prove_rank(info, trust)
    assert proof.process.pid == info.pid and proof.launcher.pid == info.launcher_pid
    assert json.loads(rundir.host_claim(run, "pod-a").read_text())["node"] == NODE

    bystander = subprocess.Popen(["sleep", "300"])        # a process of the node with the same uid: untouched
    try:
        result = restore.end_local_ranks(run, NODE, trust=trust)
        assert result["ended"] == [{"rank": 0, "pid": info.pid}] and result["refused"] == []
        deadline = time.time() + 30
        while alive(info.pid):
            assert time.time() < deadline, "the proven rank was not ended"
            time.sleep(0.05)
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


@needs_namespaces
def test_a_pod_that_mounts_the_run_directory_elsewhere_still_proves_its_rank(tmp_path, pods):
    """The pod names its run directory where its pod mounts it (/…/pod-view, empty on the node); the agent
    compares it through the rank's own root (/proc/<pid>/root), by inode, with the run it follows."""
    run, view = tmp_path / "run", tmp_path / "pod-view"
    run.mkdir()
    view.mkdir()
    pods("pod-m", [*TORCHRUN, "--standalone", "--nproc-per-node=1", "--max-restarts=1", "--monitor-interval=0.5",
                   STANDIN, "--run-dir", str(view)], mounts={run: view})
    wait_for(rundir.rank_file(run, 0))
    assert not any(view.iterdir())                      # on the node, the pod's path is an empty directory
    [info] = rundir.RankFiles(run, {NODE}, adopt=procfs.PidNamespaces(run, NODE).adopt).read()
    proof = restore.prove_rank(info, restore.Trust.for_run(run, entry_points=(STANDIN,)))
    assert proof.process.pid == info.pid
    with pytest.raises(restore.Refused) as refusal:     # another run directory is still another run
        other = tmp_path / "other"
        other.mkdir()
        restore.prove_rank(info, restore.Trust.for_run(other, entry_points=(STANDIN,)))
    assert refusal.value.reason == "other_run"


@needs_namespaces
def test_an_impostor_in_another_pod_is_matched_then_refused_never_signalled(tmp_path, pods):
    """A process in a pod registers itself as rank 1: it is this node's process, but no worker of the run."""
    run = tmp_path / "run"
    run.mkdir()
    code = ("import sys, time; from trainguard.runtime.control import write_rank_file; "
            "write_rank_file(sys.argv[1], 1); time.sleep(300)")
    pods("pod-b", [sys.executable, "-c", code, str(run)])
    registered = wait_for(rundir.rank_file(run, 1))
    infos, _ = restore.host_ranks(run, NODE)
    [info] = infos
    assert info.ns_host == "pod-b" and innermost(info.pid) == registered["pid"]
    result = restore.end_local_ranks(run, NODE, trust=restore.Trust.for_run(run, entry_points=(STANDIN,)))
    assert result["ended"] == [] and [r["reason"] for r in result["refused"]] == ["not_a_worker"]
    assert alive(info.pid)


@needs_namespaces
def test_a_copied_pod_pid_with_another_start_time_is_no_process_here(tmp_path, pods):
    """The pod's pid with a start time that is not its process's: no process matches, nothing is adopted,
    and after the grace the registration is reported as ranks of no known node."""
    run = tmp_path / "run"
    run.mkdir()
    pod = pods("pod-c", [sys.executable, "-c", "import time; time.sleep(300)"])
    real = in_pod(pod, "time.sleep(300)")
    forged = {"rank": 2, "pid": innermost(real.pid), "host": "pod-z", "started_at": time.time() - 120,
              "create_time": real.create_time() - 50, "uid": 0}
    rundir.ranks_dir(run).mkdir(parents=True)
    rundir.rank_file(run, 2).write_text(json.dumps(forged))
    matcher = procfs.PidNamespaces(run, NODE, grace_seconds=60)
    assert rundir.RankFiles(run, {NODE}, adopt=matcher.adopt).read() == []
    assert matcher.unplaced() == {"pod-z": 1}
    assert matcher.status()["unplaced_hosts"] == {"pod-z": 1}
    [unplaced, _] = matcher.families()
    assert unplaced.samples[0].value == 1


# ------------------------------------------------------------------------- on a fixture /proc tree

def fake_proc(root: Path, processes: dict[int, dict]) -> Path:
    """A /proc with `processes` {pid: {"nspid": [...], "start": ticks, "ppid": n, "hostname": h}}."""
    (root / "stat").parent.mkdir(parents=True, exist_ok=True)
    (root / "stat").write_text("cpu 0 0 0 0\nbtime 1000\n")
    for pid, p in processes.items():
        d = root / str(pid)
        d.mkdir()
        (d / "status").write_text(f"Name:\tpython\nNSpid:\t{' '.join(map(str, p['nspid']))}\n")
        fields = ["S", str(p.get("ppid", 1))] + ["0"] * 17 + [str(p["start"])] + ["0"] * 10
        (d / "stat").write_text(f"{pid} (python) {' '.join(fields)}\n")
        (d / "environ").write_bytes(f"HOSTNAME={p.get('hostname', '')}\0".encode())
    return root


def registration(run, **fields):
    info = {"rank": 0, "pid": 7, "host": "pod-a", "started_at": 1000.0 + 50, "create_time": 1000.0 + 5000 / procfs.TICKS,
            **fields}
    rundir.ranks_dir(run).mkdir(parents=True, exist_ok=True)
    rundir.rank_file(run, info["rank"]).write_text(json.dumps(info))


def test_two_pods_with_the_same_pid_and_tick_are_told_apart_by_host_name_or_refused(tmp_path):
    run = tmp_path / "run"
    proc = fake_proc(tmp_path / "proc", {
        401: {"nspid": [401, 7], "start": 5000, "hostname": "pod-a"},
        502: {"nspid": [502, 7], "start": 5000, "hostname": "pod-b"},
        503: {"nspid": [503, 7], "start": 9000, "hostname": "pod-a"}})      # another start time: never a match
    registration(run)
    [info] = rundir.RankFiles(run, {NODE}, adopt=procfs.PidNamespaces(run, NODE, procfs=proc).adopt).read()
    assert (info.pid, info.ns_candidates) == (401, 1)

    registration(run, host="pod-x")                     # neither environment names it: ambiguous
    [info] = rundir.RankFiles(run, {NODE}, adopt=procfs.PidNamespaces(run, NODE, procfs=proc).adopt).read()
    assert info.ns_candidates == 2
    with pytest.raises(restore.Refused) as refusal:
        restore.prove_rank(info, restore.Trust(run, 0))
    assert refusal.value.reason == "ambiguous_pod_pid"


def test_a_process_of_the_nodes_own_namespace_is_never_taken_for_a_pods(tmp_path):
    run = tmp_path / "run"
    proc = fake_proc(tmp_path / "proc", {7: {"nspid": [7], "start": 5000}})
    registration(run)
    matcher = procfs.PidNamespaces(run, NODE, procfs=proc, grace_seconds=0)
    assert rundir.RankFiles(run, {NODE}, adopt=matcher.adopt).read() == []
    assert matcher.unplaced() == {"pod-a": 1}


def test_a_host_another_agent_claimed_or_a_node_with_a_log_is_no_unplaced_rank(tmp_path):
    run = tmp_path / "run"
    proc = fake_proc(tmp_path / "proc", {})
    registration(run, rank=0, host="pod-on-node-2")
    registration(run, rank=1, host="node-3")
    registration(run, rank=2, host="ghost")
    rundir.host_claim(run, "pod-on-node-2").parent.mkdir(parents=True)
    rundir.host_claim(run, "pod-on-node-2").write_text('{"node": "node-2"}')
    rundir.node_log(run, "node-3").parent.mkdir(parents=True)
    rundir.node_log(run, "node-3").write_text("")
    matcher = procfs.PidNamespaces(run, NODE, procfs=proc, grace_seconds=0)
    assert rundir.RankFiles(run, {NODE}, adopt=matcher.adopt).read() == []
    assert matcher.unplaced() == {"ghost": 1}


@needs_namespaces
def test_the_daemonsets_agent_follows_a_job_whose_ranks_live_in_a_pod(tmp_path, pods):
    """The DaemonSet's own config and arguments (deploy/kubernetes/daemonset.yaml, with this machine's /proc
    and /sys for /host/...), a runs root with one job whose rank is in a pod: the agent follows that job and
    maps the pod's rank to its node, on /healthz and /metrics."""
    import urllib.request

    import yaml

    from tests.servers import free_port, wait_for

    documents = {d["kind"]: d for d in yaml.safe_load_all((Path(ROOT) / "deploy" / "kubernetes" /
                                                            "daemonset.yaml").read_text())}
    config_text = documents["ConfigMap"]["data"]["agent.yaml"].replace("/host/", "/")
    config_text = config_text.replace("0.0.0.0:9655", f"127.0.0.1:{free_port()}")
    (tmp_path / "agent.yaml").write_text(config_text)
    port = yaml.safe_load(config_text)["listen"].rsplit(":", 1)[1]
    args = [a.replace("/etc/trainguard/agent.yaml", str(tmp_path / "agent.yaml"))
             .replace("/data/runs", str(tmp_path / "runs")).replace("$(NODE_NAME)", NODE)
            for a in documents["DaemonSet"]["spec"]["template"]["spec"]["containers"][0]["args"]]
    run = tmp_path / "runs" / "job-7"
    run.mkdir(parents=True)
    (tmp_path / "token").write_text("t" * 32)
    os.chmod(tmp_path / "token", 0o600)
    config_text = (tmp_path / "agent.yaml").read_text().replace("/var/run/trainguard/token/token", str(tmp_path / "token"))
    (tmp_path / "agent.yaml").write_text(config_text)
    code = ("import json, os, socket, sys, time; from trainguard.runtime.control import write_rank_file; "
            "write_rank_file(sys.argv[1], 0); os.makedirs(sys.argv[1] + '/tls', exist_ok=True); "
            "open(sys.argv[1] + '/tls/rank-0.jsonl', 'a').write(json.dumps({'schema': 'tls/1', 'timestamp': "
            "time.time(), 'node': socket.gethostname(), 'rank': 0, 'step': 5, 'metrics': {'loss': 1.5}}) + '\\n'); "
            "time.sleep(300)")
    pods("pod-job-7", [sys.executable, "-c", code, str(run)])
    wait_for(lambda: rundir.rank_file(run, 0).exists(), timeout=60, message="the pod's rank registered")
    agent = subprocess.Popen([str(Path(sys.executable).with_name("trainguard")), *args],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def health():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
                    return json.loads(response.read())
            except OSError:
                return None
        wait_for(lambda: (health() or {}).get("ranks", {}).get("pod_hosts") == ["pod-job-7"], timeout=90,
                 message="the agent following job-7 and mapping its pod's rank")
        assert health()["discovery"]["following"] == str(run)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            metrics = response.read().decode()
        assert "trainguard_discovery_following_run 1.0" in metrics and "trainguard_ranks_pod_hosts 1.0" in metrics
        assert "trainguard_ranks_unplaced 0.0" in metrics
        # the pod's rank log (its records name the pod) is this node's: the training collector follows it
        wait_for(lambda: 'trainguard_training_step{rank="0"' in urllib.request.urlopen(
            f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode().replace('run_id="job-7",', ""),
            timeout=60, message="the pod's steps on /metrics")
    finally:
        agent.terminate()
        agent.wait(30)


def test_a_burst_of_other_nodes_registrations_walks_proc_once_and_a_future_one_never(tmp_path, monkeypatch):
    """Bounded work at scale: 500 registrations of other nodes' ranks, started before the agent looked,
    cost one walk of /proc; one claiming a start in the future (a skewed clock, a forgery) costs none."""
    run = tmp_path / "run"
    proc = fake_proc(tmp_path / "proc", {})
    now = time.time()
    for rank in range(500):
        registration(run, rank=rank, host=f"gpu-{rank // 8}", create_time=now - 60, started_at=now - 59)
    matcher = procfs.PidNamespaces(run, NODE, procfs=proc)
    walks = []
    build = matcher._build
    monkeypatch.setattr(matcher, "_build", lambda: (walks.append(1), build()))
    assert rundir.RankFiles(run, {NODE}, adopt=matcher.adopt).read() == []
    assert len(walks) == 1
    registration(run, rank=500, host="forged", create_time=now + 3600, started_at=now)
    assert rundir.RankFiles(run, {NODE}, adopt=matcher.adopt).read() == []
    assert len(walks) == 1
