"""The failure shapes, each through `trainguard replay`'s own engine (the embedded path: the guard,
the cost meter, the stall watchdog, the ledger) on a case of the efficacy corpus (tests/efficacy/corpus.py),
and the replay screens of the rules they added held to the rules' own step loop."""

from __future__ import annotations

import numpy as np
import pytest

from tests.decide.test_columns import block, guard_many, guard_state, healthy
from tests.efficacy import corpus
from trainguard.decide import batch
from trainguard.decide.guard import Guard, StepStats
from trainguard.policy import GuardPolicy, Policy
from trainguard.replay import expect, timeline
from trainguard.trainer.config import RunConfig


def replayed(case: corpus.Case, tmp_path) -> list[tuple[str, int | None]]:
    result = timeline.replay_logs([case.write(tmp_path)], Policy(), hold=case.hold)
    return [(action.action, action.step) for action in result.actions]


def harmful(found) -> list:
    return [(name, step) for name, step in found if name in corpus.HARMFUL]


def test_isolated_loss_scaler_overflows_are_skipped_never_escalated(tmp_path):
    case = corpus.loss_scaler_overflow(seed=1, steps=4000)
    found = replayed(case, tmp_path)
    overflows = [r["step"] for r in case.files["rank-0.jsonl"] if not np.isfinite(r["metrics"]["grad_norm"])]
    assert harmful(found) == []
    assert {step for _, step in found} == set(overflows)         # a skip at each overflow, nothing else


def test_a_burst_of_overflows_the_scaler_cannot_settle_does_escalate():
    guard = Guard()
    for step in range(1, 101):
        guard.observe(StepStats(step, 3.0, 1.0, None, float(step)))
    actions = [guard.observe(StepStats(100 + i, 3.0, float("inf"), None, 100.0 + i)).action for i in range(1, 11)]
    burst = GuardPolicy().overflow_burst
    assert actions[:burst - 1] == ["skip_step"] * (burst - 1) and "rollback" in actions


@pytest.mark.parametrize("anneal", [False, True])
def test_a_data_mix_change_is_a_new_level_not_a_rollback(tmp_path, anneal):
    case = corpus.data_mix_change(seed=2, steps=3000, anneal=anneal)
    found = replayed(case, tmp_path)
    assert harmful(found) == []
    # at most the steps the guard needs to tell a new level from a spike, once
    assert len(found) < GuardPolicy().shift_steps and all(step >= case.onset for _, step in found)


@pytest.mark.parametrize("norms", [True, False])
def test_the_guard_accepts_the_new_level_and_says_so(norms):
    """With a normal gradient norm beside them the steps of the new level are not skipped (their updates are
    ordinary ones); in a loss-only log they are, while the guard tells a new level from a spike."""
    def norm(step: int) -> float | None:
        return 1.0 + 0.01 * (step % 3) if norms else None

    guard, losses = Guard(), [3.0 + 0.01 * (i % 5) for i in range(200)]
    for step, loss in enumerate(losses, 1):
        assert not guard.observe(StepStats(step, loss, norm(step), None, float(step)))
    decisions = [guard.observe(StepStats(200 + i, 3.6 + 0.01 * (i % 5), norm(i), None, 200.0 + i)) for i in range(1, 301)]
    shifting = [d for d in decisions if d.reason]
    assert [d.detail["level_shift"] for d in shifting] == list(range(1, GuardPolicy().shift_steps))
    assert [d.action for d in shifting] == [None if norms else "skip_step"] * (GuardPolicy().shift_steps - 1)
    (notice,) = guard.notices
    assert notice["type"] == "loss_level_shift" and notice["loss_after"] > 3.5


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_slow_divergence_is_rolled_back_before_the_loss_is_20_percent_up(tmp_path, seed):
    case = corpus.slow_divergence(seed, 3000)
    found = replayed(case, tmp_path)
    (entry,) = expect.parse(case.expect, case.name).entries
    first = next(step for name, step in found if name == "rollback")
    assert entry.step[0] <= first <= entry.step[1]           # after it starts, before the trend is +20%


def test_a_restart_appended_to_the_log_is_no_spike_and_no_hang(tmp_path):
    for seed in range(3):
        case = corpus.restarted(seed, 3000)
        assert replayed(case, tmp_path) == []


def test_heavy_tailed_healthy_noise_over_tens_of_thousands_of_steps(tmp_path):
    case = corpus.heavy_tailed(seed=0, steps=30_000)
    found = replayed(case, tmp_path)
    assert harmful(found) == [] and {name for name, _ in found} <= {"skip_step"}
    assert len(found) < 30_000 // 300                             # skips are rare, not a habit


def test_a_spike_in_the_first_steps_is_seen(tmp_path):
    case = corpus.warmup_spike(seed=0, steps=400)
    assert ("skip_step", case.onset) in replayed(case, tmp_path)
    quiet = corpus.warmup_healthy(seed=0, steps=400)              # the healthy warm-up wobble is no spike
    assert replayed(quiet, tmp_path) == []


def test_first_run_defaults_checkpoint_by_time():
    """`trainguard train --steps 100000` with nothing else must have checkpoints to roll back to
    (tests/library/test_loss_level.py: an impossible rollback is not counted toward the stop)."""
    config = RunConfig()
    assert config.checkpoint_every == 0 and 0 < config.checkpoint_every_seconds <= 900


# --------------------------------------------------------------------------- the screens, exactly

def drifting(count: int, at: int, seed: int = 0) -> dict:
    run = healthy(count, seed)
    ramp = np.clip((np.arange(count) - at) / 400.0, 0, 1)
    run["losses"] = run["losses"] * (1 + 0.4 * ramp)
    run["grads"] = run["grads"] * (1 + 1.5 * ramp)
    return run


@pytest.mark.parametrize("case", ["drift", "warmup", "restart", "overflow", "shift", "hard_batches"])
def test_replay_blocks_decide_the_new_shapes_as_the_guard_does(case):
    run = drifting(6_000, 3_000) if case == "drift" else healthy(6_000, seed=3)
    if case == "warmup":
        run["losses"][:40] += 8.0 * np.exp(-np.arange(40) / 10)
        run["losses"][5] *= 3.0
    elif case == "restart":
        run["steps"][3_000:] -= 700
        run["losses"][2_900:3_000] *= 0.9
        run["losses"][3_100] = np.nan                # something to decide after the restart
    elif case == "overflow":
        run["grads"][[500, 1_700, 1_701, 4_000]] = [np.inf, np.nan, np.inf, np.inf]
    elif case == "shift":
        run["losses"][2_000:] *= 1.3
        run["losses"][4_000] = np.nan               # something to decide after the new level (accepted silently)
    elif case == "hard_batches":                    # the soak's hard stretches: not acted on, not learned
        for at, factor in ((1_500, 1.7), (2_600, 2.4), (4_100, 1.9)):
            run["losses"][at:at + 12] *= factor
            run["losses"][at + 3] *= 0.9            # one step back in the band: learned, the run broken
        run["losses"][5_000:5_003] *= 20.0          # beyond hard_batch_loss_factor: skips, then a rollback
    guard, by_steps = Guard(), Guard()
    found = batch.guard_block(guard, block(run))
    assert found, "the case must make the guard act"
    assert repr(found) == repr(guard_many(by_steps, run))
    assert guard_state(guard) == guard_state(by_steps)
    assert (guard.last_step, guard.overflows.values, guard.shift.values) == (
        by_steps.last_step, by_steps.overflows.values, by_steps.shift.values)


@pytest.mark.parametrize("split", [1, 7, 100, 2_999, 3_001])
def test_a_drift_found_across_blocks_is_found_at_the_same_step(split):
    run = drifting(6_000, 3_000, seed=1)
    whole, parts = Guard(), Guard()
    first = batch.guard_block(whole, block(run))
    second = batch.guard_block(parts, block(run, 0, split)) + [
        (i + split, d) for i, d in batch.guard_block(parts, block(run, split))]
    assert repr(first) == repr(second) and guard_state(whole) == guard_state(parts)
    assert any(d.reason == "loss_drift" for _, d in first)


# ------------------------------------------------------------- logs with a loss and no gradient norm

@pytest.mark.parametrize("make", [corpus.spike, corpus.nan_burst, corpus.warmup_spike])
def test_loss_faults_in_a_log_without_gradient_norms_are_caught(make, tmp_path):
    """The same faults as with norms (the real MoE/random_ltd logs print none, DeepSpeed's is a
    placeholder): the right actions at the right steps, found from the loss alone."""
    case = corpus.loss_only(make(seed=1, steps=400 if make is corpus.warmup_spike else 3000))
    assert not any("grad_norm" in record["metrics"] for record in case.files["rank-0.jsonl"])
    result = timeline.replay_logs([case.write(tmp_path)], Policy(), hold=case.hold)
    assert result.outcome.steps == len(case.files["rank-0.jsonl"]) and result.outcome.partial_steps == 0
    found = [(action.action, action.step) for action in result.actions]
    for entry in case.expect["actions"]:
        first, last = entry["step"]
        assert any(name == entry["action"] and first <= step <= last for name, step in found), (entry, found)


@pytest.mark.parametrize("make", [corpus.healthy, corpus.data_mix_change, corpus.warmup_healthy])
def test_healthy_shapes_without_gradient_norms_take_no_harmful_action(make, tmp_path):
    case = corpus.loss_only(make(seed=2, steps=400 if make is corpus.warmup_healthy else 3000))
    assert harmful(replayed(case, tmp_path)) == []


def real_case(name: str) -> corpus.Case:
    found = [case for case in corpus.real() if case.name == "real:" + name]
    if not found:
        pytest.skip(f"real log {name} absent under {corpus.REAL_LOGS} (shared/real-logs is not part of the repository)")
    return found[0]


@pytest.mark.parametrize("name,step", [
    ("bigscience_meg_ds_3d_gpt2_perf_n16-ds-on.out", 3),       # DeepSpeed's `grad norm: 0.000` placeholder
    ("bigscience_meg_gpt2_base_n8_dp1_tp4_pp8-1809562.out", 30),   # fp16 loss-scale search: no norm printed
    ("bigscience_meg_gpt2_base_n16_dp1_tp4_pp16-1809577.out", 30),
])
def test_real_spikes_in_steps_without_a_gradient_norm_are_skipped(name, step, tmp_path):
    assert ("skip_step", step) in replayed(real_case(name), tmp_path)


@pytest.mark.parametrize("name", ["msft_megatron-deepspeed_MoE_gpt3-0.125B-with-kernel.log",
                                  "msft_megatron-deepspeed_random_ltd_gpt3-0.125B-baseline.log"])
def test_healthy_real_logs_without_gradient_norms_are_decided_and_left_alone(name, tmp_path):
    case = real_case(name)
    result = timeline.replay_logs([case.write(tmp_path)], Policy())
    assert result.outcome.steps in (213, 47) and result.outcome.partial_steps == 0       # every iteration decided
    assert [(action.action, action.step) for action in result.actions] == []
