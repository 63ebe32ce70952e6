"""The nccl collector: NCCL/PyTorch events counted from real-format rank logs (rotation, truncation, torchrun's
log layout, agent restarts), and the ranks' error-handling environment from /proc/<pid>/environ."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.agent.exposition import series, values
from trainguard.agent.collector import Context
from trainguard.agent.collectors.nccl import KINDS, LogSet, NCCLCollector, classify
from trainguard.agent.config import ConfigError
from trainguard.runtime.control import write_rank_file

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LOGS = FIXTURES / "logs" / "nccl"
ALL_FIXTURE_EVENTS = {"init": 4, "warn": 2, "watchdog_timeout": 1, "watchdog_stuck": 1, "error": 1, "abort": 1}


def collector(run: Path, **options) -> NCCLCollector:
    """The nccl collector over `run`, looking for new log directories at every update (rescan_seconds 0)."""
    options = {"rescan_seconds": 0, **options}
    return NCCLCollector(Context(procfs=FIXTURES / "proc", run_dir=run, node="node-a", options=options))


def test_new_log_directories_are_found_at_the_rescan_and_read_whole(tmp_path):
    """The log tree is walked every `rescan_seconds`, not every update; a directory found late loses nothing."""
    now = [0.0]
    logs = LogSet([str(tmp_path / "logs" / "**" / "*.log")], rescan_seconds=30, clock=lambda: now[0])
    directory = tmp_path / "logs" / "attempt_1" / "0"
    directory.mkdir(parents=True)
    (directory / "stderr.log").write_bytes(b"a:1:2 [0] NCCL WARN first\n")
    now[0] = 29.0
    assert list(logs.lines()) == []                           # not walked yet
    now[0] = 30.0
    assert b"NCCL WARN first" in b"".join(logs.lines())       # found, and read from its start


def counts(sample) -> dict[str, float]:
    v = values(sample.families)
    return {kind: v[series("trainguard_nccl_events_total", kind=kind)] for kind in KINDS}


def expect(**nonzero) -> dict[str, int]:
    return {kind: nonzero.get(kind, 0) for kind in KINDS}


@pytest.mark.parametrize("line, kind", [
    (b"node-a:4242:4318 [0] NCCL INFO comm 0x55d2c6b1d0a0 rank 0 nranks 16 cudaDev 0 nvmlDev 0 busId 18000 "
     b"commId 0x8c1f3a9e2b7d4c15 - Init COMPLETE", "init"),
    (b"node-a:4242:4318 [0] NCCL INFO comm 0x55d2c6b1d0a0 rank 0 nranks 16 cudaDev 0 nvmlDev 0 busId 18000 "
     b"commId 0x8c1f3a9e2b7d4c15 - Init START", None),
    # NCCL 2.21+: the calling function first; 2.23+: ncclCommInitRankConfig, ncclCommSplit too
    (b"node-a:4242:4318 [0] NCCL INFO ncclCommInitRank comm 0x55d2c6b1d0a0 rank 0 nranks 16 cudaDev 0 nvmlDev 0 "
     b"busId 18000 commId 0x8c1f3a9e2b7d4c15 localSize 8 used 543200 bytes - Init COMPLETE", "init"),
    (b"node-a:4242:4318 [0] NCCL INFO ncclCommInitRankConfig comm 0x55d2c6b1d0a0 rank 0 nranks 16 cudaDev 0 "
     b"nvmlDev 0 busId 18000 commId 0x8c1f3a9e2b7d4c15 localSize 8 used 543200 bytes - Init COMPLETE", "init"),
    (b"node-a:4242:4318 [0] NCCL INFO ncclCommSplit comm 0x55d2c7a41e80 rank 0 nranks 2 cudaDev 0 nvmlDev 0 "
     b"busId 18000 parent 0x55d2c6b1d0a0 splitCount 1 color 0 key 0 - Init COMPLETE", "init"),
    (b"node-a:4242:4318 [0] NCCL INFO ncclCommInitRank comm 0x55d2c6b1d0a0 rank 0 nranks 16 - Init START", None),
    (b"node-a:4242:4391 [0] NCCL INFO comm 0x55d2c6b1d0a0 rank 0 nranks 16 cudaDev 0 busId 18000 - Abort COMPLETE",
     "abort"),
    (b"node-a:4243:4402 [1] misc/socket.cc:484 NCCL WARN socketStartConnect: Connect to 10.0.0.12<43211> failed",
     "warn"),
    (b"[rank0]:[E1218 20:27:21.426415540 ProcessGroupNCCL.cpp:629] [Rank 0] Watchdog caught collective operation "
     b"timeout: WorkNCCL(SeqNum=1, OpType=BROADCAST, NumelIn=131072000, NumelOut=131072000, Timeout(ms)=600000) "
     b"ran for 600081 milliseconds before timing out.", "watchdog_timeout"),
    (b"[E1218 20:27:21.426 ProcessGroupNCCL.cpp:1595] [PG ID 0 PG GUID 0(default_pg) Rank 3] Watchdog caught "
     b"collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE) ran for 1800013 milliseconds", "watchdog_timeout"),
    # the same timeout repeated in the exception and in what(): one event, not three
    (b"[rank0]:[E1129 08:12:44.124 ProcessGroupNCCL.cpp:1785] [PG 0 (default_pg) Rank 0] Exception (either an "
     b"error before or asyncError set in watchdog): [Rank 0] Watchdog caught collective operation timeout: x", None),
    (b"  what():  [PG 0 (default_pg) Rank 0] Watchdog caught collective operation timeout: WorkNCCL(...)", None),
    (b"[rank1]: torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, "
     b"unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.20.5", "error"),
    (b"terminate called after throwing an instance of 'c10::DistBackendError'", None),
    (b"[rank0]: step 1300 loss 2.3012 grad_norm 0.91", None),
])
def test_classify(line, kind):
    assert classify(line) == kind


def test_counts_by_kind_from_rank_logs(tmp_path):
    run = tmp_path / "run"
    nccl = collector(run)                                       # logs/ does not exist yet: nothing followed
    assert counts(nccl.update()) == expect()
    shutil.copytree(LOGS, run / "logs")                         # files that appear later are read whole
    sample = nccl.update()
    assert counts(sample) == expect(**ALL_FIXTURE_EVENTS)
    assert values(sample.families)[series("trainguard_nccl_log_files")] == 2
    assert sample.tls == {"system": {"nccl_events": expect(**ALL_FIXTURE_EVENTS)}}
    assert counts(nccl.update()) == expect(**ALL_FIXTURE_EVENTS)        # nothing new, nothing counted again


def test_files_present_at_start_are_followed_from_their_end(tmp_path):
    """An agent restart does not count old lines again; what is written afterwards is counted."""
    run = tmp_path / "run"
    shutil.copytree(LOGS, run / "logs")
    nccl = collector(run)
    assert counts(nccl.update()) == expect()
    with open(run / "logs" / "rank-1.log", "ab") as log:
        log.write(b"node-a:4243:4402 [1] misc/socket.cc:484 NCCL WARN socketStartConnect: Connect failed\n")
    assert counts(nccl.update()) == expect(warn=1)


def test_rotation_and_truncation(tmp_path):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    log = run / "logs" / "rank-0.log"
    nccl = collector(run)
    warn = b"node-a:4242:4390 [0] transport/net_ib.cc:1295 NCCL WARN NET/IB : Got completion with error\n"
    log.write_bytes(warn)
    assert counts(nccl.update())["warn"] == 1
    with open(log, "ab") as handle:                 # written just before the rename: still counted, once
        handle.write(warn)
    os.rename(log, run / "logs" / "rank-0.log.1")   # rotated by rename: .1 no longer matches *.log
    log.write_bytes(warn * 3)
    assert counts(nccl.update())["warn"] == 1 + 1 + 3
    log.write_bytes(warn)                           # truncated in place (copytruncate) and written again
    assert counts(nccl.update())["warn"] == 6


def test_partial_and_overlong_lines(tmp_path):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    log = run / "logs" / "rank-0.log"
    nccl = collector(run)
    log.write_bytes(b"node-a:1:2 [0] NCCL INFO comm 0xab rank 0 nranks 2 cudaDev 0 - Init COM")
    assert counts(nccl.update())["init"] == 0                  # half a line: not yet
    with open(log, "ab") as handle:
        handle.write(b"PLETE\n" + b"x 1 NCCL WARN " + b"y" * 300_000 + b"\n" + b"a:1:2 [0] NCCL WARN short\n")
    assert counts(nccl.update()) == expect(init=1, warn=2)     # a 300 kB line is cut, not held whole


def test_torchrun_log_layout(tmp_path):
    """torchrun --log-dir RUN/logs writes <run_id>/attempt_<n>/<local_rank>/stderr.log, one per rank."""
    run = tmp_path / "run"
    nccl = collector(run)
    for attempt, rank in ((0, 0), (0, 1), (1, 0)):
        directory = run / "logs" / "b7f3e1" / f"attempt_{attempt}" / str(rank)
        directory.mkdir(parents=True)
        shutil.copy(LOGS / f"rank-{rank}.log", directory / "stderr.log")
        (directory / "stdout.log").write_text("step 1 loss 2.3\n")
    assert counts(nccl.update()) == expect(init=6, warn=3, watchdog_timeout=2, watchdog_stuck=1, error=1, abort=2)


def test_custom_globs(tmp_path):
    elsewhere = tmp_path / "slurm"
    elsewhere.mkdir()
    nccl = collector(tmp_path / "run", logs=[str(elsewhere / "job-*.err")])
    shutil.copy(LOGS / "rank-1.log", elsewhere / "job-7.err")
    shutil.copy(LOGS / "rank-0.log", elsewhere / "job-7.out")
    assert counts(nccl.update()) == expect(init=2, warn=1, watchdog_stuck=1, error=1)
    with pytest.raises(ConfigError, match="collectors.nccl.logs: expected list"):
        collector(tmp_path / "run", logs="*.log")


def test_rank_environment_info(tmp_path):
    run = tmp_path / "run"
    write_rank_file(run, 0, pid=4242, host="node-a")
    write_rank_file(run, 1, pid=4243, host="node-a")
    write_rank_file(run, 2, pid=99999999, host="node-a")     # gone: counted as unreadable
    write_rank_file(run, 3, pid=4242, host="node-b")         # another node's rank
    v = values(collector(run).update().families)
    infos = {dict(labels)["rank"]: dict(labels) for name, labels in v if name == "trainguard_nccl_env_info"}
    assert set(infos) == {"0", "1"}
    assert infos["0"]["torch_nccl_async_error_handling"] == "1" and infos["1"]["torch_nccl_async_error_handling"] == "3"
    assert infos["0"]["torch_nccl_blocking_wait"] == "" and infos["1"]["torch_nccl_blocking_wait"] == "1"
    assert infos["0"]["nccl_socket_ifname"] == "eth0" and infos["0"]["nccl_ib_timeout"] == "22"
    assert infos["0"]["nccl_ib_hca"] == "mlx5_0,mlx5_1" and infos["1"]["nccl_debug"] == "WARN"
    assert "home" not in infos["0"] and "path" not in infos["0"]        # only the NCCL/torch variables
    assert v[series("trainguard_nccl_env_unreadable_ranks")] == 1


def test_no_run_dir_no_environment(tmp_path):
    names = {name for name, _ in values(collector(None).update().families)}
    assert "trainguard_nccl_env_info" not in names and "trainguard_nccl_events_total" in names


def test_a_shared_run_directory_follows_only_the_logs_this_nodes_ranks_write(tmp_path):
    """RUN/logs of a run other nodes share holds every node's launcher directory, none naming its host:
    the collector follows the directories its own ranks write into (/proc/<pid>/fd/1 and 2), not the others'."""
    import subprocess
    import sys

    run = tmp_path / "run"
    ours, theirs = (run / "logs" / f"job_{node}" / "attempt_0" / "0" for node in ("a1b2", "c3d4"))
    for directory in (ours, theirs):
        directory.mkdir(parents=True)
    with open(ours / "stdout.log", "ab") as out, open(ours / "stderr.log", "ab") as err:
        rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdout=out, stderr=err)
    try:
        write_rank_file(run, 0, pid=rank.pid, host="node-a")
        write_rank_file(run, 8, pid=4242, host="node-b")          # another node's rank: the directory is shared
        nccl = NCCLCollector(Context(run_dir=run, node="node-a", options={"rescan_seconds": 0}))
        nccl.update()
        for directory in (ours, theirs):
            shutil.copy(LOGS / "rank-1.log", directory / "stderr.log")
        sample = nccl.update()
        assert counts(sample) == expect(init=2, warn=1, watchdog_stuck=1, error=1)      # one node's lines
        assert [os.path.realpath(d) for d, _ in nccl.logs.followers] == [os.path.realpath(ours)]
    finally:
        rank.kill()
        rank.wait()
