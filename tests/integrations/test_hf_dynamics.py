"""The Transformers callback and the Trainer's own step dynamics, with the real Trainer on CPU: the guard
sees the gradient norm BEFORE the Trainer's clipping (the default `max_grad_norm=1.0`, gradient
accumulation 2), so an exploding gradient is skipped and rolled back although the Trainer clips it; and a
step the guard skips does not advance the Trainer's LR schedule."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, get_scheduler  # noqa: E402

from examples.hf_trainer import LENGTH, VOCAB, RandomTokens  # noqa: E402
from tests.integrations.injected import EXPLOSION, ScaleGradient  # noqa: E402
from tests.library.test_plain_loop import GUARD  # noqa: E402
from tests.trainer.helpers import events, records, step_records, write_policy  # noqa: E402
from trainguard.protect.hf import ProtectCallback  # noqa: E402


def build(run, steps: int, policy, *, explode=(), nan=(), accumulation=1, schedule="constant", warmup=0,
          checkpoint_every=10) -> tuple[Trainer, ProtectCallback]:
    """The tiny GPT-2 of examples/hf_trainer.py under the Trainer's DEFAULT clipping (max_grad_norm 1.0),
    logging every step (the Trainer's own `grad_norm` and `learning_rate` in each `trainer_log` event)."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2))
    args = TrainingArguments(output_dir=f"{run}/hf", max_steps=steps, per_device_train_batch_size=4,
                             gradient_accumulation_steps=accumulation, learning_rate=1e-3,
                             lr_scheduler_type=schedule, warmup_steps=warmup, logging_steps=1,
                             save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                             dataloader_num_workers=0)
    assert args.max_grad_norm == 1.0
    callback = ProtectCallback(str(run), policy=str(policy), checkpoint_every=checkpoint_every)
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(), callbacks=[callback])
    micro_batches = {step: accumulation for step in explode}        # each injected step fires once

    def inject(module, _, output):       # the Trainer counts the step after its micro-batches
        step = trainer.state.global_step + 1
        if module.training and micro_batches.get(step):
            micro_batches[step] -= 1
            output["loss"] = ScaleGradient.apply(output["loss"], EXPLOSION)
        if module.training and step in nan:
            output["loss"] = output["loss"] * float("nan")
        return output
    model.register_forward_hook(inject)
    return trainer, callback


def trainer_logs(run) -> list[dict]:
    """The Trainer's per-step log dicts in the order written (the end-of-training summary left out)."""
    return [e for e in events(run, "trainer_log") if "grad_norm" in e]


def norm_pairs(run) -> list[tuple[float, float]]:
    """(the guard's grad_norm, the Trainer's) per logged step: each `trainer_log` follows its step's
    record (the Trainer does not log the steps a rollback made it run again, up to its last logged one)."""
    pairs, ours = [], None
    for record in records(run):
        if "metrics" in record:
            ours = record["metrics"]["grad_norm"]
        elif record.get("event", {}).get("type") == "trainer_log" and "grad_norm" in record["event"]:
            pairs.append((ours, record["event"]["grad_norm"]))
    return pairs


@pytest.mark.slow
def test_the_guard_sees_the_norm_before_clipping_and_skips_an_explosion(tmp_path):
    run = tmp_path / "run"
    trainer, callback = build(run, 27, write_policy(tmp_path / "policy.yaml", **GUARD), explode={22, 23, 24},
                              accumulation=2)
    seen = {}

    def remember(module, args):           # the weights as each step's first forward begins
        if module.training:
            seen.setdefault(trainer.state.global_step, [p.detach().clone() for p in module.parameters()])
    trainer.model.register_forward_pre_hook(remember)
    trainer.train()

    ours, clipped = zip(*norm_pairs(run))        # the Trainer's: what its clip_grad_norm_ returned
    assert len(ours) == 27 and ours == pytest.approx(clipped, rel=1e-6)   # 31 steps, 4 not logged
    assert max(clipped) > 100 * 1.0                                # the Trainer did clip: 1.0 is max_grad_norm
    assert len(step_records(run)) == 27 + 4                        # steps 21-24 ran again after the rollback
    assert [(e["step"], e["reason"]) for e in events(run, "skip_step")] == [
        (22, "grad_explosion"), (23, "grad_explosion")]
    (rollback,) = events(run, "rollback")
    assert (rollback["step"], rollback["restored_step"], rollback["reason"]) == (24, 20, "repeated_grad_explosion")
    assert all(torch.equal(a, b) for a, b in zip(seen[21], seen[22]))   # step 22 changed no weight
    assert not all(torch.equal(a, b) for a, b in zip(seen[20], seen[21]))
    assert callback.exit_code is None and trainer.state.global_step == 27


def plain_schedule(name: str, warmup: int, steps: int) -> list[float]:
    """The LR of each optimizer step under the Trainer's own scheduler function, nothing skipped."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=steps)
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def test_a_skipped_step_does_not_advance_the_lr_schedule(tmp_path):
    run, steps, skipped = tmp_path / "run", 12, (4, 8)
    trainer, _ = build(run, steps, write_policy(tmp_path / "policy.yaml", **GUARD), nan=set(skipped),
                       schedule="linear", warmup=3, checkpoint_every=0)
    trainer.train()

    assert [e["step"] for e in events(run, "skip_step")] == list(skipped)
    applied = [log["learning_rate"] for log in trainer_logs(run)]     # the LR each optimizer.step() ran with
    assert len(applied) == steps
    kept = [rate for step, rate in enumerate(applied, 1) if step not in skipped]
    plain = plain_schedule("linear", 3, steps)
    assert kept == pytest.approx(plain[:steps - len(skipped)], rel=1e-12)
    assert [r["metrics"]["learning_rate"] for r in step_records(run)] == pytest.approx(applied, rel=1e-12)
    assert trainer.lr_scheduler.last_epoch == steps - len(skipped)
    assert math.isclose(trainer.optimizer.param_groups[0]["lr"], plain[steps - len(skipped)], rel_tol=1e-12)


def test_pre_clip_norms_divide_out_an_fp16_loss_scale():
    """accelerate's optimizer holds the GradScaler of an fp16 run: the hooks saw scaled gradients, the
    Trainer unscales them before it clips; the guard's norm is the unscaled one (two accumulated backwards)."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    from trainguard.protect.hf import PreClipNorms, grad_scale

    Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    optimizer = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), device_placement=False,
                                     scaler=scaler)
    norms = PreClipNorms(model.parameters())
    for _ in range(2):
        scaler.scale(model(torch.randn(4, 8)).square().mean()).backward()
    ours = norms.take(grad_scale(optimizer))
    scaler.unscale_(optimizer.optimizer)
    assert ours.item() == pytest.approx(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item(), rel=1e-6)
    assert grad_scale(optimizer.optimizer) is None and norms.norms == [None] * 4   # taken: cleared


def test_pre_clip_norms_of_a_parameter_the_last_micro_batch_did_not_reach():
    """Only the last micro-batch is recorded; a parameter whose gradient came from an earlier one alone has
    no record, and its pre-clip norm comes back from the clip's coefficient: the total is still exact."""
    from trainguard.protect.hf import PreClipNorms

    torch.manual_seed(0)
    shared, first_only = torch.nn.Linear(8, 1), torch.nn.Linear(8, 1)
    final = []
    norms = PreClipNorms([*shared.parameters(), *first_only.parameters()], lambda: final[-1])
    for last, branch in ((False, first_only), (True, None)):
        final.append(last)
        x = torch.randn(4, 8) * 10
        loss = shared(x).square().mean() + (branch(x).square().mean() if branch is not None else 0)
        loss.backward()
    assert all(n is None for n in norms.norms[2:]) and all(n is not None for n in norms.norms[:2])
    total = torch.nn.utils.clip_grad_norm_([*shared.parameters(), *first_only.parameters()], 1.0)
    assert total.item() > 10 and norms.take().item() == pytest.approx(total.item(), rel=1e-6)
