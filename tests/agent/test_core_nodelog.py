"""The joined node log: one record per interval from every collector's fragment, rotation with compression,
and a full disk that is counted, never fatal."""

from __future__ import annotations

import gzip
import os

import pytest

from tests.servers import agent_server, wait_for
from trainguard import tls
from trainguard.agent.nodelog import NodeLog, RotatingFile, join_fragments

FIXTURES = __import__("pathlib").Path(__file__).resolve().parents[1] / "fixtures"


def test_join_puts_every_fragment_in_its_section():
    record = join_fragments({
        "training": {"run_id": "gpt", "step": 125000, "metrics": {"loss": 2.356, "grad_norm": 0.87},
                     "system": {"last_checkpoint": "step_125000"}},
        "gpu": {"hardware": {"gpu_util": 78.0, "gpus": [{"gpu": 0}]}, "system": {"gpu_count": 8}},
        "io": {"hardware": {"disk_await_ms": 3.2}, "system": {"data_throughput": 18e9}},
    }, "node-a", 1710512538.0)
    assert record == {
        "schema": "tls/1", "timestamp": "2024-03-15T14:22:18.000000Z", "node": "node-a", "run_id": "gpt",
        "step": 125000, "metrics": {"loss": 2.356, "grad_norm": 0.87},
        "hardware": {"gpu_util": 78.0, "gpus": [{"gpu": 0}], "disk_await_ms": 3.2},
        "system": {"gpu_count": 8, "data_throughput": 18e9, "last_checkpoint": "step_125000"}}
    assert tls.normalise(record)["system"]["gpu_count"] == 8   # what it writes, TLS reads back


def test_rotation_compresses_and_keeps_n_segments(tmp_path):
    path = tmp_path / "tls" / "node-a.jsonl"
    log = RotatingFile(path, max_bytes=1000, keep=3)
    lines = [tls.encode({"timestamp": i, "n": "x" * 80}) for i in range(100)]
    for line in lines:
        log.write(line)
    log.close()
    assert sorted(p.name for p in path.parent.iterdir()) == [
        "node-a.jsonl", "node-a.jsonl.1.gz", "node-a.jsonl.2.gz", "node-a.jsonl.3.gz"]
    assert path.stat().st_size <= 1000
    kept = b"".join(gzip.decompress(path.with_name(f"node-a.jsonl.{i}.gz").read_bytes()) for i in (3, 2, 1))
    kept += path.read_bytes()
    assert lines[-len(kept.splitlines()):] == [line for line in kept.splitlines(keepends=True)]
    assert log.rotations > 3
    records = [line.record for line in tls.iter_lines(path.with_name("node-a.jsonl.1.gz"))]
    assert records and all(r is not None for r in records)


def test_an_interrupted_rotation_is_finished_first(tmp_path):
    path = tmp_path / "node-a.jsonl"
    path.with_name("node-a.jsonl.1").write_bytes(b'{"timestamp": 1}\n')   # killed while compressing
    log = RotatingFile(path, max_bytes=100, keep=2)
    log.write(b'{"timestamp": 2}\n')
    log.close()
    assert gzip.decompress(path.with_name("node-a.jsonl.1.gz").read_bytes()) == b'{"timestamp": 1}\n'
    assert not path.with_name("node-a.jsonl.1").exists()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_is_counted_and_logged_once(tmp_path, capsys):
    nodelog = NodeLog(lambda: {"host": {"system": {"load1": 1.0}}}, tmp_path, "node-a")
    nodelog.file = RotatingFile(__import__("pathlib").Path("/dev/full"), max_bytes=1 << 40, keep=1)
    assert [nodelog.write_once() for _ in range(3)] == [False, False, False]
    assert nodelog.errors == 3 and nodelog.records == 0
    assert capsys.readouterr().out.count("node log write failed") == 1
    values = {f.name: f.samples[0].value for f in nodelog.families()}
    assert values["trainguard_nodelog_write_errors"] == 3


def test_a_broken_fragment_source_is_counted_not_raised(tmp_path):
    def broken():
        raise ValueError("bad fragment")

    nodelog = NodeLog(broken, tmp_path, "node-a")
    assert nodelog.write_once() is False and nodelog.errors == 1


def test_the_agent_writes_joined_records(tmp_path):
    run_dir = tmp_path / "run"
    with tls.Writer(run_dir / "tls" / "rank-0.jsonl") as writer:
        writer.write(tls.make_record(step=12, run_id="gpt", rank=0, metrics={"loss": 2.5}))
    with agent_server(run_dir=run_dir, procfs=FIXTURES / "proc", only=("host", "training"), interval=0.1) as (agent, _):
        nodelog = NodeLog(agent.tls_fragments, run_dir, "node-a", interval=0.1).start()
        try:
            path = run_dir / "tls" / "node-node-a.jsonl"
            wait_for(lambda: any('"step":12' in line and '"load1"' in line
                                 for line in (path.read_text().splitlines() if path.exists() else [])),
                     20, message="a joined record")
        finally:
            nodelog.stop()
    record = [r for r in tls.read_records(path) if r.get("step") == 12][-1]
    assert record["run_id"] == "gpt" and record["metrics"]["loss"] == 2.5 and record["node"] == "node-a"
    assert record["system"]["load1"] == 12.34
