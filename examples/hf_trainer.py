"""A Hugging Face `Trainer` run protected by trainguard: a tiny GPT-2 built from its config (random weights,
no download) on random token ids, on CPU.

    python examples/hf_trainer.py --run-dir runs/hf --steps 200 --inject nan@5 --inject spike@30
    trainguard agent --run-dir runs/hf          # beside it: the agent's actions reach the Trainer

`--inject nan@STEP` makes that step's loss NaN (the guard skips the step), `spike@STEP` multiplies the loss
by 1000 for STEP and the two after it (the guard skips two and rolls back on the third). Prints the
callback's exit code: none (ran to the end), 0 (cost_stop obeyed) or 3 (the guard stopped the run).
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from trainguard.protect.hf import ProtectCallback

VOCAB, LENGTH = 64, 16
SPIKE_FACTOR, SPIKE_STEPS = 1e3, 3


class RandomTokens(torch.utils.data.IterableDataset):
    """Endless sequences of random token ids, the labels the ids themselves (the model shifts them)."""

    def __iter__(self):
        generator = torch.Generator().manual_seed(0)
        while True:
            ids = torch.randint(0, VOCAB, (LENGTH,), generator=generator)
            yield {"input_ids": ids, "labels": ids}


def faults_of(injections: list[str]) -> dict[int, float]:
    """`nan@5`, `spike@30` as {step: loss factor}; each fires once."""
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


def inject(model, trainer_state, faults: dict[int, float]) -> None:
    """Multiply the model's loss on the faulted steps (before the guard's hook reads it)."""
    def hook(module, args, output):
        factor = faults.pop(trainer_state().global_step + 1, None) if module.training else None
        if factor is not None:
            output["loss"] = output["loss"] * factor
        return output
    model.register_forward_hook(hook)


def build(run_dir: str, steps: int, faults: dict[int, float], policy: str | None = None,
          checkpoint_every: int = 10) -> tuple[Trainer, ProtectCallback]:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(output_dir=f"{run_dir}/hf", max_steps=steps, per_device_train_batch_size=4,
                             learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=5,
                             save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                             # unclipped so the injected faults are exact; with clipping on the guard still
                             # sees the pre-clip norm (tests/integrations/test_hf_dynamics.py)
                             dataloader_num_workers=0, max_grad_norm=0.0)
    callback = ProtectCallback(run_dir, policy=policy, checkpoint_every=checkpoint_every)
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(), callbacks=[callback])
    inject(model, lambda: trainer.state, faults)
    return trainer, callback


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
    trainer, callback = build(options.run_dir, options.steps, faults, options.policy, options.checkpoint_every)
    trainer.train()
    print(f"exit_code={callback.exit_code}")
    return callback.exit_code or 0


if __name__ == "__main__":
    sys.exit(main())
