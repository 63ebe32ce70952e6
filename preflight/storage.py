"""Storage check: the checkpoint directory exists (or can be made), takes writes, and is big and fast enough.

Permission is tested by writing, not by `os.access`: root passes every mode-bit check yet still cannot
write to a read-only mount, and a network filesystem may refuse what the mode bits allow. The write
speed is measured with an fsynced probe file, since a checkpoint is only safe once it is durable.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from pathlib import Path
from typing import Any

from trainguard import rundir
from trainguard.policy import PreflightPolicy
from trainguard.runtime.preflight_result import FAIL, PASS, SKIP, CheckResult

PROBE_CHUNK = 4 << 20
PROBE_SHARE_OF_FREE = 0.1    # the speed probe never takes more than this of the free space
# AdamW in fp32: weights, exp_avg and exp_avg_sq, 4 bytes each per parameter.
BYTES_PER_PARAMETER = 12


def newest_checkpoint_bytes(checkpoint_dir: Path) -> tuple[int, str] | None:
    """Size of the newest step_<N> directory, the best estimate of the next checkpoint."""
    from trainguard.rundir import step_of_dir

    found = [(step_of_dir(p.name), p) for p in checkpoint_dir.iterdir()] if checkpoint_dir.is_dir() else []
    found = [(step, p) for step, p in found if step is not None and p.is_dir()]
    if not found:
        return None
    _, newest = max(found)
    return sum(f.stat().st_size for f in newest.iterdir() if f.is_file()), f"newest checkpoint {newest.name}"


def config_checkpoint_bytes(config_file: Path) -> tuple[int, str] | None:
    """Size estimated from the run's model config: parameters x BYTES_PER_PARAMETER."""
    if not config_file.is_file():
        return None
    import torch

    from trainguard.trainer.config import TrainConfig, load_file
    from trainguard.trainer.model import GPT

    config = load_file(TrainConfig(), str(config_file))
    with torch.device("meta"):   # shapes only: no memory, no time
        params = GPT(config.model).num_params(non_embedding=False)
    return params * BYTES_PER_PARAMETER, f"{params:,} parameters in {config_file.name} x {BYTES_PER_PARAMETER} bytes"


def checkpoint_estimate(run_dir: Path | None, checkpoint_dir: Path) -> tuple[int, str] | None:
    found = newest_checkpoint_bytes(checkpoint_dir)
    if found is None and run_dir is not None:
        try:
            found = config_checkpoint_bytes(rundir.config_path(run_dir))
        except (OSError, ValueError) as exc:   # ConfigError is a ValueError naming file and key
            return 0, f"cannot size one from {rundir.config_path(run_dir)}: {exc}"
    return found


def _writable_dir(path: Path) -> str | None:
    """None when `path` is a directory or could be made one (it is then made, as the trainer would); else why not."""
    if path.exists() and not path.is_dir():
        return f"{path} exists and is not a directory"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create {path}: {exc.strerror or exc}"
    return None


def measure_write(directory: Path, size: int) -> float:
    """Bytes per second of writing and fsyncing `size` bytes into `directory` (the probe is removed)."""
    probe = directory / f".preflight-probe-{os.getpid()}"
    chunk = memoryview(os.urandom(min(PROBE_CHUNK, size)))   # incompressible: no compressing filesystem flatters
    began = time.perf_counter()
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        written = 0
        while written < size:
            written += os.write(fd, chunk[:size - written])
        os.fsync(fd)
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)
    return size / max(time.perf_counter() - began, 1e-9)


def size_text(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_storage(checkpoint_dir: Path | None, run_dir: Path | None, policy: PreflightPolicy) -> CheckResult:
    if checkpoint_dir is None:
        return CheckResult("storage", SKIP, "no checkpoint directory: pass --run-dir DIR (or --checkpoint-dir DIR)")
    details: dict[str, Any] = {"directory": str(checkpoint_dir)}
    why = _writable_dir(checkpoint_dir)
    if why:
        return CheckResult("storage", FAIL, f"checkpoint directory unusable: {why}", details)
    free = shutil.disk_usage(checkpoint_dir).free
    probe = max(1, int(min(policy.write_probe_bytes, free * PROBE_SHARE_OF_FREE)))
    try:
        speed = measure_write(checkpoint_dir, probe)
    except OSError as exc:
        reason = "no space left" if exc.errno == errno.ENOSPC else exc.strerror or str(exc)
        return CheckResult("storage", FAIL, f"cannot write to the checkpoint directory {checkpoint_dir}: {reason}",
                           details)
    details.update(free_bytes=free, probe_bytes=probe, write_bytes_per_second=round(speed))
    estimate = checkpoint_estimate(run_dir, checkpoint_dir)
    if estimate is None or estimate[0] <= 0:
        details["checkpoint_bytes"] = None
        note = estimate[1] if estimate else "no checkpoint and no RUN/config.yaml to size one from"
        return CheckResult("storage", PASS, f"writable at {speed / 1e6:.0f} MB/s, {size_text(free)} free; "
                                            f"checkpoint size unknown ({note})", details)
    size, source = estimate
    needed = policy.checkpoints_of_headroom * size
    seconds = size / speed
    details.update(checkpoint_bytes=size, checkpoint_size_from=source, needed_free_bytes=round(needed),
                   checkpoint_write_seconds=round(seconds, 3))
    problems = []
    if free < needed:
        problems.append(f"{size_text(free)} free, needs {size_text(needed)} "
                        f"({policy.checkpoints_of_headroom:g} checkpoints of {size_text(size)}, {source})")
    if seconds > policy.checkpoint_write_seconds_max:
        problems.append(f"a {size_text(size)} checkpoint takes {seconds:.0f} s at {speed / 1e6:.0f} MB/s "
                        f"(limit {policy.checkpoint_write_seconds_max:g} s)")
    if problems:
        return CheckResult("storage", FAIL, f"{checkpoint_dir}: " + "; ".join(problems), details)
    return CheckResult("storage", PASS, f"{size_text(free)} free, {speed / 1e6:.0f} MB/s: a checkpoint of "
                                        f"{size_text(size)} ({source}) writes in {seconds:.2f} s", details)
