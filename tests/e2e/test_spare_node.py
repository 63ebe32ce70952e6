"""End to end: a hot spare takes the place of a node drained at a checkpoint (issues 31 and 33).

Three simulated nodes on loopback (tests/culprit/cluster.py: `trainguard train --nnodes 1:2` launchers in one
c10d rendezvous, an agent beside each node): n1 and n2 train, n3 is started with `--spare`. n2's agent reads
the FAKE NVML's degrading GPU (tests/fakes); its node-risk rule flags the node, every rank saves a verified
checkpoint of the step it is in and stops, the agent cordons n2 (signed) and ends its launcher; the spare sees
the honoured cordon and joins, and the job re-forms on n1 and n3: the same world size, resumed from the
drain's checkpoint (nothing trained past it is lost), the data where an uninterrupted two-rank run has it,
and n2 kept out. The steps are paced (slowio: 0.5 s a batch) so the drain falls in the middle of the run.
"""

from __future__ import annotations

import json

import pytest

from tests.culprit.cluster import FAST_KEEP_ALIVE, cluster, wait_until
from trainguard import event_types, rundir
from trainguard.actions import DRAIN
from trainguard.agent import evict
from trainguard.runtime.checkpoint.manager import CheckpointManager
from trainguard.trainer import config as cfg

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 90
PACED = [f"--inject=slowio@{step}" for step in range(1, STEPS, 5)]
ARGS = ["--steps", str(STEPS), "--checkpoint-every", "1000", "--checkpoint-every-seconds", "0", "--device", "cpu",
        *PACED]


def step_records(c, rank: int) -> list[dict]:
    return [r for r in c.records(f"rank-{rank}.jsonl") if isinstance(r.get("metrics"), dict) and "loss" in r["metrics"]]


def test_a_spare_takes_the_drained_nodes_place_and_the_world_size_stays(tmp_path):
    # No warm standby per rank (recovery.standbys: 0): this test is about nodes, and on a loaded 2-core machine
    # a standby process per rank is CPU the restarts of the nodes' workers wait for.
    with cluster(tmp_path, policy={"recovery": {"standbys": 0}}, nodes=("n1", "n3"), rdzv_conf=FAST_KEEP_ALIVE) as c:
        for node in ("n1", "n2"):
            c.launch(node, *ARGS)
        spare = c.launch("n3", *ARGS, "--spare")
        wait_until(lambda: len(step_records(c, 0)) >= 3, 180, "the first steps", c)
        assert spare.poll() is None                       # waiting outside the rendezvous: the job is n1 and n2
        assert not (c.run_dir / "tls" / "node-n3-launcher.jsonl").exists()
        c.start_agent("n2", "degrading")                  # n2's GPU starts to degrade now
        c.wait_agent("n2")

        assert c.wait("n1", 300) == 0, c.diagnostics()
        assert c.wait("n3", 60) == 0, c.diagnostics()
        assert c.wait("n2", 30) != 0                      # ended by its agent (SIGTERM, SIGKILL past the grace)

        # The drain: one request, a verified checkpoint of the step every rank was in, the node cordoned.
        [drained] = [r["event"] for r in c.events("rank-0.jsonl", event_types.ACTION) if r["event"]["action"] == DRAIN]
        step = drained["checkpoint_step"]
        assert drained["checkpoint_verified"] is True and 0 < step < STEPS
        cordon = evict.cordoned(c.run_dir)["n2"]          # honoured: signed with the run's key
        assert cordon["reason"] == "node_risk"

        # The spare took n2's place, and said so.
        [joined] = [r["event"] for r in c.events("node-n3-launcher.jsonl", event_types.SPARE_JOINED)]
        assert joined["replaces"] == "n2" and joined["cordon_id"] == cordon["cordon_id"]
        assert joined["cordon_reason"] == "node_risk"
        launcher = json.loads(rundir.launcher_path(c.run_dir, "n3").read_text())
        assert launcher["spare"] is True and launcher["replaces"] == "n2"

        # The same world size before and after; resumed from the drain's checkpoint, nothing past it lost.
        starts = [r["event"] for r in c.events("rank-0.jsonl", event_types.RUN_START)]
        assert {s["world_size"] for s in starts} == {2}, starts
        assert starts[-1]["resumed_from"] == step
        trained = [r["step"] for r in step_records(c, 0)]
        assert trained == list(range(1, STEPS + 1))       # every step once: none lost, none trained twice
        hosts = {json.loads(p.read_text())["host"] for p in rundir.ranks_dir(c.run_dir).glob("rank-*.json")}
        assert hosts == {"n1", "n3"}                       # the last job: n1 and the spare, not n2
        assert c.events("rank-0.jsonl", event_types.RUN_END)[-1]["event"]["reason"] == "completed"

        # The data where an uninterrupted run of two ranks has it: the order did not change.
        _, final = CheckpointManager(c.run_dir).load_latest()
        config = cfg.TrainConfig()
        cfg.load_file(config, str(c.run_dir / "config.yaml"))
        assert final["trainer"]["step"] == STEPS
        assert final["data"] == {"consumed": STEPS * config.optim.batch_size, "world_size": 2, "done": []}
