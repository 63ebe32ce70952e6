"""At an incident on a run directory other nodes share, a node's evidence holds the NCCL lines of
the logs its own ranks write (/proc/<pid>/fd/1 and 2), not every node's (each agent read them all)."""

from __future__ import annotations

import subprocess
import sys

from trainguard import rundir
from trainguard.agent import evidence

from tests.fleet.synthetic import node_name, register_rank

WARN = b"%s:4243:4402 [0] misc/socket.cc:484 NCCL WARN socketStartConnect: Connect failed\n"


def test_evidence_reads_only_the_logs_of_this_nodes_ranks(tmp_path):
    ours, theirs = (tmp_path / "logs" / f"job_{tag}" / "attempt_0" / "0" for tag in ("a1", "b2"))
    for directory, node in ((ours, node_name(0)), (theirs, node_name(1))):
        directory.mkdir(parents=True)
        (directory / "stderr.log").write_bytes(WARN % node.encode())
    with open(ours / "stdout.log", "ab") as out, open(ours / "stderr.log", "ab") as err:
        rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdout=out, stderr=err)
    try:
        rundir.write_rank_file(tmp_path, 0, {"rank": 0, "pid": rank.pid, "host": node_name(0), "started_at": 1.0})
        register_rank(tmp_path, 8, node_name(1))                   # another node's rank: a shared directory
        live = [rundir.read_rank_file(rundir.rank_file(tmp_path, 0))]
        lines = evidence.nccl_lines(tmp_path, node_name(0), live)
        assert [(line["file"], line["kind"]) for line in lines] == [("logs/job_a1/attempt_0/0/stderr.log", "warn")]
        assert len(evidence.nccl_lines(tmp_path)) == 2               # one node's run directory: every log
    finally:
        rank.kill()
        rank.wait()
