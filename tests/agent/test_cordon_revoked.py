"""An uncordon cannot be rolled back by someone who can write the run directory (trainguard/cordon/__init__.py).

Before: `trainguard uncordon` only removed RUN/control/cordon/<host>; a copy of the genuine signed cordon
put back afterwards kept the node out again (the launcher refused to join, exit 4). Now every cordon
carries a random id and an expiry in its signed body, and `uncordon` records the id in a signed revocation
list beside the key, outside RUN/: the copy is refused loudly as `revoked` by the launcher's check (the very
function `trainguard train` runs before it joins), `trainguard incidents`, `status` and the agent.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from trainguard import cli, cordon, rundir, signed
from trainguard.agent import evict
from trainguard.node import node_name
from trainguard.trainer import launch
from trainguard.runtime.checkpoint import keys
from trainguard.runtime.cordon_key import checker, write_cordon



@pytest.fixture
def run(tmp_path):
    path = tmp_path / "run"
    (path / "tls").mkdir(parents=True)
    return path


def cordon_node(run, host, key_file, **fields):
    return write_cordon(run, host, keys.load_key(key_file), incident="i1", reason="hang culprit", by="agent:n1",
                        **fields)


def test_a_copy_of_an_uncordoned_cordon_put_back_is_refused_as_revoked(run, key_file, capsys):
    host = node_name()
    copy = cordon_node(run, host, key_file).read_bytes()          # a stranger keeps a copy
    assert launch.cordon_refusal(run) is not None                  # genuine: the node is kept out
    assert cli.main(["uncordon", str(run), host]) == 0
    assert "a copy put back is refused" in capsys.readouterr().out
    rundir.cordon_path(run, host).write_bytes(copy)                # ... and puts it back
    assert launch.cordon_refusal(run) is None                      # before: kept out again
    err = capsys.readouterr().err
    assert "was revoked by `trainguard uncordon`" in err and "NOT honoured" in err
    [event] = [json.loads(line)["event"] for line in rundir.launcher_log(run, host).read_text().splitlines()]
    assert (event["type"], event["reason"]) == ("cordon_ignored", cordon.REVOKED)
    assert cli.main(["incidents", str(run)]) == 0
    assert f"REVOKED: cordon of {host}" in capsys.readouterr().out
    assert cli.main(["status", str(run)]) == 0
    assert f"cordon of {host} NOT honoured (revoked)" in capsys.readouterr().out
    assert evict.cordoned(run) == {}                               # the agent keeps nobody out for it
    # the revocation lives beside the key: nothing under RUN/ holds it, so nothing there can undo it
    revocations = cordon.revocations_path(key_file)
    assert revocations.parent == key_file.parent and (revocations.stat().st_mode & 0o777) == 0o600
    assert not any("revoked" in p.name for p in run.rglob("*"))
    assert cli.main(["uncordon", str(run), host]) == 0             # the copy removed
    assert "removed a copy of a cordon revoked before" in capsys.readouterr().out
    cordon_node(run, host, key_file)                               # a new cordon: a new id, honoured
    assert launch.cordon_refusal(run) is not None


def test_every_cordon_has_its_own_id_and_an_expiry_past_which_it_is_refused(run, key_file):
    cordon_node(run, "n1", key_file)
    cordon_node(run, "n2", key_file, lifetime_seconds=3600)
    found = cordon.read_all(run, checker())
    assert found["n1"].honoured and found["n2"].honoured and found["n1"].ident != found["n2"].ident
    assert found["n1"].record["expires_at"] == pytest.approx(found["n1"].record["cordoned_at"] + 30 * 86400)
    later = cordon.read_one(run, "n2", checker(), now=time.time() + 7200)
    assert later.refused == cordon.EXPIRED and "expired (at 20" in later.why_refused()
    cordon_node(run, "n3", key_file, lifetime_seconds=-1)          # expired: a new cordon replaces it
    assert cordon.read_one(run, "n3", checker()).refused == cordon.EXPIRED
    cordon_node(run, "n3", key_file)
    assert cordon.read_one(run, "n3", checker()).honoured


def test_a_revocation_list_that_does_not_prove_itself_honours_no_cordon_and_uncordon_says_why(run, key_file,
                                                                                             capsys):
    cordon_node(run, "n1", key_file)
    cordon_node(run, "n2", key_file)
    assert cli.main(["uncordon", str(run), "n1"]) == 0
    revocations = cordon.revocations_path(key_file)
    listed = json.loads(revocations.read_text())
    revocations.write_text(json.dumps({**listed, "revoked": []}))  # edited: the revocation dropped
    assert cordon.read_one(run, "n2", checker()).refused == cordon.REVOCATIONS_UNREADABLE
    capsys.readouterr()
    assert cli.main(["uncordon", str(run), "n2"]) == 2
    err = capsys.readouterr().err
    assert f"the revocation list {revocations}" in err and "Traceback" not in err
    assert rundir.cordon_path(run, "n2").exists()                  # nothing removed, nothing lost


def test_revocations_of_expired_cordons_are_forgotten_and_a_round_2_cordon_is_revoked_by_signature(run, key_file):
    key = keys.load_key(key_file)
    cordon_node(run, "old", key_file, lifetime_seconds=1)
    stale = cordon.read_one(run, "old", checker())
    cordon.revoke(checker(), run, stale, by="test")
    legacy = signed.sign(key, cordon.PURPOSE, {"host": "n9", "incident": "i0", "reason": "r", "by": "rank:0",
                                               "cordoned_at": time.time()}, key_id=keys.key_id(key))
    rundir.cordon_path(run, "n9").write_text(json.dumps(legacy))  # as cordons were once written: no id, no expiry
    found = cordon.read_one(run, "n9", checker())
    assert found.honoured and found.ident.startswith("sig:")
    cordon.revoke(checker(), run, found, by="test", now=time.time() + 5)
    entries = json.loads(cordon.revocations_path(key_file).read_text())["revoked"]
    assert [e["host"] for e in entries] == ["n9"]                  # the expired cordon's entry was dropped
    assert cordon.read_one(run, "n9", checker()).refused == cordon.REVOKED


def test_uncordon_without_a_usable_key_removes_nothing(run, key_file, tmp_path, capsys, monkeypatch):
    cordon_node(run, "n1", key_file)
    monkeypatch.setenv(keys.ENV_VAR, str(tmp_path / "nowhere.key"))
    assert cli.main(["uncordon", str(run), "n1"]) == 2             # cannot tell, cannot revoke
    assert "cannot revoke the cordon of n1" in capsys.readouterr().err
    assert cli.main(["uncordon", str(run), "n1", "--key-file", str(tmp_path / "missing.key")]) == 2
    assert f"--key-file {tmp_path / 'missing.key'}" in capsys.readouterr().err
    assert cli.main(["uncordon", str(run), "n1", "--key-file", str(key_file)]) == 0
    assert not rundir.cordon_path(run, "n1").exists()


# ---------------------------------------------------------------------- trainguard incidents --key-file

def test_incidents_checks_cordons_with_the_key_file_given(run, key_file, tmp_path, capsys, monkeypatch):
    cordon_node(run, "n1", key_file)
    monkeypatch.setenv(keys.ENV_VAR, str(tmp_path / "the-users-default.key"))   # not the run's key
    assert cli.main(["incidents", str(run)]) == 0
    assert "NOT honoured: cordon of n1" in capsys.readouterr().out
    assert cli.main(["incidents", str(run), "--key-file", str(key_file)]) == 0   # before: no such flag
    assert "cordoned   n1: kept out of the job (incident i1" in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["missing.key", "fifo", "loose.key"])
def test_incidents_with_a_missing_or_bad_key_file_is_exit_2_naming_it(run, tmp_path, capsys, bad):
    path = tmp_path / bad
    if bad == "fifo":
        os.mkfifo(path)
    elif bad == "loose.key":
        path.write_bytes(os.urandom(32))
        path.chmod(0o644)                                          # readable by others: refused
    assert cli.main(["incidents", str(run), "--key-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"trainguard incidents: --key-file {path}") and "Traceback" not in err
