"""The LR schedules and adaptive clipping in real CPU runs of the tiny model: the phase events are what
the logged statistics say they should be, and `trainguard replay` of the log reproduces them."""

from __future__ import annotations

import json
import statistics

import pytest
import yaml

from tests.trainer.helpers import events, step_records, train
from trainguard.cli import main as trainguard

# Short spans so a few dozen steps pass through every phase; the rules are the defaults'.
BREATHING = {"breathing": {"inhale_steps": 8, "exhale_factor": 0.98, "pause_ratio": 0.5, "pause_window": 3,
                           "freeze_steps": 6}}
PHASES = {"stability": {"window": 10, "cv_max": 0.5, "unstable_margin": 1.5},
          "plateau": {"window": 20, "min_improvement": 0.02},
          "phase": {"min_phase_steps": 5, "development_decay": 0.99},
          "clipping": {"warmup_steps": 10, "percentile": 50.0, "history": 100}}
GUARD = dict(spike_min_steps=10, spike_window=64, grad_min_steps=10, rollback_after=3, rollback_window=10,
             rewarmup_steps=5, rollback_lr_factor=0.5)


def policy_file(tmp_path, dynamics, **guard):
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump({"dynamics": dynamics, **({"guard": guard} if guard else {})}))
    return str(path)


def changes(run):
    return [e for e in events(run, "lr_phase") if e["from"] is not None]


def replayed(run, capsys) -> dict:
    capsys.readouterr()
    assert trainguard(["replay", str(run), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["lr_phases"]


def test_breathing_run_phases_follow_the_logged_ratio_and_val_loss_and_replay_agrees(tmp_path, capsys):
    run = tmp_path / "run"
    assert train(run, "--steps", "36", "--schedule", "breathing", "--policy", policy_file(tmp_path, BREATHING),
                 "--clip-rule", "zscore") == 0
    steps = {r["step"]: r["metrics"] for r in step_records(run)}
    found = [(e["step"], e["from"], e["phase"], e["reason"]) for e in changes(run)]
    assert found[:3] == [(10, "warmup", "inhale", "warmup_done"), (18, "inhale", "exhale", "inhale_done"),
                         (21, "exhale", "pause", "gradients_calm")]
    # the pause came after pause_window exhale steps whose logged grad_norm / param_norm was under the bar
    for step in (19, 20, 21):
        assert steps[step]["grad_norm"] / steps[step]["param_norm"] < 0.5
    # the LR held at the peak while inhaling, decayed per step exhaling, froze while paused
    assert all(steps[s]["learning_rate"] == 0.0015 for s in range(11, 19))
    assert steps[20]["learning_rate"] == pytest.approx(0.0015 * 0.98)
    assert len({steps[s]["learning_rate"] for s in range(22, 28)}) == 1
    # the freeze ended with a validation loss; its verdict is the one the two losses give
    before, after = [e for e in events(run, "evaluation") if e["purpose"] == "lr_phase"][:2]
    assert (before["step"], before["wanted"], after["step"], after["wanted"]) == (21, "pause_start", 27, "pause_end")
    end = changes(run)[3]
    assert end["step"] == 27 and end["reason"] == ("val_loss_fell" if after["val_loss"] < before["val_loss"]
                                                   else "val_loss_held")
    # every step says what adaptive clipping did to it
    assert all({"param_norm", "clip_threshold", "clip_coef"} <= set(m) for m in steps.values())
    assert all(m["clip_threshold"] == 1.0 for s, m in steps.items() if s <= 25)     # ZClip warm-up: fixed
    assert any(m["clip_threshold"] != 1.0 for m in steps.values())
    lr_phases = replayed(run, capsys)
    assert lr_phases["match"] and len(lr_phases["replayed"]) == len(found) >= 4


def test_phase_run_transitions_match_the_logged_stability_and_plateau_and_replay_agrees(tmp_path, capsys):
    run = tmp_path / "run"
    assert train(run, "--steps", "80", "--schedule", "phase", "--policy", policy_file(tmp_path, PHASES),
                 "--clip-rule", "percentile") == 0
    skipped = {e["step"] for e in events(run, "skip_step")}
    kept = [r for r in step_records(run) if r["step"] not in skipped]
    found = changes(run)
    assert [e["phase"] for e in found][:2] == ["exploration", "development"]
    assert {e["phase"] for e in found} >= {"exploration", "development", "refinement"}
    for event in found[1:]:
        upto = [r["metrics"] for r in kept if r["step"] <= event["step"]]
        norms, losses = [m["grad_norm"] for m in upto[-10:]], [m["loss"] for m in upto[-20:]]
        cv = statistics.pstdev(norms) / statistics.fmean(norms)
        improvement = None if len(losses) < 20 else (
            statistics.median(losses[:10]) - statistics.median(losses[10:])) / statistics.median(losses[:10])
        assert event["grad_norm_cv"] == pytest.approx(cv) and event["loss_improvement"] == pytest.approx(improvement)
        if event["reason"] == "gradients_stable":     # no plateau measured yet counts as no plateau
            assert cv <= 0.5 and (improvement is None or improvement >= 0.02)
        elif event["reason"] == "gradients_unstable":
            assert cv > 0.75
        else:
            assert event["reason"] == "loss_plateau" and cv <= 0.5 and improvement < 0.02
    refine = next(e for e in found if e["phase"] == "refinement")
    after = [r["metrics"]["learning_rate"] for r in step_records(run) if r["step"] > refine["step"]]
    assert set(after) == {refine["learning_rate"]}
    lr_phases = replayed(run, capsys)
    assert lr_phases["match"] and len(lr_phases["replayed"]) == len(found)


def test_a_rollback_restores_the_phase_of_the_checkpoint_and_replay_follows_it(tmp_path, capsys):
    run = tmp_path / "run"
    faults = ["spike@22", "spike@33", "spike@34", "spike@35"]
    assert train(run, "--steps", "40", "--checkpoint-every", "10", "--schedule", "breathing",
                 "--policy", policy_file(tmp_path, BREATHING, **GUARD),
                 *sum((["--inject", f] for f in faults), [])) == 0
    (rollback,) = events(run, "rollback")
    assert (rollback["step"], rollback["restored_step"]) == (35, 20)
    restored = [e for e in changes(run) if e["reason"] == "rollback"]
    assert [e["step"] for e in restored] == [35] and restored[0]["phase"] == "exhale"
    lr_phases = replayed(run, capsys)
    assert lr_phases["match"] and lr_phases["missing_snapshots"] == 0
    assert ["rollback" in str(change["reason"]) for change in lr_phases["replayed"]].count(True) == 1


def test_cosine_run_has_warmup_and_decay_events(tmp_path, capsys):
    run = tmp_path / "run"
    assert train(run, "--steps", "12") == 0
    opening = events(run, "lr_phase")[0]
    assert (opening["schedule"], opening["phase"], opening["reason"]) == ("cosine", "warmup", "start")
    assert [(e["step"], e["phase"]) for e in changes(run)] == [(10, "decay")]
    assert replayed(run, capsys)["match"]


def test_bad_schedule_flag_and_config_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        train(tmp_path / "a", "--schedule", "linear")
    assert exc.value.code == 2
    assert train(tmp_path / "b", "--set", "optim.clip_rule=agc") == 2
    assert "optim.clip_rule" in capsys.readouterr().err
