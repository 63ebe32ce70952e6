"""A PyTorch Lightning run protected by trainguard: a tiny language model on random token ids, on CPU.

    python examples/lightning_module.py --run-dir runs/pl --steps 200 --inject nan@5 --inject spike@30
    trainguard agent --run-dir runs/pl          # beside it: the agent's actions reach the run

`--inject` as in examples/hf_trainer.py (nan@STEP: a NaN loss, skipped; spike@STEP: the loss x1000 for three
steps, two skipped and the third rolled back). Prints the callback's exit code.
"""

from __future__ import annotations

import argparse
import sys

import torch

try:
    import lightning.pytorch as pl
except ImportError:
    import pytorch_lightning as pl

from trainguard.protect.lightning import ProtectCallback

VOCAB, LENGTH, WIDTH = 64, 16, 32
SPIKE_FACTOR, SPIKE_STEPS = 1e3, 3


def faults_of(injections: list[str]) -> dict[int, float]:
    """`nan@5`, `spike@30` as {step: loss factor}; each fires once. (Each example is one file to copy, so
    each carries this function; tests/integrations/test_examples_as_documented.py holds the copies equal.)"""
    faults: dict[int, float] = {}
    for text in injections:
        kind, _, at = text.partition("@")
        if kind not in ("nan", "spike") or not at.isdigit():
            raise ValueError(f"--inject {text!r}: expected nan@STEP or spike@STEP")
        step = int(at)
        if kind == "nan":
            faults[step] = float("nan")
        else:
            faults.update({step + i: SPIKE_FACTOR for i in range(SPIKE_STEPS)})
    return faults


class TinyLM(pl.LightningModule):
    def __init__(self, faults: dict[int, float], step_of):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(VOCAB, WIDTH), torch.nn.Linear(WIDTH, VOCAB)
        self.faults, self.step_of = faults, step_of

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        logits = self.head(torch.tanh(self.embed(ids[:, :-1])))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        return loss * self.faults.pop(self.step_of(), 1.0)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def batches(count: int) -> torch.utils.data.DataLoader:
    ids = torch.randint(0, VOCAB, (count * 4, LENGTH), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)


def build(run_dir: str, steps: int, faults: dict[int, float], policy: str | None = None,
          checkpoint_every: int = 10) -> tuple[pl.Trainer, TinyLM, ProtectCallback]:
    torch.manual_seed(0)
    callback = ProtectCallback(run_dir, steps=steps, policy=policy, checkpoint_every=checkpoint_every)
    module = TinyLM(faults, lambda: callback.protector.state.step + 1)
    trainer = pl.Trainer(max_steps=-1, max_epochs=-1, accelerator="cpu", devices=1, callbacks=[callback],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=f"{run_dir}/lightning")
    return trainer, module, callback


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--inject", action="append", default=[], metavar="KIND@STEP")
    parser.add_argument("--policy", help="a trainguard policy file (guard and cost sections)")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    options = parser.parse_args(argv)
    try:
        faults = faults_of(options.inject)
    except ValueError as exc:
        parser.error(str(exc))
    trainer, module, callback = build(options.run_dir, options.steps, faults, options.policy,
                                      options.checkpoint_every)
    trainer.fit(module, batches(options.steps))
    print(f"exit_code={callback.exit_code}")
    return callback.exit_code or 0


if __name__ == "__main__":
    sys.exit(main())
