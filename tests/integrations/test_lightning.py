"""The Lightning integration with the real Lightning Trainer on CPU: a NaN skipped (the optimizer step does
not happen), a run of spikes rolled back to the last stable checkpoint with the LR halved, the agent's
cost_stop obeyed; a second fit resuming from the verified checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("lightning")

from examples.hf_trainer import faults_of  # noqa: E402
from examples.lightning_module import batches, build  # noqa: E402
from tests.integrations.policies import recovery_policy  # noqa: E402
from tests.library.test_plain_loop import GUARD, request_when_step_written  # noqa: E402
from tests.trainer.helpers import events, step_records  # noqa: E402
from trainguard.runtime.checkpoint import CheckpointManager  # noqa: E402


@pytest.mark.slow
def test_lightning_skips_a_nan_rolls_back_spikes_and_obeys_cost_stop(tmp_path):
    run = tmp_path / "run"
    policy = recovery_policy(tmp_path)
    trainer, module, callback = build(str(run), 60, faults_of(["nan@5", "spike@22"]), str(policy))
    seen = {}
    def remember(_, args):                                   # the weights as step 5 and step 6 begin
        seen.setdefault(callback.protector.state.step, [p.detach().clone() for p in module.parameters()])
    module.embed.register_forward_pre_hook(remember)
    agent = request_when_step_written(run, 27, "cost_stop")
    trainer.fit(module, batches(60))
    agent.join()

    assert callback.exit_code == 0
    assert [(e["step"], e["reason"]) for e in events(run, "skip_step")] == [
        (5, "nan"), (22, "loss_spike"), (23, "loss_spike")]
    assert all(torch.equal(a, b) for a, b in zip(seen[4], seen[5]))       # no optimizer step at 5
    (rollback,) = events(run, "rollback")
    assert (rollback["step"], rollback["restored_step"], rollback["source"]) == (24, 20, "guard")
    steps = [r["step"] for r in step_records(run)]
    assert steps[:24] == list(range(1, 25)) and steps[24] == 21
    rates = [r["metrics"]["learning_rate"] for r in step_records(run)]
    assert set(rates[:24]) == {1e-2} and set(rates[24:]) == {5e-3}       # the default scale_lr: lr x 0.5

    (ack,) = events(run, "action")
    assert ack["action"] == "cost_stop" and ack["id"] == "s1" and steps[-1] == ack["step"] < 60
    summary = json.loads((run / "cost_summary.json").read_text())
    assert summary["checkpoint_verified"] is True and summary["step"] == ack["step"]
    saved = CheckpointManager(run).load(CheckpointManager(run).latest_verified())
    assert {"model", "optim", "rng", "guard", "cost", "trainer"} <= set(saved)

    # Snapshots (docs/library.md "Recovery") through on_train_batch_end; no in-process restart, said once.
    assert [e["step"] for e in events(run, "snapshot_saved")][:4] == [5, 10, 15, 20]
    assert callback.protector.recovery.said == {"Lightning"}

    # A failure propagates out of fit(); the restarted run resumes from the cost stop's checkpoint, then
    # from the snapshot taken on top of it (no other checkpoint in between: checkpoint_every=100).
    snap = (ack["step"] // 5 + 1) * 5
    crashing, module, callback = build(str(run), snap + 3, {}, str(policy), checkpoint_every=100)

    def fail(_, args):
        if callback.protector.state.step == snap + 1:
            raise RuntimeError("injected failure")
    module.embed.register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="injected failure"):
        crashing.fit(module, batches(20))
    callback.protector.close()                     # the process ends; its snapshots stay for the restart
    again, module, callback = build(str(run), snap + 3, {}, str(policy), checkpoint_every=100)
    again.fit(module, batches(10))
    assert callback.exit_code is None
    assert events(run, "checkpoint_restored")[-1]["step"] == ack["step"]
    assert events(run, "snapshot_restored")[-1]["restored_step"] == snap
    assert [r["step"] for r in step_records(run)][-3:] == [snap + 1, snap + 2, snap + 3]


@pytest.mark.parametrize("steps, warned", [(0, True), (3, False)])
def test_lightning_max_steps_without_steps_on_the_callback_warns(steps, warned, tmp_path):
    import warnings

    from examples.lightning_module import TinyLM, pl
    from trainguard.protect.lightning import ProtectCallback

    callback = ProtectCallback(str(tmp_path / "run"), steps=steps)
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", devices=1, callbacks=[callback], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path / "lightning"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyLM({}, lambda: callback.protector.state.step + 1), batches(3))
    ours = [w for w in caught if "ProtectCallback(steps=3)" in str(w.message)]
    assert len(ours) == (1 if warned else 0)


def test_lightning_in_shadow_records_the_actions_and_trains_on_unchanged(tmp_path):
    """The Lightning callback in shadow (the policy's actions.mode): the spikes' skips and rollback and the
    agent's cost_stop are shadow_action events; every step steps and the fit runs to its end."""
    run = tmp_path / "run"
    policy = tmp_path / "policy.yaml"
    policy.write_text(json.dumps({"guard": GUARD, "actions": {"mode": "shadow"}}))   # JSON is YAML
    trainer, module, callback = build(str(run), 30, faults_of(["spike@14"]), str(policy))
    agent = request_when_step_written(run, 18, "cost_stop")
    trainer.fit(module, batches(30))
    agent.join()

    assert callback.exit_code is None
    shadowed = [(e["step"], e["action"], e["source"]) for e in events(run, "shadow_action")]
    assert shadowed[:3] == [(14, "skip_step", "guard"), (15, "skip_step", "guard"), (16, "rollback", "guard")]
    assert [e["action"] for e in events(run, "shadow_action") if e["source"] == "control"] == ["cost_stop"]
    assert not events(run, "skip_step") and not events(run, "rollback") and not events(run, "action")
    assert [r["step"] for r in step_records(run)] == list(range(1, 31))
    assert not (run / "cost_summary.json").exists()
