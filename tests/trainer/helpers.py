"""Helpers for the trainer tests: run `trainguard train` (in this process or as a real subprocess) on the
tiny model and read back what it wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from trainguard import tls


def train(run_dir: Path, *flags: str) -> int:
    """`trainguard train` in this process (fast: torch is imported once)."""
    from trainguard.cli import main

    return main(["train", "--run-dir", str(run_dir), "--device", "cpu", *flags])


def train_subprocess(run_dir: Path, *flags: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`trainguard train` as a real process (launcher, crashes, restarts)."""
    command = [sys.executable, "-m", "trainguard.cli", "train", "--run-dir", str(run_dir), "--device", "cpu",
               *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "TRAINGUARD_LOG_JSON": "1"})


def write_policy(path: Path, **guard) -> Path:
    path.write_text(yaml.safe_dump({"guard": guard}))
    return path


def records(run_dir: Path, rank: int = 0) -> list[dict]:
    return tls.read_records(run_dir / "tls" / f"rank-{rank}.jsonl")


def step_records(run_dir: Path, rank: int = 0) -> list[dict]:
    return [r for r in records(run_dir, rank) if "metrics" in r]


def events(run_dir: Path, kind: str | None = None, rank: int = 0) -> list[dict]:
    found = [r["event"] for r in records(run_dir, rank) if "event" in r]
    return [e for e in found if kind is None or e["type"] == kind]


def final_losses(run_dir: Path, rank: int = 0) -> dict[int, float]:
    """Loss per step as the run finally trained it (a step replayed after a restart or rollback: last)."""
    return {r["step"]: r["metrics"]["loss"] for r in step_records(run_dir, rank)}
