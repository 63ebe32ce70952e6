"""Environment checks: software versions against the user's lock file, and NCCL/torch error handling.

Versions are found the agent's way (`trainguard.agent.versions`: package metadata and files, no torch
import), so preflight and the agent's `trainguard_node_info` can never disagree about a node. The lock
file is YAML, one key per line; a key deleted from it is not checked, an unknown key is an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Mapping

import yaml

from trainguard import safe_read
from trainguard.agent.collector import Context
from trainguard.agent.versions import software_versions
from trainguard.policy import PreflightPolicy
from trainguard.runtime.preflight_result import FAIL, PASS, SKIP, CheckResult

# What a lock pins. GPU identity is added when NVML sees GPUs (see `environment()`).
VERSION_KEYS = ("python", "torch", "cuda", "nccl", "driver")
GPU_KEYS = ("gpu_name", "gpu_count")
LOCK_KEYS = VERSION_KEYS + GPU_KEYS


class LockError(ValueError):
    pass


def environment(gpus: Mapping[str, Any] | None = None) -> dict[str, str]:
    """This node's lock values: versions, plus GPU model and count when GPUs are visible."""
    found = software_versions(Context())
    env = {key: found.get(key, "") for key in VERSION_KEYS}
    if gpus and gpus.get("count"):
        env["gpu_name"] = str(gpus["name"])
        env["gpu_count"] = str(gpus["count"])
    return env


def lock_hash(env: Mapping[str, str]) -> str:
    """A short fingerprint of an environment: equal on nodes that would pass the same lock."""
    return hashlib.sha256(json.dumps(dict(env), sort_keys=True).encode()).hexdigest()[:16]


def write_lock(path: Path, env: Mapping[str, str]) -> None:
    header = (f"# trainguard environment lock: `trainguard preflight --expect {path.name}` fails on any difference.\n"
              f"# Written on {socket.gethostname()} at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}. "
              "Delete a line to stop checking that key.\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + yaml.safe_dump(dict(env), sort_keys=False, default_flow_style=False))


def read_lock(path: Path) -> dict[str, str]:
    """The lock's pinned values as strings; LockError naming the file and key when it is not a lock."""
    try:
        data = safe_read.read_yaml(path, what="lock file")
    except FileNotFoundError:
        raise LockError(f"{path}: no such lock file (write one with --write-lock {path})") from None
    except yaml.YAMLError as exc:
        raise LockError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict) or not data:
        raise LockError(f"{path}: expected a mapping of {', '.join(LOCK_KEYS)}")
    lock = {}
    for key, value in data.items():
        if key not in LOCK_KEYS:
            raise LockError(f"{path}: {key}: unknown key (known: {', '.join(LOCK_KEYS)})")
        if value is None or isinstance(value, (dict, list, bool)):
            raise LockError(f"{path}: {key}: expected a version string, got {value!r}")
        lock[key] = str(value)
    return lock


def differences(lock: Mapping[str, str], env: Mapping[str, str]) -> list[dict[str, str]]:
    """Every pinned key whose value here differs: ``{"key", "expected", "found"}`` ("" = not found)."""
    return [{"key": key, "expected": expected, "found": env.get(key, "")}
            for key, expected in lock.items() if env.get(key, "") != expected]


def _shown(value: str) -> str:
    return repr(value) if value else "none"


def check_versions(env: Mapping[str, str], expect: Path | None, write_to: Path | None) -> CheckResult:
    details: dict[str, Any] = {"environment": dict(env), "lock_hash": lock_hash(env)}
    if write_to is not None:
        write_lock(write_to, env)
        details["wrote_lock"] = str(write_to)
    if expect is None:
        if write_to is not None:
            return CheckResult("environment", PASS, f"wrote the lock file {write_to}", details)
        return CheckResult("environment", SKIP, "no lock file given: pass --expect FILE (write one with "
                                                "--write-lock FILE)", details)
    try:
        lock = read_lock(expect)
    except LockError as exc:
        return CheckResult("environment", FAIL, str(exc), details)
    diff = differences(lock, env)
    details.update(lock=str(expect), differences=diff, unchecked=sorted(set(env) - set(lock)))
    if diff:
        text = "; ".join(f"{d['key']}: expected {_shown(d['expected'])}, found {_shown(d['found'])}" for d in diff)
        return CheckResult("environment", FAIL, f"differs from {expect}: {text}", details)
    return CheckResult("environment", PASS, f"matches {expect} ({len(lock)} keys)", details)


# ----------------------------------------------------------------------------- NCCL / torch variables

def _int(env: Mapping[str, str], name: str) -> int | None:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        return None


def nccl_problems(env: Mapping[str, str], policy: PreflightPolicy) -> list[str]:
    """What is wrong with the error-handling variables in `env` (empty when all is sane)."""
    problems = []
    # torch reads the deprecated name when the new one is unset; its default (3) tears the process down.
    name = "TORCH_NCCL_ASYNC_ERROR_HANDLING" if "TORCH_NCCL_ASYNC_ERROR_HANDLING" in env else "NCCL_ASYNC_ERROR_HANDLING"
    if name in env and env[name].strip() not in ("1", "2", "3"):
        problems.append(f"{name}={env[name]}: async error handling must be on (1, 2 or 3; unset means 3), "
                        "else a failed collective hangs every rank instead of ending the job")
    if env.get("TORCH_NCCL_ENABLE_MONITORING", "").strip() == "0":
        problems.append("TORCH_NCCL_ENABLE_MONITORING=0: the watchdog monitor is off, so a stuck watchdog "
                        "never aborts the process")
    if "NCCL_IB_TIMEOUT" in env:
        value = _int(env, "NCCL_IB_TIMEOUT")
        low, high = policy.nccl_ib_timeout_min, policy.nccl_ib_timeout_max
        if value is None or not low <= value <= high:
            seconds = f" (4.096 us x 2^{value} = {4.096e-6 * 2 ** value:.3g} s per retry)" if value is not None \
                and 0 <= value < 64 else ""
            problems.append(f"NCCL_IB_TIMEOUT={env['NCCL_IB_TIMEOUT']}{seconds}: expected {low}..{high}")
    if "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC" in env:
        value = _int(env, "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC")
        if value is None or not 0 < value <= policy.heartbeat_timeout_seconds_max:
            problems.append(f"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC={env['TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC']}: expected "
                            f"1..{policy.heartbeat_timeout_seconds_max:g} seconds")
    return problems


def check_nccl_env(policy: PreflightPolicy, env: Mapping[str, str] | None = None) -> CheckResult:
    env = os.environ if env is None else env
    shown = {k: env[k] for k in sorted(env) if k.startswith(("NCCL_", "TORCH_NCCL_"))}
    problems = nccl_problems(env, policy)
    if problems:
        return CheckResult("nccl_env", FAIL, "; ".join(problems), {"variables": shown, "problems": problems})
    return CheckResult("nccl_env", PASS, "NCCL async error handling on, timeouts sane", {"variables": shown})
