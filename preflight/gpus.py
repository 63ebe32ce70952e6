"""GPU health before a run, through the agent's GPU collector (the same NVML access, the same readings).

Per GPU: not lost; no uncorrectable ECC errors since boot; no row remap pending or failed, no page
retirement pending (both need a reset); no slowdown reason while idle (thermal, power brake, HW
slowdown); idle temperature under `preflight.idle_temp_c_max`; application clocks not locked far under
the max; no other process on it. Every device visible: torch (on a CUDA build) sees as many GPUs as
NVML does within CUDA_VISIBLE_DEVICES. Without NVML the check is skipped, never failed.
"""

from __future__ import annotations

import os
from typing import Any

from trainguard.diagnose.hardware import SLOWDOWN_REASONS
from trainguard.policy import PreflightPolicy
from trainguard.runtime.preflight_result import FAIL, PASS, SKIP, CheckResult

BUSY_UTIL = 10.0       # percent: over this the GPU is not idle, and its temperature is not judged


def _problems(index: int, r: dict[str, Any], max_clock: Any, app_clock: Any, policy: PreflightPolicy) -> list[str]:
    gpu = f"GPU {index}"
    found = []
    for key, what in (("ecc_dbe_volatile", "uncorrectable (double-bit) ECC errors since boot"),
                      ("remap_pending", "a row remap pending (reset the GPU)"),
                      ("remap_failure", "a failed row remap (the GPU needs replacing)"),
                      ("retired_pending", "page retirement pending (reset the GPU)")):
        if r.get(key):
            found.append(f"{gpu}: {what} ({key}={r[key]})")
    reasons = [name for bit, name in SLOWDOWN_REASONS.items() if int(r.get("throttle_reasons") or 0) & bit]
    if reasons:
        found.append(f"{gpu}: clocks slowed while idle ({', '.join(reasons)})")
    busy = (r.get("gpu_util") or 0) > BUSY_UTIL
    others = [pid for pid, _ in r.get("processes", ())]
    if others:
        used = sum(memory for _, memory in r["processes"]) / 2**30
        found.append(f"{gpu}: {len(others)} process(es) already on it (pids {', '.join(map(str, others[:5]))}, "
                     f"{used:.1f} GiB)")
    elif not busy and (r.get("gpu_temp_c") or 0) > policy.idle_temp_c_max:
        found.append(f"{gpu}: {r['gpu_temp_c']} C while idle (limit {policy.idle_temp_c_max:g} C): check cooling")
    if max_clock and app_clock and app_clock < policy.idle_clock_ratio_min * max_clock:
        found.append(f"{gpu}: application SM clock {app_clock} MHz is under {policy.idle_clock_ratio_min:.0%} of its "
                     f"max {max_clock} MHz (clocks locked low?)")
    return found


def _torch_visible() -> int | None:
    """GPUs torch can use here, or None on a CPU build of torch (nothing to compare)."""
    import torch

    return torch.cuda.device_count() if torch.version.cuda else None


def _expected_visible(nvml_count: int) -> int:
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return nvml_count
    return len([part for part in listed.split(",") if part.strip()])


def check_gpus(policy: PreflightPolicy, nvml_module: Any = None) -> tuple[CheckResult, dict]:
    """(result, identity for the lock: {"name", "count"} or {} without GPUs)."""
    from trainguard.agent.collector import CollectorDisabled, Context
    from trainguard.agent.collectors.gpu import GPUCollector

    options = {"kmsg": False, "pcie_throughput": False, **({"nvml_module": nvml_module} if nvml_module else {})}
    try:
        collector = GPUCollector(Context(options=options))
    except CollectorDisabled as exc:
        return CheckResult("gpus", SKIP, f"skipped: no NVML ({exc})"), {}
    try:
        nvml, reader = collector.nvml, collector.reader
        problems, details = [], {"gpus": []}
        for gpu in collector.gpus:
            if gpu.lost:
                problems.append(f"GPU {gpu.index}: lost ({gpu.lost_reason})")
                continue
            try:
                r = reader.read(gpu, collector.clock())
            except nvml.NVMLError as exc:
                problems.append(f"GPU {gpu.index}: NVML error ({exc})")
                continue
            max_clock = reader.call(gpu, "nvmlDeviceGetMaxClockInfo", nvml.NVML_CLOCK_SM)
            app_clock = reader.call(gpu, "nvmlDeviceGetApplicationsClock", nvml.NVML_CLOCK_SM)
            problems += _problems(gpu.index, r, max_clock, app_clock, policy)
            details["gpus"].append({"gpu": gpu.index, "name": gpu.name, "uuid": gpu.uuid,
                                    **{k: r.get(k) for k in ("gpu_temp_c", "gpu_util", "sm_clock_mhz",
                                                             "throttle_reasons", "ecc_dbe_volatile",
                                                             "remapped_uncorrectable", "remap_pending")},
                                    "max_sm_clock_mhz": max_clock, "app_sm_clock_mhz": app_clock})
        count = len(collector.gpus)
        torch_count, expected = _torch_visible(), _expected_visible(count)
        details.update(nvml_count=count, torch_count=torch_count, expected_visible=expected)
        if torch_count is not None and torch_count != expected:
            problems.append(f"torch sees {torch_count} GPU(s), expected {expected} "
                            f"(NVML: {count}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})")
        names = sorted({gpu.name for gpu in collector.gpus if gpu.name})
        identity = {"name": ",".join(names), "count": count}
    finally:
        collector.close()
    if problems:
        return CheckResult("gpus", FAIL, "; ".join(problems), details), identity
    return CheckResult("gpus", PASS, f"{count} x {identity['name']} healthy and idle", details), identity
