"""A cordon file keeps a node out of the job only when it proves who wrote it (trainguard/cordon/__init__.py).

Before: any file at RUN/control/cordon/<host> made that node's launcher refuse to join (exit 4), so anyone
who could write the run directory could evict any node. Now a cordon is signed with the run's checkpoint
key; an unsigned (round-1 or forged), wrongly signed or copied one is ignored loudly: the launcher joins and
says so on stderr and in a `cordon_ignored` TLS event, `trainguard status` and `incidents` show it, the
agent exports it, and `trainguard uncordon` removes either kind.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from trainguard import cordon, rundir, signed
from trainguard.agent import evict
from trainguard.agent.culprit import Investigator
from trainguard.node import node_name
from trainguard.policy import RestorePolicy
from trainguard.runtime.checkpoint import keys
from trainguard.runtime.cordon_key import write_cordon



def forge(run, host, **record):
    path = rundir.cordon_path(run, host)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"host": host, "incident": "x", "reason": "forged", "cordoned_at": time.time(),
                                "by": "stranger", **record}))
    return path


def cli(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "trainguard.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


# ----------------------------------------------------------------------------------------- the proof

def test_only_a_cordon_signed_with_the_runs_key_for_its_own_host_is_honoured(tmp_path, key_file):
    key = keys.load_key(key_file)
    write_cordon(tmp_path, "good", key, incident="i1", reason="hang culprit", by="agent:n1")
    forge(tmp_path, "unsigned")                                                # the unsigned form cordons once had, or a stranger's
    cordon.write(tmp_path, "otherkey", b"k" * 40, incident="i2", reason="x", by="y")
    rundir.cordon_path(tmp_path, "copied").write_bytes(rundir.cordon_path(tmp_path, "good").read_bytes())
    changed = json.loads(rundir.cordon_path(tmp_path, "good").read_text())
    rundir.cordon_path(tmp_path, "changed").write_text(json.dumps({**changed, "host": "changed"}))   # edited
    found = cordon.read_all(tmp_path, key)
    assert {host: c.refused for host, c in found.items()} == {
        "good": None, "unsigned": signed.UNSIGNED, "otherkey": signed.BAD_SIGNATURE,
        "copied": signed.NOT_BOUND, "changed": signed.BAD_SIGNATURE}
    assert found["good"].record["key_id"] == keys.key_id(key)
    assert cordon.read_all(tmp_path, None)["good"].refused == signed.NO_KEY    # no key: nothing is honoured


def test_the_agent_counts_only_honoured_cordons_and_replaces_a_forged_one_with_its_own(tmp_path, key_file):
    forge(tmp_path, "n2", cordoned_at=time.time())
    forge(tmp_path, "n3", cordoned_at=time.time())
    assert evict.cordoned(tmp_path) == {}                          # keeps nobody out of a verdict
    assert evict.evictions_since(tmp_path, time.time() - 3600) == 0   # and spends no eviction budget
    evict.cordon(tmp_path, "n2", incident="i", reason="hang culprit", by="agent:n1")
    assert set(evict.cordoned(tmp_path)) == {"n2"} and evict.evictions_since(tmp_path, time.time() - 3600) == 1
    investigator = Investigator(tmp_path, "n1", RestorePolicy())
    families = {f.name: f for f in investigator.families()}
    assert [(s.labels, s.value) for s in families["trainguard_node_cordoned"].samples] == [({"node": "n2"}, 1)]
    assert [(s.labels, s.value) for s in families["trainguard_cordon_refused"].samples] == \
        [({"node": "n3", "reason": "unsigned"}, 1)]


def test_an_agent_without_a_usable_key_refuses_to_cordon_naming_the_key(tmp_path, key_file):
    key_file.chmod(0o644)
    with pytest.raises(evict.CannotCordon, match="readable or writable by others"):
        evict.cordon(tmp_path, "n2", incident="i", reason="r", by="agent:n1")
    assert not rundir.cordon_path(tmp_path, "n2").exists()


# ---------------------------------------------------------------------------------- end to end: CLI

@pytest.mark.slow
def test_a_forged_cordon_is_ignored_loudly_and_a_signed_one_keeps_the_node_out(tmp_path, key_file):
    run, host = tmp_path / "run", node_name()
    forge(run, host)
    train = ("train", "--run-dir", str(run), "--steps", "1", "--device", "cpu", "--max-restarts", "1")
    joined = cli(*train)
    assert joined.returncode == 0, joined.stderr                   # before: exit 4, the node kept out
    assert f"the cordon file {rundir.cordon_path(run, host)} is not signed" in joined.stderr
    assert "NOT honoured" in joined.stderr and "Traceback" not in joined.stderr
    [event] = [json.loads(line)["event"] for line in rundir.launcher_log(run, host).read_text().splitlines()]
    assert (event["type"], event["host"], event["reason"], event["ignored_total"]) == \
        ("cordon_ignored", host, "unsigned", 1)
    status = cli("status", str(run))
    assert status.returncode == 0 and f"cordon of {host} NOT honoured (unsigned)" in status.stdout
    listed = cli("incidents", str(run))
    assert f"NOT honoured: cordon of {host}" in listed.stdout
    removed = cli("uncordon", str(run), host)
    assert removed.returncode == 0 and "NOT honoured" in removed.stdout and not rundir.cordon_path(run, host).exists()

    write_cordon(run, host, keys.load_key(key_file), incident="i1", reason="hang culprit", by="agent:n1")
    refused = cli(*train)
    assert refused.returncode == 4 and f"node {host} is cordoned" in refused.stderr
    assert f"cordoned   {host}: kept out of the job (incident i1" in cli("incidents", str(run)).stdout
    removed = cli("uncordon", str(run), host)
    assert removed.returncode == 0 and f"{host} uncordoned: its launcher may join" in removed.stdout
    assert cli("uncordon", str(run), host).returncode == 2
