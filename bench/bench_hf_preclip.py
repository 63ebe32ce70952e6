"""The pre-clip gradient norm's hooks (trainguard.protect.hf.PreClipNorms) against the plain Trainer step.

    .venv/bin/python bench/bench_hf_preclip.py                       # 4 rounds x 40 steps of each
    .venv/bin/python bench/bench_hf_preclip.py --layers 8 --width 128 --rounds 6

The real Transformers Trainer trains a GPT-2 built from its config (random weights, no download) on random
token ids, on CPU, with the Trainer's default clipping (max_grad_norm 1.0) and gradient accumulation 2.
Two variants, in alternating rounds (plain, hooks, plain, hooks, ...) so that whatever else the machine
does slows both alike:

  plain   the Trainer with a timing callback only
  hooks   the same, plus what ProtectCallback adds for the norm: a post-accumulate-grad hook per
          parameter (a norm each time backward accumulates into its gradient) and `take()` in
          `on_pre_optimizer_step` (the norm of the norms, on the device)

Reported: the median step (on_step_begin to on_step_end) of each, their ratio, and the time spent
inside the hooks and `take()` measured directly (a step's share). The ratio is the end-to-end figure; on a
busy shared machine its noise can be larger than the effect, the direct measure is not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging as hf_logging

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # examples/ (the integration tests' data)

from examples.hf_trainer import LENGTH, VOCAB, RandomTokens  # noqa: E402
from trainguard.protect.hf import PreClipNorms  # noqa: E402


class StepTimes(TrainerCallback):
    """Each optimizer step's wall time and this process's CPU time (one torch thread: the step's own)."""

    def __init__(self):
        self.times: list[tuple[float, float]] = []
        self.began = (0.0, 0.0)

    def on_step_begin(self, args, state, control, **kwargs):
        self.began = (time.perf_counter(), time.process_time())

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append((time.perf_counter() - self.began[0], time.process_time() - self.began[1]))


class TimedNorms(PreClipNorms):
    """PreClipNorms with the wall and CPU time spent inside its hooks and `take` added up."""

    wall = cpu = 0.0

    @classmethod
    def timed(cls, call, *args):
        wall, cpu = time.perf_counter(), time.thread_time()
        result = call(*args)
        cls.wall += time.perf_counter() - wall
        cls.cpu += time.thread_time() - cpu
        return result

    def _recorder(self, index: int):
        record = super()._recorder(index)
        return lambda param: TimedNorms.timed(record, param)

    def take(self, scale=None):
        return TimedNorms.timed(super().take, scale)


class Norms(TrainerCallback):
    """The norm part of ProtectCallback: the hooks from on_train_begin, `take` before each optimizer step."""

    def __init__(self):
        self.norms: TimedNorms | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.norms = TimedNorms.for_trainer(model)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.norms.take()

    def on_train_end(self, args, state, control, **kwargs):
        self.norms.remove()


def run_round(options, with_hooks: bool, out: str) -> tuple[list[float], int]:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=options.width, n_layer=options.layers,
                        n_head=2)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(output_dir=out, max_steps=options.warmup + options.steps,
                             per_device_train_batch_size=options.batch, gradient_accumulation_steps=2,
                             learning_rate=1e-3, save_strategy="no", report_to=[], use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=0, logging_steps=10**6)
    timer = StepTimes()
    callbacks = [timer, Norms()] if with_hooks else [timer]
    Trainer(model=model, args=args, train_dataset=RandomTokens(), callbacks=callbacks).train()
    tensors = sum(1 for p in model.parameters() if p.requires_grad)
    return timer.times[options.warmup:], tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per round and variant")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    options = parser.parse_args()
    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    plain, hooked = [], []
    with tempfile.TemporaryDirectory() as out:
        for _ in range(options.rounds):
            plain += run_round(options, False, out)[0]
            times, tensors = run_round(options, True, out)
            hooked += times
    steps = options.rounds * (options.warmup + options.steps)     # the hooks ran in warm-up steps too
    inside = (TimedNorms.wall / steps, TimedNorms.cpu / steps)
    base = [statistics.median(t[i] for t in plain) for i in (0, 1)]
    with_hooks = [statistics.median(t[i] for t in hooked) for i in (0, 1)]
    print(f"GPT-2 {options.layers} layers x {options.width} wide ({tensors} parameter tensors), batch "
          f"{options.batch} x {LENGTH} tokens, gradient accumulation 2, max_grad_norm 1.0; "
          f"{options.rounds} rounds x {options.steps} steps of each, alternating; torch threads 1; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}\n")
    print("| per optimizer step (median) | wall | CPU |")
    print("|---|---:|---:|")
    print(f"| plain Trainer step | {base[0] * 1e3:.2f} ms | {base[1] * 1e3:.2f} ms |")
    print(f"| Trainer step with the pre-clip norm hooks | {with_hooks[0] * 1e3:.2f} ms | "
          f"{with_hooks[1] * 1e3:.2f} ms |")
    print(f"| ratio hooks / plain | {with_hooks[0] / base[0]:.3f} | {with_hooks[1] / base[1]:.3f} |")
    print(f"| inside the hooks and take(), measured directly | {inside[0] * 1e6:.0f} µs ({inside[0] / base[0]:.2%})"
          f" | {inside[1] * 1e6:.0f} µs ({inside[1] / base[1]:.2%}) |")


if __name__ == "__main__":
    main()
