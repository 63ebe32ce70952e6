"""The policy file: every threshold trainguard acts on, in one place.

The guard, the cost meter, the generated Prometheus rules and replay all read these dataclasses, so a
threshold changed here changes every path that enforces it. The YAML file overrides any subset of the
defaults; an unknown key or a value of the wrong type is an error naming the file and the key.

    cost:
      price_per_gpu_hour: 2.0        # USD
      budget_per_1k_steps: 120       # USD per 1000 steps
      tiers: {warn: 0.30, throttle: 0.60, stop: 1.00}   # overrun over budget
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class PolicyError(ValueError):
    pass


@dataclass(frozen=True)
class CostTiers:
    warn: float = 0.30
    throttle: float = 0.60
    stop: float = 1.00


@dataclass(frozen=True)
class CostPolicy:
    price_per_gpu_hour: float = 2.0
    budget_per_1k_steps: float = 120.0
    tiers: CostTiers = field(default_factory=CostTiers)
    # Cost per 1000 steps is judged over this many recent steps, so start-up does not trip a tier.
    window_steps: int = 50
    # Steps needed before any tier may act.
    min_steps: int = 20
    # Billable devices when not 0; else the GPU count from the records. CPU-only runs (demo, tests)
    # report no GPUs and are billed as this many devices.
    gpu_count_override: int = 0


@dataclass(frozen=True)
class GuardPolicy:
    # Loss spike, as OLMo-core's stability monitor: above mean + sigma * std of the last `window`
    # losses, once `min_steps` have been seen.
    spike_sigma: float = 6.0
    spike_window: int = 128
    spike_min_steps: int = 64
    # Gradient explosion: global (and per-layer) norm above `factor` times its EMA.
    grad_ema_beta: float = 0.98
    grad_explode_factor: float = 10.0
    layer_explode_factor: float = 25.0
    grad_min_steps: int = 20
    # Bad steps (skipped) this many times within `rollback_window` steps trigger a rollback.
    rollback_after: int = 3
    rollback_window: int = 50
    max_rollbacks_per_hour: int = 3
    rollback_lr_factor: float = 0.5
    rewarmup_steps: int = 20


@dataclass(frozen=True)
class AlertPolicy:
    """Thresholds of the Prometheus rules (alerts/ is generated from these)."""

    stall_seconds: float = 60.0
    # The agent's stall watchdog: ranks that started this long ago and have not written a TLS record since
    # (hung in imports, rendezvous or resume) are stalled too. Start-up takes minutes on big models.
    startup_grace_seconds: float = 900.0
    gpu_temp_c: float = 85.0
    disk_await_ms: float = 10.0
    data_wait_ratio: float = 0.20
    data_utilization_min: float = 0.92
    comm_overhead_max: float = 0.15
    fragmentation_min: float = 0.70
    checkpoint_stale_seconds: float = 3600.0
    low_throughput_ratio: float = 0.5
    loss_spike_sigma: float = 6.0
    grad_explode_factor: float = 10.0
    for_short: str = "30s"
    for_long: str = "2m"
    # The webhook's ledger (trainguard/decide/ledger.py): a second rollback or restore within the cooldown
    # joins the first (one incident, several alerts); restores beyond the hourly limit page a human.
    action_cooldown_seconds: float = 120.0
    max_restores_per_hour: int = 3


@dataclass(frozen=True)
class DiagnosePolicy:
    """Thresholds `trainguard diagnose` needs beyond the alert thresholds (which it reads from `alerts`)."""

    warmup_steps: int = 5               # first steps of each rank left out of timing statistics (compile, caches)
    min_steps: int = 10                 # steps after warm-up a timing check needs
    straggler_score_min: float = 0.75   # NVRx relative score (fastest rank's median / this rank's); below = straggler
    slow_step_factor: float = 1.5       # a step slower than this times the median compute time is a slow step
    jitter_max: float = 0.10            # share of compute time lost to slow steps that counts as a problem
    clock_ratio_min: float = 0.85       # SM clock under this share of its max while busy = throttled
    link_ratio_min: float = 0.5         # PCIe/NVLink link running under this share of its capability
    leak_min_bytes: float = 512.0 * 2**20  # device memory growth, not matched by the allocator's, that counts
    plateau_window_steps: int = 100     # loss compared across the two halves of the last window
    plateau_min_improvement: float = 0.01   # relative loss improvement across the window
    grad_trend_max_ratio: float = 3.0   # grad-norm median of the last quarter over the second quarter


@dataclass(frozen=True)
class PreflightPolicy:
    """What `trainguard preflight` accepts on a node before a long run."""

    idle_temp_c_max: float = 60.0          # a GPU hotter than this while idle has a cooling problem
    idle_clock_ratio_min: float = 0.5      # max SM clock allowed now over the device's max (clock locks, power caps)
    checkpoints_of_headroom: float = 4.0   # free space for this many checkpoints (keep_last 3 + one in flight)
    checkpoint_write_seconds_max: float = 300.0   # a checkpoint must write within this at the measured speed
    write_probe_bytes: int = 64 * 2**20    # bytes written (and fsynced) to measure the write speed
    collective_timeout_seconds: float = 60.0
    nccl_ib_timeout_min: int = 14          # NCCL_IB_TIMEOUT is 4.096 us * 2^N per retry: under 14 retries
    nccl_ib_timeout_max: int = 24          # too eagerly, over 24 a dead peer takes minutes to notice
    heartbeat_timeout_seconds_max: float = 1800.0   # TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC upper bound


@dataclass(frozen=True)
class RestorePolicy:
    """What a hang's restore does beyond ending the ranks (docs/incidents.md)."""

    # Keep the culprit's node out of the job (cordon, end its launcher, re-form on the others):
    # "auto" does it when the job is elastic (--nnodes MIN:MAX with MIN < MAX), "on" always, "off" never.
    evict: str = "auto"
    max_evictions_per_hour: int = 2
    # How long an agent waits for the ranks' Flight Recorder dumps and the other nodes' evidence.
    evidence_seconds: float = 15.0


EVICT_CHOICES = ("auto", "on", "off")


@dataclass(frozen=True)
class Policy:
    cost: CostPolicy = field(default_factory=CostPolicy)
    guard: GuardPolicy = field(default_factory=GuardPolicy)
    alerts: AlertPolicy = field(default_factory=AlertPolicy)
    diagnose: DiagnosePolicy = field(default_factory=DiagnosePolicy)
    preflight: PreflightPolicy = field(default_factory=PreflightPolicy)
    restore: RestorePolicy = field(default_factory=RestorePolicy)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _build(cls: type, values: Any, where: str, source: str) -> Any:
    if not isinstance(values, dict):
        raise PolicyError(f"{source}: {where}: expected a mapping, got {type(values).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        name = f"{where}.{key}" if where else str(key)
        if key not in fields:
            raise PolicyError(f"{source}: {name}: unknown key (known: {', '.join(sorted(fields))})")
        default = getattr(cls(), key)
        if dataclasses.is_dataclass(default):
            kwargs[key] = _build(type(default), value, name, source)
        elif isinstance(default, bool) or not isinstance(value, type(default)) and not (
                isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool)):
            raise PolicyError(f"{source}: {name}: expected {type(default).__name__}, got {value!r}")
        else:
            if isinstance(default, (int, float)) and value < 0:
                raise PolicyError(f"{source}: {name}: must not be negative, got {value!r}")
            kwargs[key] = type(default)(value)
    return cls(**kwargs)


def load(path: str | Path | None = None) -> Policy:
    """The defaults, overridden by the YAML file at `path` when given."""
    if path is None:
        return Policy()
    source = str(path)
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise PolicyError(f"{source}: no such policy file") from None
    except yaml.YAMLError as exc:
        raise PolicyError(f"{source}: not valid YAML: {exc}") from None
    policy = _build(Policy, data, "", source)
    tiers = policy.cost.tiers
    if not tiers.warn <= tiers.throttle <= tiers.stop:
        raise PolicyError(f"{source}: cost.tiers: expected warn <= throttle <= stop, got {tiers}")
    if policy.restore.evict not in EVICT_CHOICES:
        raise PolicyError(f"{source}: restore.evict: expected one of {', '.join(EVICT_CHOICES)}, "
                          f"got {policy.restore.evict!r}")
    return policy


def dump(policy: Policy) -> str:
    return yaml.safe_dump(policy.to_dict(), sort_keys=False)
