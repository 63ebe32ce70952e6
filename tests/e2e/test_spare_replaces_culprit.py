"""End to end: a hot spare takes the place of a hang's culprit node in a job that cannot shrink (issue 31).

Three simulated nodes on loopback (tests/culprit/cluster.py): n1 and n2 train in a `--nnodes 2:2` job, an
agent beside each; n3 waits with `--spare` and advertises itself (signed, trainguard/spares.py). A rank
hangs; the agents name it and its node, and because a spare waits, the verdict keeps that node out even
though the job cannot shrink (`restore.evict: auto`; without the spare it restores in place,
tests/culprit/test_eviction_spares.py). The culprit's node is cordoned and its launcher ended, the spare
joins in its place, and the run finishes on the other node and the spare with the same world size, resumed
from the checkpoint before the hang, the data where an uninterrupted two-rank run has it.
"""

from __future__ import annotations

import json

import pytest

from tests.culprit.cluster import FAST_KEEP_ALIVE, cluster, wait_until
from tests.culprit.test_two_nodes_culprit import node_of_rank
from trainguard import event_types, rundir
from trainguard.agent import evict
from trainguard.runtime.checkpoint.manager import CheckpointManager
from trainguard.trainer import config as cfg

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

HANG_STEP, CHECKPOINT, LAST = 25, 20, 30
ARGS = ["--steps", str(LAST), "--checkpoint-every", "10", f"--inject=hang@{HANG_STEP}:1"]


def test_a_spare_replaces_the_culprit_node_of_a_job_that_cannot_shrink(tmp_path):
    # No warm standby per rank (recovery.standbys: 0): on a loaded 2-core machine a standby process per rank
    # is CPU the restarts of the nodes' workers wait for; this test is about nodes.
    with cluster(tmp_path, policy={"recovery": {"standbys": 0}}, rdzv_conf=FAST_KEEP_ALIVE) as c:
        for node in ("n1", "n2"):
            c.launch(node, *ARGS, nnodes="2:2")
        spare = c.launch("n3", *ARGS, "--spare", nnodes="2:2")
        wait_until(lambda: rundir.spare_advert_path(c.run_dir, "n3").exists(), 120, "the spare's advert", c)

        incident = c.wait_incident(200)
        bad = node_of_rank(c, incident, 1)
        good = ({"n1", "n2"} - {bad}).pop()
        assert incident["culprit"] == {"rank": 1, "node": bad, "ranks": [1]}, incident
        assert incident["action"] == "evict", incident
        assert any("a hot spare takes its place" in r for r in incident["reasons"]), incident["reasons"]
        cordon = evict.cordoned(c.run_dir)[bad]             # honoured: signed with the run's key

        assert c.wait(good, 300) == 0, c.diagnostics()
        assert c.wait("n3", 60) == 0, c.diagnostics()
        assert c.wait(bad, 30) != 0                         # its launcher was ended
        assert spare.returncode == 0

        # The spare took the culprit's place, said so, and no longer advertises itself.
        [joined] = [r["event"] for r in c.events("node-n3-launcher.jsonl", event_types.SPARE_JOINED)]
        assert joined["replaces"] == bad and joined["cordon_id"] == cordon["cordon_id"]
        assert not rundir.spare_advert_path(c.run_dir, "n3").exists()

        # The same world size before and after; resumed from the checkpoint before the hang.
        starts = [r["event"] for r in c.events("rank-0.jsonl", event_types.RUN_START)]
        assert {s["world_size"] for s in starts} == {2}, starts
        assert starts[-1]["resumed_from"] == CHECKPOINT
        hosts = {json.loads(p.read_text())["host"] for p in rundir.ranks_dir(c.run_dir).glob("rank-*.json")}
        assert hosts == {good, "n3"}
        assert c.events("rank-0.jsonl", event_types.RUN_END)[-1]["event"]["reason"] == "completed"

        # The data where an uninterrupted run of two ranks has it: nothing re-cut.
        _, final = CheckpointManager(c.run_dir).load_latest()
        config = cfg.TrainConfig()
        cfg.load_file(config, str(c.run_dir / "config.yaml"))
        assert final["trainer"]["step"] == LAST
        assert final["data"] == {"consumed": LAST * config.optim.batch_size, "world_size": 2, "done": []}
