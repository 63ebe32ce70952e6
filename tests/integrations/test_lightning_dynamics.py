"""The Lightning callback and Lightning's own step dynamics, with the real Lightning Trainer on CPU: the
guard's gradient norm is the one before Lightning clips (`gradient_clip_val=1.0`), so an exploding gradient
is skipped; and a step the guard skips does not advance the step-interval LR scheduler."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lightning")

from examples.lightning_module import TinyLM, batches, pl  # noqa: E402
from tests.integrations.injected import EXPLOSION, ScaleGradient  # noqa: E402
from tests.library.test_plain_loop import GUARD  # noqa: E402
from tests.trainer.helpers import events, step_records, write_policy  # noqa: E402
from trainguard.protect.lightning import ProtectCallback  # noqa: E402

STEPS, EXPLODED, PEAK = 20, (12, 16), 1e-2


def warmup_then_decay(step: int) -> float:
    return min(1.0, (step + 1) / 4) * max(0.0, 1 - step / 40)


class ScheduledLM(TinyLM):
    """TinyLM with a step-interval LambdaLR, a gradient explosion on the `explode` steps (loss unchanged),
    and, after each backward (before the callback's hook and Lightning's clipping), the true norm and LR."""

    def __init__(self, explode, step_of):
        super().__init__({}, step_of)
        self.explode, self.seen = set(explode), []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.step_of() in self.explode:
            self.explode.discard(self.step_of())
            loss = ScaleGradient.apply(loss, EXPLOSION)
        return loss

    def on_after_backward(self):
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.seen.append((torch.nn.utils.get_total_norm(grads).item(), self.optimizers().param_groups[0]["lr"]))

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=PEAK)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_decay)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_lightning_guard_sees_the_norm_before_clipping_and_a_skip_holds_the_lr_schedule(tmp_path):
    run = tmp_path / "run"
    torch.manual_seed(0)
    callback = ProtectCallback(str(run), steps=STEPS, policy=str(write_policy(tmp_path / "p.yaml", **GUARD)))
    module = ScheduledLM(EXPLODED, lambda: callback.protector.state.step + 1)
    trainer = pl.Trainer(max_steps=-1, max_epochs=-1, accelerator="cpu", devices=1, callbacks=[callback],
                         gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(module, batches(STEPS + 5))

    assert [(e["step"], e["reason"]) for e in events(run, "skip_step")] == [(s, "grad_explosion") for s in EXPLODED]
    records = step_records(run)
    norms, rates = zip(*module.seen)
    assert [r["metrics"]["grad_norm"] for r in records] == pytest.approx(norms, rel=1e-6)
    assert min(norms[s - 1] for s in EXPLODED) > 100 * 1.0          # what Lightning then clipped to 1.0

    kept = [rate for step, rate in enumerate(rates, 1) if step not in EXPLODED]
    plain = [PEAK * warmup_then_decay(step) for step in range(STEPS)]
    assert kept == pytest.approx(plain[:STEPS - len(EXPLODED)], rel=1e-12)
    assert [r["metrics"]["learning_rate"] for r in records] == pytest.approx(rates, rel=1e-12)
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == STEPS - len(EXPLODED)
