"""A plain torchtitan-style loop protected by trainguard's library directly: model, optimizer, LR scheduler
and data position handed over as `states={...}`, a `train_step` that calls the Protector after backward and
after the optimizer step. A tiny language model on random token ids, on CPU.

    python examples/plain_loop.py --run-dir runs/plain --steps 200 --inject nan@5 --inject spike@30
    trainguard agent --run-dir runs/plain       # beside it: the agent's actions reach the loop

`--inject` as in examples/hf_trainer.py. Exits 0 at the end or on the agent's cost_stop, 3 on a guard stop.
"""

from __future__ import annotations

import argparse
import sys

import torch

from trainguard.protect import Callbacks, Protector, RNGState
from trainguard.runtime.telemetry import StepTimer

VOCAB, LENGTH, WIDTH, BATCH = 64, 16, 32, 4
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


class TokenStream:
    """Random token ids with a position that is checkpointed (the `data` state: a rollback keeps it)."""

    def __init__(self):
        self.position = 0

    def next_batch(self) -> torch.Tensor:
        self.position += 1
        return torch.randint(0, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(self.position))

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def train(run_dir: str, steps: int, faults: dict[int, float], policy: str | None = None,
          checkpoint_every: int = 10) -> int:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, VOCAB))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))
    data = TokenStream()
    base_lrs = list(scheduler.base_lrs)

    def scale_lr(factor, scale, rewarmup_steps):      # the schedule sets the LR each step: scale its base
        scheduler.base_lrs = [base * scale for base in base_lrs]
        for group, base, lr_lambda in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * lr_lambda(scheduler.last_epoch)
        return {"base_lrs": scheduler.base_lrs}

    protector = Protector(run_dir, states={"model": model, "optim": optimizer, "sched": scheduler, "data": data,
                                           "rng": RNGState()},
                          policy=policy, checkpoint_every=checkpoint_every, callbacks=Callbacks(scale_lr=scale_lr))
    begun = protector.begin(integration="plain")
    if begun.refused is not None:
        return 3
    scale_lr(1.0, protector.state.lr_scale, 0)
    outcome = None
    while protector.state.step < steps:
        outcome = train_step(protector, model, optimizer, scheduler, data, faults)
        if outcome.stop:
            break
    if outcome is None or not outcome.stop:
        protector.finish()
    protector.close()
    return outcome.exit_code if outcome is not None and outcome.stop else 0


def train_step(protector, model, optimizer, scheduler, data, faults):
    step, timer = protector.state.step + 1, StepTimer()
    timer.start()
    ids = data.next_batch()
    logits = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss = loss * faults.pop(step, 1.0)            # an injected fault (each fires once)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    timer.mark("forward_backward")
    verdict = protector.check(step, loss, norm)    # the step's one host sync; the guard decides

    if not verdict.skip:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return protector.after_step(verdict, tokens=ids.numel(), samples=len(ids), timings=timer.stop(),
                                learning_rate=optimizer.param_groups[0]["lr"])


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
    code = train(options.run_dir, options.steps, faults, options.policy, options.checkpoint_every)
    print(f"exit_code={code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
