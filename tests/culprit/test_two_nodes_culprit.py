"""Two simulated nodes (tests/culprit/cluster.py): a hang is named, and its node kept out (or not).

Real parts only: two `trainguard train --nnodes 1:2` launchers (torch's elastic agent, c10d rendezvous
on loopback, gloo), one agent per node with the embedded stall watchdog, py-spy, torch's Flight
Recorder; the FAKE NVML (tests/fakes) stands in for a GPU with an XID.
"""

from __future__ import annotations

import json

import pytest

from tests.culprit.cluster import FAST_KEEP_ALIVE, cluster, wait_until
from tests.servers import http_get
from trainguard.trainer import config as cfg
from trainguard.trainer.data import ShardLoader, open_stream

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# The hang comes after the checkpoint of step 20; the run ends 10 steps after it, enough to show the
# survivor (or both nodes) training on from it.
HANG_STEP, CHECKPOINT, LAST = 25, 20, 30
STEPS = ["--steps", str(LAST), "--checkpoint-every", "10"]


def incident_files(c, incident: dict) -> dict:
    directory = c.run_dir / "incidents" / incident["id"]
    return {p.name: p for p in directory.iterdir()}


def node_of_rank(c, incident: dict, rank: int) -> str:
    for name, path in incident_files(c, incident).items():
        if name.startswith("node-") and str(rank) in json.loads(path.read_text())["ranks"]:
            return json.loads(path.read_text())["node"]
    raise AssertionError(f"no node evidence lists rank {rank}")


def cli(capsys, *args: str) -> tuple[int, str]:
    """A `trainguard` command in this process (tests/culprit/test_cli.py runs the same commands as processes)."""
    from trainguard.cli import main

    code = main(list(args))
    return code, capsys.readouterr().out


def expected_data_state(c, steps_since_checkpoint: int) -> dict:
    """The survivor's data position: the windows both old ranks read until the checkpoint are done; it
    has read its own share of what was left since."""
    config = cfg.TrainConfig()
    cfg.load_file(config, str(c.run_dir / "config.yaml"))
    stream = open_stream(config.data)
    args = dict(block_size=config.model.block_size, val_fraction=config.data.val_fraction)
    old = ShardLoader(stream, rank=0, world_size=2, **args)
    old.load_state_dict({"consumed": CHECKPOINT * config.optim.batch_size})
    survivor = ShardLoader(stream, rank=0, world_size=1, **args)
    survivor.load_state_dict(old.state_dict())
    return {"consumed": steps_since_checkpoint * config.optim.batch_size, "world_size": 1,
            "done": [list(d) for d in survivor.done]}


def test_hang_on_a_rank_names_it_cordons_its_node_and_the_run_finishes_on_the_other(tmp_path, capsys):
    with cluster(tmp_path, rdzv_conf=FAST_KEEP_ALIVE) as c:
        for node in ("n1", "n2"):
            c.launch(node, *STEPS, f"--inject=hang@{HANG_STEP}:1")
        incident = c.wait_incident(150)
        bad = node_of_rank(c, incident, 1)
        good = ({"n1", "n2"} - {bad}).pop()
        assert incident["culprit"] == {"rank": 1, "node": bad, "ranks": [1]}, incident
        assert incident["action"] == "evict" and incident["confidence"] >= 0.8
        assert any("behind the wavefront" in r for r in incident["reasons"])
        files = incident_files(c, incident)
        assert json.loads(files["rank-1.fr.json"].read_text())["pg_status"]        # Flight Recorder
        assert "process_faults" in files["rank-1.stack.txt"].read_text()            # py-spy: the hung frame
        assert "torch/autograd" in files["rank-0.stack.txt"].read_text()             # waiting in DDP's all-reduce
        assert (c.run_dir / "control" / "cordon" / bad).exists()

        assert c.wait(good, 200) == 0
        assert c.wait(bad, 30) != 0                                     # its launcher was ended
        survivor = c.events("rank-0.jsonl", "run_start")[-1]["event"]
        assert survivor["world_size"] == 1 and survivor["resumed_from"] == CHECKPOINT
        assert c.events("rank-0.jsonl", "run_end")[-1]["event"]["reason"] == "completed"
        from trainguard.runtime.checkpoint.manager import CheckpointManager

        _, final = CheckpointManager(c.run_dir).load_latest()
        assert final["trainer"]["step"] == LAST
        assert final["data"] == expected_data_state(c, LAST - CHECKPOINT)

        event = [r for n in ("n1", "n2") for r in c.events(f"node-{n}-actions.jsonl", "culprit")]
        assert [(e["event"]["rank"], e["event"]["node"], e["event"]["kind"]) for e in event] == [(1, bad, "hang")]
        _, _, body = http_get(f"http://{c.addresses[good]}/metrics")
        assert f'trainguard_node_cordoned{{node="{bad}"}} 1.0' in body.decode()

        refused = c.launch(bad, *STEPS)                                  # kept out until uncordoned
        assert c.wait(bad, 60) == 4 and refused.returncode == 4
        assert "cordoned" in (tmp_path / f"launcher-{bad}.log").read_text()
        code, shown = cli(capsys, "incidents", "show", str(c.run_dir), incident["id"])
        assert code == 0 and f"rank 1 on {bad}" in shown and "(culprit)" in shown
        code, replayed = cli(capsys, "incidents", "replay", str(c.run_dir))
        assert code == 0 and "same" in replayed
        assert cli(capsys, "uncordon", str(c.run_dir), bad)[0] == 0
        assert not (c.run_dir / "control" / "cordon" / bad).exists()
        assert cli(capsys, "uncordon", str(c.run_dir), bad)[0] == 2


def test_with_eviction_off_the_incident_names_the_rank_and_restore_is_in_place(tmp_path):
    """recovery.mode in_process (the default): the restore asks the ranks, with a signed request, to recover
    in their own processes (agent/recover_in_process.py): no process is replaced; the culprit, asleep
    outside any collective, is interrupted; the others are released from their all-reduce."""
    with cluster(tmp_path, policy={"restore": {"evict": "off"}}, rdzv_conf=FAST_KEEP_ALIVE) as c:
        for node in ("n1", "n2"):
            c.launch(node, *STEPS, f"--inject=hang@{HANG_STEP}:1")
        incident = c.wait_incident(150)
        assert incident["culprit"]["rank"] == 1 and incident["action"] == "restore"
        assert "restore.evict is off" in incident["reasons"][-1]
        assert not (c.run_dir / "control" / "cordon").exists()
        assert [c.wait(n, 200) for n in ("n1", "n2")] == [0, 0]          # both nodes finish the run
        for rank in range(2):
            starts = [r["event"] for r in c.events(f"rank-{rank}.jsonl", "run_start")]
            assert len(starts) == 1 and starts[0]["world_size"] == 2, (rank, starts)   # no process replaced
        recovered = [c.events(f"rank-{rank}.jsonl", "in_process_restart") for rank in range(2)]
        assert all(len(events) == 1 for events in recovered), recovered
        events = [events[0]["event"] for events in recovered]
        request_id = events[0]["request"]
        assert request_id.startswith("restore-step") and {e["request"] for e in events} == {request_id}
        assert all(e["failed_rank"] == 1 and e["restored_step"] >= CHECKPOINT for e in events)
        assert c.events("rank-1.jsonl", "run_end")[-1]["event"]["reason"] == "completed"

        request = json.loads((c.run_dir / "control" / "recovery" / f"{request_id}.json").read_text())
        stack = c.run_dir / "incidents" / incident["id"] / "rank-1.stack.txt"
        assert "process_faults" in stack.read_text() and stack.stat().st_mtime <= request["issued_at"]  # evidence first
        done = [r["event"] for n in ("n1", "n2") for r in c.events(f"node-{n}-actions.jsonl", "action")
                if r["event"]["action"] == "restore"]
        assert {(e["recovery"], e["in_process"]["result"], e["in_process"]["request"]) for e in done} == {
            ("in_process", "recovered", request_id)} and all(e["ended"] == [] for e in done), done


def test_every_rank_in_the_same_collective_is_no_culprit_and_no_eviction(tmp_path):
    with cluster(tmp_path, rdzv_conf=FAST_KEEP_ALIVE) as c:
        for node in ("n1", "n2"):
            c.launch(node, *STEPS, f"--inject=commhang@{HANG_STEP}")
        incident = c.wait_incident(150)
        assert incident["culprit"] is None and incident["action"] == "restore"
        assert incident["reasons"][0].startswith("no culprit: all ranks in the same collective")
        assert not (c.run_dir / "control" / "cordon").exists()
        # each node's agent acts on its own node and writes its own record, the two not at the same moment:
        # wait until both have, not until the first has (under load the second came later and the test failed)
        def restored_nodes():
            return {r["node"] for n in ("n1", "n2") for r in c.events(f"node-{n}-actions.jsonl", "action")
                    if r["event"]["action"] == "restore"}

        wait_until(lambda: restored_nodes() == {"n1", "n2"}, 60, "restore on both nodes", c)


def test_an_xid_on_one_node_during_a_hang_makes_it_the_culprit(tmp_path):
    with cluster(tmp_path, policy={"restore": {"evict": "off"}}, nvml={"n1": "xid"}, rdzv_conf=FAST_KEEP_ALIVE) as c:
        for node in ("n1", "n2"):
            c.launch(node, *STEPS, f"--inject=commhang@{HANG_STEP}")
        incident = c.wait_incident(150)
        assert incident["culprit"]["node"] == "n1" and incident["confidence"] >= 0.95
        assert "XID" in incident["reasons"][0] and "on GPU 0" in incident["reasons"][0]
        signals = json.loads((c.run_dir / "incidents" / incident["id"] / "node-n1.json").read_text())
        assert signals["xids"] and signals["xids"][0]["gpu"] == 0
