"""The Transformers integration with the real Trainer on CPU: a tiny GPT-2 from its config (no download),
a NaN skipped (the optimizer step does not happen), a run of spikes rolled back to the last stable
checkpoint with the Trainer's global_step moved back, the agent's cost_stop obeyed; and the Trainer's own
logs in the TLS file, and a second train() resuming from the verified checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from examples.hf_trainer import build, faults_of  # noqa: E402
from tests.integrations.policies import recovery_policy  # noqa: E402
from tests.library.test_plain_loop import GUARD, request_when_step_written  # noqa: E402
from tests.trainer.helpers import events, step_records  # noqa: E402
from trainguard.runtime.checkpoint import CheckpointManager  # noqa: E402


def weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow
def test_trainer_skips_a_nan_rolls_back_spikes_and_obeys_cost_stop(tmp_path):
    run = tmp_path / "run"
    policy = recovery_policy(tmp_path)
    trainer, callback = build(str(run), 60, faults_of(["nan@5", "spike@22"]), str(policy))
    before_nan = {}

    def remember(module, args, output):      # the weights before and after the NaN step
        if trainer.state.global_step in (4, 5) and module.training:
            before_nan.setdefault(trainer.state.global_step, weights(module))
    trainer.model.register_forward_hook(remember)
    agent = request_when_step_written(run, 27, "cost_stop")
    trainer.train()
    agent.join()

    assert callback.exit_code == 0
    assert [(e["step"], e["reason"]) for e in events(run, "skip_step")] == [
        (5, "nan"), (22, "loss_spike"), (23, "loss_spike")]
    assert all(torch.equal(a, b) for a, b in zip(before_nan[4], before_nan[5]))   # no optimizer step at 5
    (rollback,) = events(run, "rollback")
    assert (rollback["step"], rollback["restored_step"], rollback["source"]) == (24, 20, "guard")
    steps = [r["step"] for r in step_records(run)]
    assert steps[:24] == list(range(1, 25)) and steps[24] == 21           # the Trainer's step moved back
    rates = [r["metrics"]["learning_rate"] for r in step_records(run)]
    assert set(rates[:24]) == {1e-3} and set(rates[25:]) == {5e-4}        # the scheduler's base LR halved

    (ack,) = events(run, "action")
    assert ack["action"] == "cost_stop" and ack["id"] == "s1"
    assert trainer.state.global_step == ack["step"] == steps[-1] < 60     # the Trainer stopped there
    summary = json.loads((run / "cost_summary.json").read_text())
    assert summary["checkpoint_verified"] is True and summary["step"] == ack["step"]
    logged = events(run, "trainer_log")
    assert logged and {"loss", "learning_rate", "trainer_step"} <= set(logged[0])

    saved = CheckpointManager(run).load(CheckpointManager(run).latest_verified())
    assert {"model", "optim", "sched", "rng", "guard", "cost", "trainer"} <= set(saved)
    # Snapshots (docs/library.md "Recovery") through on_step_end; no in-process restart, said once.
    assert [e["step"] for e in events(run, "snapshot_saved")][:4] == [5, 10, 15, 20]
    assert callback.protector.recovery.said == {"the Transformers Trainer"}

    # A failure propagates out of train(); the restarted run resumes from the cost stop's checkpoint, then
    # from the snapshot taken on top of it (no other checkpoint in between: checkpoint_every=100).
    snap = (ack["step"] // 5 + 1) * 5
    crashing, callback = build(str(run), snap + 3, {}, str(policy), checkpoint_every=100)

    def fail(module, args, output):
        if module.training and crashing.state.global_step == snap + 1:
            raise RuntimeError("injected failure")
    crashing.model.register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="injected failure"):
        crashing.train()
    callback.protector.close()                     # the process ends; its snapshots stay for the restart
    again, callback = build(str(run), snap + 3, {}, str(policy), checkpoint_every=100)
    again.train()
    assert callback.exit_code is None
    assert events(run, "checkpoint_restored")[-1]["step"] == ack["step"]
    assert events(run, "snapshot_restored")[-1]["restored_step"] == snap
    assert [r["step"] for r in step_records(run)][-3:] == [snap + 1, snap + 2, snap + 3]


def test_the_trainers_checkpoint_folders_are_signed_and_verified_before_use(tmp_path):
    from transformers import Trainer, TrainingArguments

    from examples.hf_trainer import RandomTokens
    from trainguard.protect import hf_checkpoints
    from trainguard.protect.hf import ProtectCallback

    trainer, _ = build(str(tmp_path / "run"), 10, {})
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=10, per_device_train_batch_size=4,
                             save_strategy="steps", save_steps=5, report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=trainer.model, args=args, train_dataset=RandomTokens(),
                      callbacks=[ProtectCallback(tmp_path / "run", checkpoint_every=0)])
    trainer.train()
    five, ten = tmp_path / "out" / "checkpoint-5", tmp_path / "out" / "checkpoint-10"
    assert hf_checkpoints.verify_folder(five).ok and hf_checkpoints.verify_folder(ten).ok
    assert [e["trainer_step"] for e in events(tmp_path / "run", "trainer_checkpoint_signed")] == [5, 10]
    weights = next(p for p in ten.iterdir() if p.suffix == ".safetensors")
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")                   # one byte changed
    refused = hf_checkpoints.verify_folder(ten)
    assert not refused.ok and refused.code == "hash_mismatch" and weights.name in refused.reason
    assert hf_checkpoints.latest_verified(tmp_path / "out") == five
    (five / "trainer_state.json").rename(five / "moved.json")
    assert hf_checkpoints.verify_folder(five).code == "missing_file"
    assert hf_checkpoints.latest_verified(tmp_path / "out") is None


@pytest.mark.parametrize("checkpoint_every, warned", [(2, True), (0, False)])
def test_two_checkpointers_on_one_run_are_warned_of(checkpoint_every, warned, tmp_path):
    import warnings

    from transformers import Trainer, TrainingArguments

    from examples.hf_trainer import RandomTokens
    from trainguard.protect.hf import ProtectCallback

    model = build(str(tmp_path / "run"), 2, {})[0].model
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4,
                             save_strategy="steps", save_steps=2, report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(),
                      callbacks=[ProtectCallback(tmp_path / "run", checkpoint_every=checkpoint_every)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    ours = [w for w in caught if "every checkpoint is written twice" in str(w.message)]
    assert len(ours) == (1 if warned else 0)


def test_trainer_in_shadow_records_the_actions_and_trains_on_unchanged(tmp_path):
    """The callback in shadow (the policy's actions.mode): the spikes' skips and rollback and the agent's
    cost_stop are shadow_action events; the Trainer steps every step and runs to max_steps."""
    run = tmp_path / "run"
    policy = tmp_path / "policy.yaml"
    policy.write_text(json.dumps({"guard": GUARD, "actions": {"mode": "shadow"}}))   # JSON is YAML
    trainer, callback = build(str(run), 30, faults_of(["spike@14"]), str(policy))
    agent = request_when_step_written(run, 18, "cost_stop")
    trainer.train()
    agent.join()

    assert callback.exit_code is None and trainer.state.global_step == 30
    shadowed = [(e["step"], e["action"], e["source"]) for e in events(run, "shadow_action")]
    assert shadowed[:3] == [(14, "skip_step", "guard"), (15, "skip_step", "guard"), (16, "rollback", "guard")]
    [cost_stop] = [e for e in events(run, "shadow_action") if e["action"] == "cost_stop"]
    assert cost_stop["source"] == "control" and cost_stop["alertname"] == "CostBudgetStop"
    assert not events(run, "skip_step") and not events(run, "rollback") and not events(run, "action")
    assert [r["step"] for r in step_records(run)] == list(range(1, 31))      # no step moved back
    assert not (run / "cost_summary.json").exists()
    assert events(run, "run_end")[-1]["reason"] == "completed"
