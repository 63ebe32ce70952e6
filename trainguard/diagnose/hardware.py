"""Hardware layer: GPUs running slow (heat, power, clocks), links trained down, and error events.

Reads the agent's per-GPU samples (`hardware.gpus[]` of RUN/tls/node-<host>.jsonl, from NVML through the
GPU collector). Conditions must last the alert rules' `for:` (`policy.alerts.for_short`) to count, so
one hot sample is not a diagnosis.
"""

from __future__ import annotations

import math

from trainguard.diagnose.finding import Finding, no_data, ok, problem
from trainguard.diagnose.loader import RunData
from trainguard.diagnose.stats import (MAX_RANGES, describe, finite, prometheus_duration, rounded, rows_with,
                                        sustained)
from trainguard.policy import Policy
from trainguard.tls import format_timestamp

LAYER = "hardware"
NEEDS_AGENT = "the agent's GPU samples (hardware.gpus[] in RUN/tls/node-<host>.jsonl)"

# NVML clocks-event reasons that cost throughput: SW power cap, HW slowdown, SW thermal, HW thermal,
# HW power brake (nvmlClocksEventReason*; idle, app clocks, sync boost and display are not a slowdown).
# Named as dcgm-exporter and the agent's GPU collector name them.
SLOWDOWN_REASONS = {0x4: "power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal",
                    0x80: "hw_power_brake"}
BUSY_UTIL = 50.0            # a clock is only judged while the GPU has work
# PCIe bytes per second per lane by generation (after line coding), for the link's capacity.
PCIE_LANE_BYTES = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.563e9}


def _gpu_label(key: tuple[str, str]) -> str:
    return f"{key[0]} GPU {key[1]}"


def _reasons(bits: float) -> list[str]:
    return [name for bit, name in SLOWDOWN_REASONS.items() if int(bits) & bit] if finite(bits) else []


def gpu_slowdown(run: RunData, policy: Policy) -> Finding:
    """Temperature over `alerts.gpu_temp_c`, NVML slowdown reasons, or a busy GPU's SM clock under
    `diagnose.clock_ratio_min` of its max — sustained for `alerts.for_short`."""
    check, limit, ratio_min = "gpu_slowdown", policy.alerts.gpu_temp_c, policy.diagnose.clock_ratio_min
    sustain = prometheus_duration(policy.alerts.for_short)
    worst, hottest = None, math.nan
    for key, cols in sorted(run.gpus.items()):
        v = cols.values

        def hot(i: int) -> bool:    # NaN compares false: a field the sample lacks never flags it
            return v["gpu_temp_c"][i] > limit

        def clocked_down(i: int) -> bool:
            return v["gpu_util"][i] > BUSY_UTIL and v["sm_clock_mhz"][i] < ratio_min * v["sm_clock_max_mhz"][i]

        def slow(i: int) -> bool:
            return hot(i) or bool(_reasons(v["throttle_reasons"][i])) or clocked_down(i)

        rows = [i for i in range(len(cols)) if any(finite(v[name][i]) for name in
                                                   ("gpu_temp_c", "throttle_reasons", "sm_clock_mhz"))]
        if not rows:
            continue
        hottest = max([hottest, *(v["gpu_temp_c"][i] for i in rows if finite(v["gpu_temp_c"][i]))],
                      key=lambda t: -math.inf if math.isnan(t) else t)
        runs = sustained(cols, rows, slow, sustain)
        affected = sum(len(r) for r in runs) / len(rows)
        if worst is None or affected > worst[0]:
            flagged = [i for r in runs for i in r]
            why = sorted({name for i in flagged for name in _reasons(v["throttle_reasons"][i])})
            if any(hot(i) for i in flagged):
                why.append(f"temperature up to {max(v['gpu_temp_c'][i] for i in flagged):g} C")
            if any(clocked_down(i) for i in flagged):
                why.append(f"SM clock under {ratio_min:.0%} of max while busy")
            worst = (affected, key, runs, why)
    if worst is None:
        return no_data(LAYER, check, f"GPU temperature, clocks or clocks-event reasons in {NEEDS_AGENT}")
    affected, key, runs, why = worst
    evidence = {"max_temp_c": rounded(hottest), "threshold_temp_c": limit, "clock_ratio_min": ratio_min,
                "sustained_seconds": sustain}
    if not runs:
        return ok(LAYER, check, f"no GPU ran hot or throttled for {policy.alerts.for_short}", **evidence)
    evidence.update(gpu=_gpu_label(key), reasons=why, share_of_samples=rounded(affected),
                    stretches=[describe(run.gpus[key], r) for r in runs[:MAX_RANGES]])
    return problem(LAYER, check, f"{_gpu_label(key)} slowed down ({'; '.join(why)}) for {affected:.0%} of samples: "
                                 "every rank waits for the slowest GPU", affected, **evidence)


def _pcie_capacity(v: dict, i: int, current: bool) -> float:
    gen = v["pcie_link_gen" if current else "pcie_link_gen_max"][i]
    width = v["pcie_link_width" if current else "pcie_link_width_max"][i]
    if not (finite(gen) and finite(width)) or int(gen) not in PCIE_LANE_BYTES:
        return float("nan")
    return PCIE_LANE_BYTES[int(gen)] * width


def gpu_links(run: RunData, policy: Policy) -> Finding:
    """PCIe links trained below their generation or width, or NVLink links down: the link can carry only
    part of what it was built for, so transfers run far under its capacity whatever the workload asks."""
    check, ratio_min = "gpu_links", policy.diagnose.link_ratio_min
    worst, seen = None, False
    for key, cols in sorted(run.gpus.items()):
        v = cols.values
        ratios = {}
        for i in range(len(cols)):
            pcie = _pcie_capacity(v, i, True) / _pcie_capacity(v, i, False)
            nvlink = v["nvlink_links_active"][i] / v["nvlink_links"][i] if v["nvlink_links"][i] > 0 else float("nan")
            found = [r for r in (pcie, nvlink) if finite(r)]
            if found:
                ratios[i] = min(found)
        if not ratios:
            continue
        seen = True
        low = [i for i, r in ratios.items() if r < ratio_min]
        share = len(low) / len(ratios)
        if worst is None or share > worst[0]:
            worst = (share, key, low, ratios)
    if not seen:
        return no_data(LAYER, check, f"PCIe link generation/width (current and max) or NVLink links (active of all) in {NEEDS_AGENT}")
    share, key, low, ratios = worst
    cols = run.gpus[key]
    evidence = {"gpu": _gpu_label(key), "min_ratio": rounded(min(ratios.values()), 3), "threshold": ratio_min}
    if not low:
        return ok(LAYER, check, f"every link runs at {min(ratios.values()):.0%} or more of its capability", **evidence)
    v = cols.values
    i = low[0]
    evidence.update(share_of_samples=rounded(share), stretches=[describe(cols, [low[0]]), describe(cols, [low[-1]])],
                    link={name: v[name][i] for name in ("pcie_link_gen", "pcie_link_gen_max", "pcie_link_width",
                                                         "pcie_link_width_max", "nvlink_links_active", "nvlink_links")
                          if finite(v[name][i])})
    return problem(LAYER, check, f"{_gpu_label(key)}'s link carries {ratios[i]:.0%} of its capability (under "
                                 f"{ratio_min:.0%}): a trained-down PCIe link or a degraded NVLink", share, **evidence)


ERROR_COUNTERS = {"xid_errors": "XID errors", "ecc_dbe_volatile": "uncorrectable ECC errors",
                  "remapped_uncorrectable": "rows remapped for uncorrectable errors"}


def gpu_errors(run: RunData, policy: Policy) -> Finding:
    """XID events, uncorrectable ECC errors and row remapping during the run (counter increases, events)."""
    check = "gpu_errors"
    found, seen = [], False
    for key, cols in sorted(run.gpus.items()):
        for name, what in ERROR_COUNTERS.items():
            rows = rows_with(cols, (name,))
            if not rows:
                continue
            seen = True
            values = cols.values[name]
            increase = sum(max(0.0, values[b] - values[a]) for a, b in zip(rows, rows[1:]))
            if increase > 0:
                first = next(b for a, b in zip(rows, rows[1:]) if values[b] > values[a])
                found.append({"gpu": _gpu_label(key), "what": what, "increase": int(increase),
                              "first_seen": describe(cols, [first])["from"]})
        pending = rows_with(cols, ("remap_pending",))
        seen = seen or bool(pending)
        if any(cols.values["remap_pending"][i] > 0 for i in pending):
            found.append({"gpu": _gpu_label(key), "what": "a row remap pending (needs a GPU reset)", "increase": 1})
    xid_events = [e for e in run.events if "xid" in str(e["event"].get("type", "")).lower()]
    for event in xid_events:
        found.append({"gpu": str(event["event"].get("gpu", event.get("node", "?"))), "what": "XID event",
                      "xid": event["event"].get("xid"), "first_seen": format_timestamp(event["timestamp"])})
    if not seen and not xid_events:
        return no_data(LAYER, check, f"XID, ECC or row-remapping counters in {NEEDS_AGENT}")
    if not found:
        return ok(LAYER, check, "no XID, uncorrectable ECC or row-remap event during the run")
    summary = "; ".join(f"{f['gpu']}: {f['what']}" + (f" x{f['increase']}" if f.get("increase", 1) > 1 else "")
                        for f in found[:MAX_RANGES])
    return problem(LAYER, check, f"GPU errors during the run: {summary}; drain the node and check the GPU",
                   1.0, events=found[:50])


CHECKS = (gpu_errors, gpu_slowdown, gpu_links)
