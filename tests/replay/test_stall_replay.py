"""`trainguard replay` decides the agent watchdog's `restore` for a recorded hang (trainguard.decide.stall):
a node log that keeps writing while no step advances is a hang; a run that finished is not."""

import json
import subprocess
import sys

from trainguard import event_types, tls

T0 = 1_700_000_000.0


def _write(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(tls.encode(r) for r in records))


def _rank_steps(steps, start=T0, every=1.0):
    return [{"timestamp": start + i * every, "rank": 0, "step": step, "metrics": {"loss": 2.0, "grad_norm": 1.0}}
            for i, step in enumerate(steps)]


def _node_samples(until, last_step, every=5.0):
    """The agent's joined records: the hardware keeps being sampled, the step it reports stands still."""
    return [{"timestamp": T0 + t, "node": "gpu-node-1", "step": min(int(t), last_step),
             "metrics": {"loss": 2.0}, "hardware": {"gpu_util": 0.0}} for t in range(0, int(until), int(every))]


def _replay(run):
    out = subprocess.run([sys.executable, "-m", "trainguard.cli", "replay", str(run), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_hang_whose_node_log_keeps_writing_is_restored_once(tmp_path):
    run = tmp_path / "run"
    _write(run / "tls" / "rank-0.jsonl", _rank_steps(range(1, 51)))
    _write(run / "tls" / "node-gpu-node-1.jsonl", _node_samples(until=300, last_step=50))
    restores = [a for a in _replay(run)["actions"] if a["action"] == "restore"]
    assert len(restores) == 1, restores
    [restore] = restores
    assert restore["step"] == 50 and restore["reason"] == "stall"
    assert tls.parse_timestamp(restore["timestamp"]) >= T0 + 49 + 60


def test_steady_progress_and_a_finished_run_are_not_stalls(tmp_path):
    run = tmp_path / "run"
    end = {"timestamp": T0 + 50, "rank": 0, "event": {"type": "run_end"}}
    _write(run / "tls" / "rank-0.jsonl", _rank_steps(range(1, 51)) + [end])
    _write(run / "tls" / "node-gpu-node-1.jsonl", _node_samples(until=300, last_step=50))
    assert [a for a in _replay(run)["actions"] if a["action"] == "restore"] == []



def test_a_trainers_closing_summary_after_a_silence_is_a_finished_run_not_a_stall(tmp_path):
    """A Trainer logs a step every `logging_steps`: the steps after the last logged one and the final save
    read as silence up to its `run_summary` (the T5 run's TensorBoard file: 55 min). The summary says the
    run finished; a silence that no end follows is still a stall."""
    steps = _rank_steps(range(500, 25_500, 500), every=127.0)
    summary = {"timestamp": steps[-1]["timestamp"] + 3300, "rank": 0, "step": 25_337,
               "event": {"type": event_types.RUN_SUMMARY, "train_runtime": 9400.0, "train_loss": 1.8}}
    _write(tmp_path / "finished" / "tls" / "rank-0.jsonl", steps + [summary])
    assert [a for a in _replay(tmp_path / "finished")["actions"] if a["action"] == "restore"] == []
    evaluation = {**summary, "event": {"type": event_types.EVALUATION, "val_loss": 1.9}}
    _write(tmp_path / "silent" / "tls" / "rank-0.jsonl", steps + [evaluation])
    assert [a["step"] for a in _replay(tmp_path / "silent")["actions"] if a["action"] == "restore"] == [25_000]

def test_a_recorded_rollback_or_restore_counts_the_steps_again_from_where_it_went_back(tmp_path):
    """The soak's healthy reference: the guard rolled it back 4534 steps, and replay's watchdog, counting
    only a step beyond the newest seen as progress, called the minutes of steady steps that followed a
    stall. After a rollback or a restore (decide/stall.py's STARTED_EVENTS) they are progress, as live."""
    for kind in ("rollback", event_types.CHECKPOINT_RESTORED, event_types.SNAPSHOT_RESTORED,
                 event_types.IN_PROCESS_RESTART):
        run = tmp_path / kind
        before = _rank_steps(range(1, 301))
        went_back = {"timestamp": T0 + 300, "rank": 0, "step": 300, "event": {"type": kind}}
        after = _rank_steps(range(101, 401), start=T0 + 301)
        _write(run / "tls" / "rank-0.jsonl", before + [went_back] + after)
        assert [a for a in _replay(run)["actions"] if a["action"] == "restore"] == [], kind


def test_recorded_replica_checks_replay_to_the_same_rollbacks(tmp_path):
    from trainguard.decide import replica

    run = tmp_path / "run"
    records = _rank_steps(range(1, 31))
    good, bad = 0x1111, 0x2222
    for step, weights in ((10, (good, good, good)), (20, (good, bad, good))):
        check = replica.ReplicaCheck(step, T0 + step, weights, gradients=(7, 7, 7), recomputed=weights,
                                     nodes=("a", "b", "c"))
        records.append({"timestamp": T0 + step + 0.5, "rank": 0, "step": step,
                        "event": {"type": event_types.REPLICA_CHECK, "step": step, **replica.check_fields(check)}})
    _write(run / "tls" / "rank-0.jsonl", sorted(records, key=lambda r: r["timestamp"]))
    found = [(a["action"], a["step"], a["reason"]) for a in _replay(run)["actions"]]
    assert ("rollback", 20, "replica_mismatch") in found and ("rollback", 10, "replica_mismatch") not in found
