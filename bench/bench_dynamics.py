"""Cosine vs breathing vs the phase scheduler vs adaptive clipping: the tiny model on the default corpus.

    .venv/bin/python bench/bench_dynamics.py                  # 100 steps, seeds 1 2 3, four variants
    .venv/bin/python bench/bench_dynamics.py --steps 300 --seeds 1 2 3 4 5 --variants cosine breathing

Every variant trains the same steps from the same seed, with the same peak LR (the seeds' 0.0015, so
cosine's peak is the breathing and phase schedules' too), warm-up, batch and data; only the schedule or the
clipping differs. Reported per variant, mean and spread (sample standard deviation) over the seeds:

  final val loss      the validation loss of the checkpoint at the last step (the same `eval_batches`
                      windows of the held-out tail every time)
  interventions       guard decisions in the run's log: skip_step + rollback + stop events (a checkpoint
                      every 25 steps gives rollbacks somewhere to go; a run the guard stopped has no
                      final validation loss and is left out of the mean, and the table says so)
  phase changes       lr_phase events after the opening one
  clipped steps       steps whose clip_coef < 1

A CPU benchmark has to be short, so the schedules run with spans scaled down further than the `cpu`
preset's (SPANS below; the preset is sized for a few thousand steps): the comparison says how the rules
behave over a short run of a small model, not how they would over a long pretraining run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

from trainguard import tls

ROOT = Path(__file__).resolve().parents[1]
PEAK_LR = 0.0015
SPANS = {
    "stability": {"window": 15},
    "plateau": {"window": 30},
    "breathing": {"inhale_steps": 25, "exhale_factor": 0.98, "pause_ratio": 0.05, "pause_window": 8,
                  "freeze_steps": 15},
    "phase": {"min_phase_steps": 10, "development_decay": 0.99},
}
VARIANTS = {
    "cosine": ["--schedule", "cosine"],
    "breathing": ["--schedule", "breathing"],
    "phase": ["--schedule", "phase"],
    "cosine + zscore clip": ["--schedule", "cosine", "--clip-rule", "zscore"],
    "cosine + percentile clip": ["--schedule", "cosine", "--clip-rule", "percentile"],
}
DEFAULT_VARIANTS = ["cosine", "breathing", "phase", "cosine + zscore clip"]
INTERVENTIONS = ("skip_step", "rollback", "stop")
CHECKPOINT_EVERY = 25     # so the guard's rollbacks have a stable checkpoint to go back to
STOPPED = 3               # the guard stopped the run (rollback limit): no final validation loss


def train(run_dir: Path, steps: int, seed: int, policy: Path, flags: list[str]) -> float:
    from trainguard.cli import main

    started = time.perf_counter()
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        code = main(["train", "--run-dir", str(run_dir), "--device", "cpu", "--steps", str(steps),
                     "--seed", str(seed), "--lr", str(PEAK_LR), "--policy", str(policy), "--log-every", "1000",
                     "--checkpoint-every", str(CHECKPOINT_EVERY), *flags])
    if code not in (0, STOPPED):
        raise RuntimeError(f"{run_dir}: trainguard train exited {code}")
    return time.perf_counter() - started


def outcome(run_dir: Path, steps: int) -> dict:
    records = tls.read_records(run_dir / "tls" / "rank-0.jsonl")
    events = [r["event"] for r in records if "event" in r]
    final = [e for e in events if e["type"] == "evaluation" and e.get("step") == steps and e["purpose"] == "checkpoint"]
    stopped = [e["step"] for e in events if e["type"] == "stop"]
    return {"val_loss": final[-1]["val_loss"] if final else None, "stopped_at": stopped[0] if stopped else None,
            "interventions": sum(e["type"] in INTERVENTIONS for e in events),
            "phase_changes": sum(e["type"] == "lr_phase" and e.get("from") is not None for e in events),
            "clipped": sum(r["metrics"].get("clip_coef", 1.0) < 1.0 for r in records if "metrics" in r)}


def spread(values: list[float | None]) -> str:
    finished = [v for v in values if v is not None]
    note = f" ({len(values) - len(finished)} stopped)" if len(finished) < len(values) else ""
    if not finished:
        return "none finished"
    return _spread(finished) + note


def _spread(values: list[float]) -> str:
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.4f} ± {sd:.4f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS), metavar="NAME")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-dynamics-") as tmp:
        policy = Path(tmp) / "policy.yaml"
        policy.write_text(yaml.safe_dump({"dynamics": SPANS}))
        rows, seconds = {}, 0.0
        for name in args.variants:
            results = []
            for seed in args.seeds:
                run = Path(tmp) / f"{name.replace(' ', '_').replace('+', '')}-{seed}"
                seconds += train(run, args.steps, seed, policy, VARIANTS[name])
                results.append(outcome(run, args.steps))
            rows[name] = results
    print(f"tiny model, default corpus, {args.steps} steps, seeds {' '.join(map(str, args.seeds))}, peak LR "
          f"{PEAK_LR}, spans {SPANS}; {seconds:.0f} s of training in all\n")
    print("| variant | final val loss (mean ± sd) | guard interventions | stopped at step | phase changes | clipped steps |")
    print("|---|---|---|---|---|---|")
    for name, results in rows.items():
        cells = [spread([r["val_loss"] for r in results])] + [
            " / ".join(str(r[key]) if r[key] is not None else "-" for r in results)
            for key in ("interventions", "stopped_at", "phase_changes", "clipped")]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
