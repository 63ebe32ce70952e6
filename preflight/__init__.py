"""`trainguard preflight`: check a node in seconds before a long run.

    from trainguard.preflight import run_preflight
    report = run_preflight(run_dir="runs/exp1", expect="env.lock")
    report.passed          # every check passed (skipped ones do not fail)
    report.checks          # [CheckResult(name, status, message, details, seconds), ...]

Checks, in order: environment (versions against the lock file), nccl_env (error-handling variables),
gpus (NVML health, skipped without NVML), storage (checkpoint directory: writable, free space, speed),
checkpoint_drill (save, corrupt, restore picks the good one), collective (two ranks all-reduce within a
timeout). Thresholds come from `Policy().preflight`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from trainguard import rundir
from trainguard.policy import Policy
from trainguard.runtime.preflight_result import FAIL, CheckResult, Report

__all__ = ["CheckResult", "Report", "run_preflight"]


def _timed(run: Callable[[], CheckResult], name: str) -> CheckResult:
    began = time.perf_counter()
    try:
        result = run()
    except Exception as exc:   # a check that breaks is a failed check with its reason, never a traceback
        result = CheckResult(name, FAIL, f"check raised {type(exc).__name__}: {exc}")
    result.seconds = time.perf_counter() - began
    return result


def run_preflight(*, run_dir: str | Path | None = None, checkpoint_dir: str | Path | None = None,
                  expect: str | Path | None = None, write_lock: str | Path | None = None,
                  policy: Policy | None = None, nvml_module: Any = None,
                  skip: tuple[str, ...] = ()) -> Report:
    """Run every check (except those named in `skip`) and return the report; writes nothing but the lock."""
    from trainguard.preflight import collective, drill, environment, gpus, storage

    settings = (policy or Policy()).preflight
    run_dir = Path(run_dir) if run_dir is not None else None
    checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else (
        rundir.checkpoints_dir(run_dir) if run_dir is not None else None)
    began = time.perf_counter()
    gpu_result, gpu_identity = gpus.check_gpus(settings, nvml_module)   # first: the lock pins the GPU model
    gpu_seconds = time.perf_counter() - began
    env = environment.environment(gpu_identity)
    plan: list[tuple[str, Callable[[], CheckResult]]] = [
        ("environment", lambda: environment.check_versions(env, _path(expect), _path(write_lock))),
        ("nccl_env", lambda: environment.check_nccl_env(settings)),
        ("gpus", lambda: gpu_result),
        ("storage", lambda: storage.check_storage(checkpoint_dir, run_dir, settings)),
        ("checkpoint_drill", lambda: drill.run_drill(checkpoint_dir)),
        ("collective", lambda: collective.check_collective(settings.collective_timeout_seconds)),
    ]
    checks = [_timed(run, name) for name, run in plan if name not in skip]
    for check in checks:
        if check.name == "gpus":
            check.seconds = gpu_seconds
    return Report(checks, env, environment.lock_hash(env))


def _path(value: str | Path | None) -> Path | None:
    return Path(value) if value is not None else None
