"""The parts collectors build families from (trainguard/metrics/families.py), the rank files read only when they change
(restore.RankFiles), and the ranks' environments read once per process (nccl.RankEnvironments)."""

from __future__ import annotations

import os
import time

import pytest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tests.agent.exposition import render
from trainguard import rundir
from trainguard.agent import restore
from trainguard.agent.collectors.nccl import ENV_VARS, RankEnvironments
from trainguard.metrics.families import NO_LABELS, LabelCache, Labels, Spec
from trainguard.agent.procfs import RankPids
from trainguard.runtime.control import write_rank_file


@pytest.mark.parametrize("kind, cls, name", [("gauge", GaugeMetricFamily, "test_temperature_celsius"),
                                             ("counter", CounterMetricFamily, "test_events_total"),
                                             ("counter", CounterMetricFamily, "test_events")])
def test_a_spec_family_is_the_family_add_metric_makes(kind, cls, name):
    spec = Spec(kind, name, 'Help with a "quote" and a \\.', ["gpu", "UUID"])
    built = spec.family([(spec.labels("0", "GPU-a"), 41.5), (spec.labels("1", 'odd"\\\nvalue'), 7)])
    expected = cls(name, 'Help with a "quote" and a \\.', labels=["gpu", "UUID"])
    expected.add_metric(["0", "GPU-a"], 41.5)
    expected.add_metric(["1", 'odd"\\\nvalue'], 7)
    assert type(built) is cls and built == expected
    assert vars(built).keys() == vars(expected).keys()
    assert render([built]) == render([expected])


def test_a_spec_value_is_an_unlabelled_family():
    spec = Spec("gauge", "test_load1", "1m load average.")
    assert spec.value(0.5) == GaugeMetricFamily("test_load1", "1m load average.", value=0.5)
    assert NO_LABELS == {} and NO_LABELS.text == ""


def test_a_spec_checks_its_name_once_as_client_python_does():
    with pytest.raises(ValueError, match="metric name cannot be empty"):
        Spec("gauge", "", "x")


def test_labels_carry_client_pythons_text():
    labels = Labels(["b", "a"], ['x"y', "1\\2\n"])
    assert labels == {"b": 'x"y', "a": "1\\2\n"}
    assert labels.text == '{a="1\\\\2\\n",b="x\\"y"}'


def test_a_label_cache_makes_each_label_set_once_and_forgets_past_its_limit():
    cache = LabelCache(["device"], limit=2)
    sda = cache.get("sda")
    assert cache.get("sda") is sda and sda == {"device": "sda"}
    cache.get("sdb")
    cache.get("sdc")                     # past the limit: everything forgotten, then made again on use
    assert cache.get("sda") is not sda and cache.get("sda") == sda


def settle(path) -> None:
    """Date the directory back, as if the last change were long ago (past RankFiles' racy window)."""
    past = time.time() - 60
    os.utime(path, (past, past))


def test_rank_files_are_read_again_only_when_the_directory_changes(tmp_path, monkeypatch):
    reads = []
    real = rundir.read_registration
    monkeypatch.setattr(rundir, "read_registration", lambda path: reads.append(os.path.basename(path)) or real(path))
    files = restore.RankFiles(tmp_path, {"node-a"})
    assert files.read() == [] and reads == []              # no control/ranks yet: nothing to read
    write_rank_file(tmp_path, 0, pid=4242, host="node-a")
    directory = tmp_path / "control" / "ranks"
    first = files.read()
    assert [info.pid for info in first] == [4242] and reads == ["rank-0.json"]
    assert files.read() is not first and len(reads) == 1    # changed just now: listed again (racy window),
    settle(directory)                                       # but an unchanged file is not read again
    settled = files.read()
    assert files.read() is settled and len(reads) == 1      # settled: not even listed again
    write_rank_file(tmp_path, 1, pid=4243, host="node-a")   # an atomic replace changes the directory
    assert [info.rank for info in files.read()] == [0, 1] and reads[1:] == ["rank-1.json"]
    write_rank_file(tmp_path, 2, pid=4244, host="node-b")   # another node's: read once, only its rank kept
    assert [info.rank for info in files.read()] == [0, 1] and reads[2:] == ["rank-2.json"]
    assert files.registered_elsewhere(2) and not files.registered_elsewhere(1)
    write_rank_file(tmp_path, 1, pid=4245, host="node-b")   # rank 1 moved to node-b
    assert [info.rank for info in files.read()] == [0] and files.registered_elsewhere(1)


def test_rank_pids_follow_the_rank_files(tmp_path):
    pids = RankPids(tmp_path, "node-a")
    write_rank_file(tmp_path, 1, pid=4243, host="node-a")
    write_rank_file(tmp_path, 0, pid=4242, host="node-a")
    write_rank_file(tmp_path, 2, pid=4244, host="node-b")   # another node's rank
    assert pids.get() == {0: 4242, 1: 4243}
    write_rank_file(tmp_path, 1, pid=5555, host="node-a")   # rank 1 restarted
    assert pids.get() == {0: 4242, 1: 5555}
    assert RankPids(None, "node-a").get() == {}


def fake_process(procfs, pid: int, start: int | None, env: dict[str, str]) -> None:
    directory = procfs / str(pid)
    directory.mkdir(parents=True, exist_ok=True)
    if start is not None:
        fields = ["S"] + ["0"] * 18 + [str(start)] + ["0"] * 30    # field 22 (starttime) is fields[19]
        (directory / "stat").write_text(f"{pid} (python) {' '.join(fields)}\n")
    (directory / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))


def test_a_ranks_environment_is_read_once_per_process(tmp_path):
    environments = RankEnvironments(tmp_path)
    slot = ENV_VARS.index("NCCL_DEBUG")
    fake_process(tmp_path, 4242, 1000, {"NCCL_DEBUG": "WARN", "HOME": "/root"})
    assert environments.get(4242)[slot] == "WARN"
    fake_process(tmp_path, 4242, 1000, {"NCCL_DEBUG": "INFO"})   # same process: its start block cannot change
    assert environments.get(4242)[slot] == "WARN"
    fake_process(tmp_path, 4242, 2000, {"NCCL_DEBUG": "INFO"})   # the pid now names another process
    assert environments.get(4242)[slot] == "INFO"
    assert environments.get(99999999) is None                    # gone


def test_without_a_start_time_the_environment_is_read_every_time(tmp_path):
    environments = RankEnvironments(tmp_path)
    slot = ENV_VARS.index("NCCL_DEBUG")
    fake_process(tmp_path, 4242, None, {"NCCL_DEBUG": "WARN"})
    assert environments.get(4242)[slot] == "WARN"
    fake_process(tmp_path, 4242, None, {"NCCL_DEBUG": "INFO"})
    assert environments.get(4242)[slot] == "INFO"
