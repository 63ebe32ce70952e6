"""The agent counts the hot spares that wait (agent/culprit.py `job`, trainguard/spares.py): only a signed,
fresh advert of a spare neither cordoned nor joining, bound to its host and run, and less the places already
waiting for a spare. Real signed files in a temporary run directory; what the count does to the verdict."""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.agent.test_cordon_signed import forge
from trainguard import rundir, signed, spares
from trainguard.agent import culprit
from trainguard.decide.culprit import CulpritVerdict, eviction
from trainguard.runtime.checkpoint import keys
from trainguard.runtime.cordon_key import write_cordon

NAMED = CulpritVerdict([1], "n2", 0.9, [])



@pytest.fixture
def run(tmp_path):
    path = tmp_path / "run"
    for host in ("n1", "n2"):            # a --nnodes 2:2 job on n1 and n2
        launcher = rundir.launcher_path(path, host)
        launcher.parent.mkdir(parents=True, exist_ok=True)
        launcher.write_text(json.dumps({"host": host, "pid": 1, "started_at": 0, "min_nodes": 2, "max_nodes": 2}))
    return path


def advertise(run, host, key, beat=None, **fields):
    now = time.time() if beat is None else beat
    return spares.advertise(run, host, key, now=now, waiting_since=now - 30, key_id=keys.key_id(key), **fields)


def counted(run) -> int:
    return culprit.job(run, {"n1", "n2"}).spares


def test_a_signed_fresh_advert_is_a_waiting_spare_and_the_culprit_of_a_2_2_job_is_kept_out(run, key_file):
    assert counted(run) == 0
    assert eviction(NAMED, culprit.job(run, {"n1", "n2"}), "auto", 2)[0] == "restore"
    advertise(run, "n3", keys.load_key(key_file))
    job = culprit.job(run, {"n1", "n2"})
    assert (job.nodes, job.min_nodes, job.max_nodes, job.spares) == (("n1", "n2"), 2, 2, 1)
    action, why = eviction(NAMED, job, "auto", 2)
    assert action == "evict" and "a hot spare takes its place" in why
    advertise(run, "n4", keys.load_key(key_file))
    assert counted(run) == 2


def test_a_forged_or_unsigned_advert_counts_for_nothing(run, key_file):
    advertise(run, "n3", os.urandom(32))                                     # another key
    path = rundir.spare_advert_path(run, "n4")
    path.write_text(json.dumps({"host": "n4", "run": "run", "heartbeat_at": time.time()}))   # no signature
    assert counted(run) == 0
    reasons = {a.host: a.refused for a in spares.read_adverts(run, keys.load_key(key_file), time.time())}
    assert reasons == {"n3": signed.BAD_SIGNATURE, "n4": signed.UNSIGNED}
    assert eviction(NAMED, culprit.job(run, {"n1", "n2"}), "auto", 2)[0] == "restore"


def test_a_stale_advert_is_a_spare_that_died(run, key_file):
    advertise(run, "n3", keys.load_key(key_file), beat=time.time() - spares.STALE_SECONDS - 5)
    assert counted(run) == 0
    [advert] = spares.read_adverts(run, keys.load_key(key_file), time.time())
    assert advert.refused == spares.STALE and "heartbeat" in advert.why_refused()
    advertise(run, "n3", keys.load_key(key_file), beat=time.time() + spares.STALE_SECONDS + 60)   # a clock ahead
    assert counted(run) == 0


def test_an_advert_copied_to_another_host_or_from_another_run_is_refused(run, key_file, tmp_path):
    key = keys.load_key(key_file)
    genuine = advertise(run, "n3", key)
    rundir.spare_advert_path(run, "n5").write_bytes(genuine.read_bytes())
    other = tmp_path / "other-run"
    rundir.spare_advert_path(other, "n6").parent.mkdir(parents=True)
    rundir.spare_advert_path(run, "n6").write_bytes(advertise(other, "n6", key).read_bytes())
    reasons = {a.host: a.refused for a in spares.read_adverts(run, key, time.time())}
    assert reasons == {"n3": None, "n5": signed.NOT_BOUND, "n6": signed.NOT_BOUND}
    assert counted(run) == 1


def test_a_cordoned_spare_and_a_spare_that_claimed_a_place_are_not_waiting(run, key_file):
    key = keys.load_key(key_file)
    advertise(run, "n3", key)
    advertise(run, "n4", key)
    write_cordon(run, "n3", key, incident=None, reason="node_risk", by="agent:n3")
    claim = rundir.spare_claims_dir(run) / "n9.0123456789abcdef.json"
    claim.parent.mkdir(parents=True)
    claim.write_text(json.dumps({"spare": "n4", "replaces": "n9", "cordon_id": "x", "claimed_at": time.time()}))
    reasons = {a.host: a.refused for a in spares.read_adverts(run, key, time.time())}
    assert reasons == {"n3": spares.CORDONED, "n4": spares.CLAIMED}
    assert counted(run) == 0


def test_a_forged_cordon_of_a_spare_does_not_take_it_out_of_the_count(run, key_file):
    advertise(run, "n3", keys.load_key(key_file))
    forge(run, "n3")
    assert counted(run) == 1


def test_a_place_no_spare_claimed_yet_takes_the_waiting_spare_first(run, key_file):
    key = keys.load_key(key_file)
    advertise(run, "n3", key)
    rundir.launcher_path(run, "n4").write_text(json.dumps({"host": "n4", "pid": 1, "started_at": 0,
                                                           "min_nodes": 2, "max_nodes": 2}))
    write_cordon(run, "n4", key, incident=None, reason="node_risk", by="agent:n4")   # n3 will take n4's place
    assert counted(run) == 0
    advertise(run, "n5", key)
    assert counted(run) == 1


def test_a_spare_that_joined_the_job_is_not_waiting(run, key_file):
    advertise(run, "n3", keys.load_key(key_file))
    assert culprit.job(run, {"n1", "n3"}).spares == 0


def test_without_a_key_no_advert_counts(run, key_file, tmp_path, monkeypatch):
    advertise(run, "n3", keys.load_key(key_file))
    monkeypatch.setenv(keys.ENV_VAR, str(tmp_path / "absent.key"))
    assert counted(run) == 0


def test_the_agent_exports_the_spares_it_would_count_and_the_adverts_it_refuses(run, key_file):
    """/metrics says what the verdict would read: `trainguard_spares_waiting` (signed, fresh, not cordoned,
    not joining) and `trainguard_spare_advert_refused{node,reason}` for the others, a forged one among them."""
    from trainguard.agent.culprit import Investigator
    from trainguard.policy import RestorePolicy

    def families():
        return {f.name: f for f in Investigator(run, "n1", RestorePolicy()).families()}

    assert [s.value for s in families()["trainguard_spares_waiting"].samples] == [0]
    key = keys.load_key(key_file)
    advertise(run, "n3", key)
    advertise(run, "n4", key, beat=time.time() - 60)                      # a spare that died a minute ago
    advertise(run, "n5", os.urandom(32))                                 # signed with another key
    found = families()
    assert [s.value for s in found["trainguard_spares_waiting"].samples] == [1]
    refused = {s.labels["node"]: s.labels["reason"] for s in found["trainguard_spare_advert_refused"].samples}
    assert set(refused) == {"n4", "n5"} and refused["n4"] == spares.STALE
    assert refused["n5"] in signed.REASONS                               # the signature's own refusal
