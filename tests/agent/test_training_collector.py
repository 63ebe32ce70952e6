"""The training collector over records written by trainguard.tls.Writer: values, counters, malformed lines,
checkpoint age, cost, and restarts that neither lose nor double a step."""

from __future__ import annotations

import json
import math
import os
import time

import pytest

from trainguard import rundir, tls
from trainguard.agent.collector import CollectorDisabled, Context
from trainguard.agent.collectors.training import TrainingCollector

T0 = 1_700_000_000.0


def samples(sample) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in sample.families for s in f.samples}


def get(values: dict, name: str, **labels):
    return values.get((name, tuple(sorted(labels.items()))))


def step_record(step: int, rank: int, **metrics) -> dict:
    base = {"loss": 3.0 - step * 0.01, "grad_norm": 1.5, "learning_rate": 3e-4, "tokens_per_second": 5000.0,
            "step_time_seconds": 0.2, "data_wait_seconds": 0.02, "comm_seconds": 0.03, "mfu": 0.41,
            "tokens_trained": 1000 * step, "tokens_loaded": 1050 * step}
    return tls.make_record(step=step, timestamp=T0 + step, run_id="gpt", rank=rank, metrics={**base, **metrics},
                           hardware={"mem_allocated_bytes": 2**30, "mem_reserved_bytes": 2**31},
                           system={"gpu_count": 8, "world_size": 8})


def event_record(kind: str, step: int, timestamp: float, rank: int = 0, **fields) -> dict:
    return tls.make_record(step=step, timestamp=timestamp, run_id="gpt", rank=rank,
                           event={"type": kind, "step": step, **fields})


def collector(run_dir, on_decision=None, **options) -> TrainingCollector:
    """Saves after every update unless told otherwise, so each test sees its state on disk."""
    return TrainingCollector(Context(run_dir=run_dir, node="node-a", options={"save_every_seconds": 0.0, **options},
                                     on_decision=on_decision))


@pytest.fixture
def run_dir(tmp_path):
    (tmp_path / "tls").mkdir()
    return tmp_path


def test_step_metrics_per_rank(run_dir):
    writers = [tls.Writer(run_dir / "tls" / f"rank-{r}.jsonl") for r in (0, 1)]
    for step in range(1, 6):
        for rank, writer in enumerate(writers):
            writer.write(step_record(step, rank, loss=math.nan if (rank, step) == (1, 5) else 2.5))
    writers[0].write(event_record("skip_step", 5, T0 + 5.5, reason="nan"))
    values = samples(collector(run_dir).update())
    r0, r1 = {"run_id": "gpt", "rank": "0"}, {"run_id": "gpt", "rank": "1"}
    assert get(values, "trainguard_training_loss", **r0) == 2.5
    assert math.isnan(get(values, "trainguard_training_loss", **r1))
    assert get(values, "trainguard_training_step", **r1) == 5
    assert get(values, "trainguard_training_last_step_timestamp_seconds", **r0) == T0 + 5
    assert get(values, "trainguard_training_steps_total", **r0) == 5
    assert get(values, "trainguard_training_tokens_trained", **r0) == 5000
    assert get(values, "trainguard_training_tokens_loaded", **r0) == 5250
    assert get(values, "trainguard_training_mfu_ratio", **r0) == 0.41
    assert get(values, "trainguard_training_comm_seconds", **r0) == 0.03
    assert get(values, "trainguard_training_data_wait_seconds", **r0) == 0.02
    assert get(values, "trainguard_training_memory_allocated_bytes", **r0) == 2**30
    assert get(values, "trainguard_training_events_total", **r0, type="skip_step") == 1
    assert get(values, "trainguard_training_events_total", **r1, type="skip_step") == 0  # exported from the start
    assert get(values, "trainguard_tls_records_total", file="rank-0.jsonl") == 6
    for name, labels in values:   # bounded labels only
        assert not {"step", "pid"} & {key for key, _ in labels}, name


def test_incremental_reads_count_each_step_once(run_dir):
    source = collector(run_dir)
    with tls.Writer(run_dir / "tls" / "rank-0.jsonl") as writer:
        for step in range(1, 4):
            writer.write(step_record(step, 0))
            source.update()
        source.update()
    values = samples(source.update())
    assert get(values, "trainguard_training_steps_total", run_id="gpt", rank="0") == 3


def test_malformed_lines_are_counted_and_logged_with_file_and_line(run_dir, capsys):
    path = run_dir / "tls" / "rank-0.jsonl"
    with tls.Writer(path) as writer:
        writer.write(step_record(1, 0))
    with open(path, "ab") as handle:
        handle.write(b'{"timestamp": "2024-03-15T14:22:18Z", "metrics": {"loss": "lots"}}\n{oops\n')
    with tls.Writer(path) as writer:
        writer.write(step_record(2, 0))
    values = samples(collector(run_dir).update())
    assert get(values, "trainguard_tls_malformed_lines_total", file="rank-0.jsonl") == 2
    assert get(values, "trainguard_training_steps_total", run_id="gpt", rank="0") == 2
    logged = capsys.readouterr().out
    assert f"{path}:2: metrics.loss" in logged and f"{path}:3: not valid JSON" in logged


def test_rank_comes_from_the_file_name_when_records_lack_it(run_dir):
    with open(run_dir / "tls" / "rank-3.jsonl", "wb") as handle:
        handle.write(b'{"timestamp": "2024-03-15T14:22:18Z", "step": 7, "metrics": {"loss": 2.356}}\n')
    values = samples(collector(run_dir).update())
    assert get(values, "trainguard_training_loss", run_id="", rank="3") == 2.356


def manifest_of(step: int) -> str:
    """The fields every checkpoint manifest has (trainguard.rundir.checkpoint_manifest): what the agent counts."""
    return json.dumps({"format": "trainguard-checkpoint/2", "step": step, "signature": {"value": "0" * 64},
                       "files": {}})


def test_checkpoint_age_from_events_and_from_disk(run_dir):
    source = collector(run_dir)
    manifest = run_dir / "checkpoints" / "step_10" / "manifest.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(manifest_of(10))
    written = time.time() - 3600
    os.utime(manifest, (written, written))
    values = samples(source.update())          # no event yet: the newest manifest on disk says when
    assert get(values, "trainguard_checkpoint_last_step", run_id="") == 10
    assert get(values, "trainguard_checkpoint_last_timestamp_seconds", run_id="") == pytest.approx(written)
    saved_at = time.time() - 120
    with tls.Writer(run_dir / "tls" / "rank-0.jsonl") as writer:
        writer.write(event_record("checkpoint_saved", 20, saved_at))
    sample = source.update()
    values = samples(sample)
    assert get(values, "trainguard_checkpoint_last_step", run_id="gpt") == 20
    assert get(values, "trainguard_checkpoint_last_timestamp_seconds", run_id="gpt") == pytest.approx(saved_at)
    assert sample.tls["system"]["last_checkpoint"] == "step_20"


def test_checkpoint_age_counts_from_the_save(run_dir):
    with tls.Writer(run_dir / "tls" / "rank-0.jsonl") as writer:
        writer.write(event_record("checkpoint_saved", 20, time.time() - 300))
    age = get(samples(collector(run_dir).update()), "trainguard_checkpoint_age_seconds", run_id="gpt")
    assert 299 < age < 400


def test_restart_resumes_from_saved_offsets_without_doubling(run_dir):
    path = run_dir / "tls" / "rank-0.jsonl"
    with tls.Writer(path) as writer:
        for step in range(1, 11):
            writer.write(step_record(step, 0))
        first = collector(run_dir)
        first.update()
        for step in range(11, 16):
            writer.write(step_record(step, 0))
        first.update()
        saved = json.loads((run_dir / "agent" / "offsets-node-a.json").read_text())
        for step in range(16, 21):
            writer.write(step_record(step, 0))
        first.update()      # read 16..20, then "killed": the file on disk is rolled back to before that read
        (run_dir / "agent" / "offsets-node-a.json").write_text(json.dumps(saved))
        second = collector(run_dir)
        assert second.restored
        for step in range(21, 26):
            writer.write(step_record(step, 0))
        values = samples(second.update())
    assert get(values, "trainguard_training_steps_total", run_id="gpt", rank="0") == 25
    assert get(values, "trainguard_training_step", run_id="gpt", rank="0") == 25
    assert get(values, "trainguard_tls_records_total", file="rank-0.jsonl") == 25


def test_state_survives_a_restart_with_nothing_new(run_dir):
    with tls.Writer(run_dir / "tls" / "rank-0.jsonl") as writer:
        writer.write(step_record(1, 0, loss=1.25))
    collector(run_dir).update()
    values = samples(collector(run_dir).update())
    assert get(values, "trainguard_training_loss", run_id="gpt", rank="0") == 1.25
    assert get(values, "trainguard_training_steps_total", run_id="gpt", rank="0") == 1


TINY_BUDGET = "cost: {price_per_gpu_hour: 100.0, budget_per_1k_steps: 100.0, min_steps: 5, window_steps: 10}\n"


def test_cost_state_and_decisions(run_dir, tmp_path):
    policy = tmp_path / "agent-policy.yaml"       # the agent's own (its config's), not one found in RUN/
    # 8 GPUs at $100/h, one step per second: $222 per 1000 steps against a budget of $100 -> every tier.
    policy.write_text(TINY_BUDGET)
    decisions = []
    source = collector(run_dir, on_decision=decisions.append, policy=str(policy))
    with tls.Writer(run_dir / "tls" / "rank-0.jsonl") as writer:
        for step in range(1, 31):
            writer.write(step_record(step, 0))
    values = samples(source.update())
    run = {"run_id": "gpt"}
    assert get(values, "trainguard_cost_per_1k_steps_usd", **run) == pytest.approx(8 * 100 / 3600 * 1000)
    assert get(values, "trainguard_cost_usd", **run) == pytest.approx(29 * 8 * 100 / 3600)
    assert get(values, "trainguard_cost_tier", **run) == 3
    assert get(values, "trainguard_cost_billable_gpus", **run) == 8
    assert get(values, "trainguard_cost_overrun_ratio", **run) > 1
    assert [d.action for d in decisions] == ["cost_warn", "cost_throttle", "cost_stop"]
    restarted = collector(run_dir, on_decision=decisions.append, policy=str(policy))   # fired tiers are remembered
    with tls.Writer(run_dir / "tls" / "rank-0.jsonl") as writer:
        writer.write(step_record(31, 0))
    restarted.update()
    assert len(decisions) == 3


def test_a_policy_planted_in_the_run_directory_decides_nothing(run_dir):
    """A RUN/policy.yaml with a tiny budget, dropped by anyone who can write the run directory,
    made the agent issue all three cost tiers (the trainer stopped at step 23 of 400). Unsigned, it is not used."""
    rundir.policy_path(run_dir).write_text(TINY_BUDGET)
    decisions = []
    source = collector(run_dir, on_decision=decisions.append)
    with tls.Writer(run_dir / "tls" / "rank-0.jsonl") as writer:
        for step in range(1, 31):
            writer.write(step_record(step, 0))
    values = samples(source.update())
    assert decisions == [] and get(values, "trainguard_cost_tier", run_id="gpt") == 0


def test_tls_fragment_for_the_node_record(run_dir):
    with tls.Writer(run_dir / "tls" / "rank-1.jsonl") as writer:
        writer.write(step_record(4, 1, loss=2.0))
    with tls.Writer(run_dir / "tls" / "rank-0.jsonl") as writer:
        writer.write(step_record(5, 0, loss=1.0))
    fragment = collector(run_dir).update().tls
    assert fragment["step"] == 5 and fragment["run_id"] == "gpt"
    assert fragment["metrics"]["loss"] == 1.0 and fragment["system"]["gpu_count"] == 8


def test_without_a_run_dir_the_collector_disables_itself():
    with pytest.raises(CollectorDisabled, match="no run directory"):
        TrainingCollector(Context(run_dir=None))


def test_saves_are_spaced_but_a_restart_still_counts_each_step_once(run_dir):
    path = run_dir / "tls" / "rank-0.jsonl"
    offsets = run_dir / "agent" / "offsets-node-a.json"
    with tls.Writer(path) as writer:
        writer.write(step_record(1, 0))
        first = collector(run_dir, save_every_seconds=3600.0)
        first.update()                       # the first read saves (nothing saved yet)
        for step in range(2, 6):
            writer.write(step_record(step, 0))
            first.update()                   # read, but not saved: within the spacing
        assert json.loads(offsets.read_text())["state"]["ranks"]["0"]["steps_total"] == 1
        killed_values = samples(first.update())
        assert get(killed_values, "trainguard_training_steps_total", run_id="gpt", rank="0") == 5
        second = collector(run_dir)          # the first was killed: resume from the save after step 1
        values = samples(second.update())
    assert get(values, "trainguard_training_steps_total", run_id="gpt", rank="0") == 5
    first.close()                            # a clean stop saves what is unsaved
    assert json.loads(offsets.read_text())["state"]["ranks"]["0"]["steps_total"] == 5


def test_checkpoints_are_listed_again_only_when_the_folder_changes_or_at_the_rescan(tmp_path, monkeypatch):
    """RUN/checkpoints holds hundreds of checkpoints on a network filesystem: it is listed again when a save
    renames a new step_<N> into it (its mtime changes) or every rescan_seconds, not at every update."""
    from trainguard.agent.collectors import training

    folder = tmp_path / "checkpoints"
    (folder / "step_10").mkdir(parents=True)
    (folder / "step_10" / "manifest.json").write_text(manifest_of(10))
    listings = []
    monkeypatch.setattr(training, "_newest_checkpoint",
                        lambda path, listed=training._newest_checkpoint: listings.append(path) or listed(path))
    now = [100.0]
    lister = training.CheckpointLister(folder, rescan_seconds=30.0, clock=lambda: now[0])
    assert lister.newest()[1] == 10
    now[0] += 10
    assert lister.newest()[1] == 10 and len(listings) == 1          # nothing changed: not listed again
    staged = tmp_path / "step_20.tmp"
    staged.mkdir()
    (staged / "manifest.json").write_text(manifest_of(20))
    before = os.stat(folder).st_mtime_ns
    staged.rename(folder / "step_20")                               # as runtime/checkpoint/store.py saves
    os.utime(folder, ns=(before + 1_000_000, before + 1_000_000))    # a coarse clock could leave mtime as it was
    assert lister.newest()[1] == 20 and len(listings) == 2
    (folder / "step_30").mkdir()
    (folder / "step_30" / "manifest.json").write_text(manifest_of(30))
    os.utime(folder, ns=(before + 1_000_000, before + 1_000_000))    # a change the mtime does not show ...
    assert lister.newest()[1] == 20 and len(listings) == 2
    now[0] += 30
    assert lister.newest()[1] == 30 and len(listings) == 3          # ... is found at the rescan


def test_saved_state_that_does_not_prove_itself_is_not_resumed_from(run_dir):
    """RUN/agent/offsets-<node>.json holds the cost meter's state: a forged one (the spend of a run ten times
    over, tiers already fired) decided the agent's cost tiers after its restart. It is signed now."""
    with tls.Writer(run_dir / "tls" / "rank-0.jsonl") as writer:
        writer.write(step_record(1, 0, loss=1.25))
    first = collector(run_dir)
    first.update()
    first.close()
    saved = json.loads(rundir.offsets_path(run_dir, "node-a").read_text())
    assert collector(run_dir).restored                                    # its own, signed: resumed
    forged = {k: v for k, v in saved.items() if k not in ("signature", "key_id")}
    forged["cost"] = {**forged["cost"], "cost_usd": 1e9, "fired": ["cost_warn"]}
    rundir.offsets_path(run_dir, "node-a").write_text(json.dumps(forged))
    assert not collector(run_dir).restored                                # unsigned: followed from the start
    rundir.offsets_path(run_dir, "node-a").write_text(json.dumps({**saved, "cost": forged["cost"]}))
    assert not collector(run_dir).restored                                # changed since signed
