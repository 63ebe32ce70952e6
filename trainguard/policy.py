"""The policy file: every threshold trainguard acts on, assembled from the components that read them.

Each component declares its own keys beside its code (trainguard/config.py: type, default, range and one
line of doc together, as torchtitan's components do): the guard's rules and escalation
(decide/guard.py `GuardPolicy`), the cost meter (decide/cost.py), the stall rule (decide/stall.py), the
webhook's ledger (decide/ledger.py), the training dynamics (decide/schedules.py, trends.py, clipping.py,
layers.py), the replica check (decide/replica.py). This module assembles them into the file's sections,
and declares here only what has no component in the core to live beside: the Prometheus rules'
thresholds (alerts/ renders them), diagnose's, preflight's, the restore's and the actions' mode.

The YAML file overrides any subset of the defaults; an unknown key, a value of the wrong type or out of
its range is an error naming the file and the key (`PolicyError`), checked once at load, so no value can
crash or silently disable a guard later. One number per concept: an older key that meant the same number
(`alerts.loss_spike_sigma`) is the declared `alias` of the one key, accepted, and an error beside it with
another value. docs/policy.md is generated from the declarations (`python -m trainguard.policy`).

    cost:
      price_per_gpu_hour: 2.0        # USD
      budget_per_1k_steps: 120       # USD per 1000 steps
      tiers: {warn: 0.30, throttle: 0.60, stop: 1.00}   # overrun over budget
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from trainguard import actions as actions_mod, paths, safe_read
from trainguard.config import (ABSOLUTE_PATH, DURATION, SHARE, WINDOW, Choice, Key, Range, above, at_least, between,
                               cross_checks, declared, key, leaves, parse_duration, shown)
from trainguard.decide.checkpoint_interval import CheckpointPolicy
from trainguard.decide.clipping import ClippingPolicy
from trainguard.decide.cost import CostPolicy, CostTiers
from trainguard.decide.guard import GuardPolicy
from trainguard.decide.layers import LayerResponsePolicy
from trainguard.decide.node_risk import NodeRiskPolicy
from trainguard.decide.ledger import LedgerConfig
from trainguard.decide.schedules import BreathingPolicy, DynamicsPolicy, PhasePolicy
from trainguard.decide.stall import StallConfig
from trainguard.decide.trends import PlateauPolicy, StabilityPolicy
from trainguard.exits import BadInput

# Re-exported: the sections' classes are imported from here across the tree (the policy is their one door).
__all__ = ["BreathingPolicy", "CheckpointPolicy", "ClippingPolicy", "CostPolicy", "CostTiers", "DynamicsPolicy", "GuardPolicy",
           "LayerResponsePolicy", "PhasePolicy", "PlateauPolicy", "Range", "StabilityPolicy", "parse_duration"]


class PolicyError(BadInput):
    pass


@dataclass(frozen=True)
class AlertRulesConfig:
    """Thresholds only the Prometheus rules read (alerts/concerns/ renders them; alerts/ is outside the core,
    so they are declared here). The loss-spike sigma and the explosion factor are the guard's."""

    gpu_temp_c: float = key(85.0, above(0, 200), "GPUOverheating: GPU temperature in C")
    disk_await_ms: float = key(10.0, above(0), "DiskAwaitHigh: mean disk await in ms")
    data_wait_ratio: float = key(0.20, SHARE, "DataLoaderStarved: share of step time waiting for data")
    data_utilization_min: float = key(0.92, SHARE, "LowDataUtilization: tokens trained over tokens loaded under this")
    comm_overhead_max: float = key(0.15, SHARE, "CommOverheadHigh: share of step time in communication")
    fragmentation_min: float = key(0.70, SHARE, "GPUMemoryFragmented: allocated over reserved memory under this")
    checkpoint_stale_seconds: float = key(3600.0, above(0, 10**8), "CheckpointStale: no checkpoint for this long")
    low_throughput_ratio: float = key(0.5, SHARE, "LowEffectiveThroughput: tokens/s under this share of the "
                                      "recent peak")
    slow_node_factor: float = key(1.5, above(1, 1000), "the global tier's JobNodeSlow: a node's step time over this "
                                  "x the job's median")
    for_short: str = key("30s", DURATION, "how long a fast condition must hold before its alert fires")
    for_long: str = key("2m", DURATION, "how long a slow condition must hold before its alert fires")


# The `alerts` section: the stall rule's keys, the rules' own thresholds, the webhook ledger's. dataclasses
# collect fields from the last base first, so the file lists them from StallConfig down.
@dataclass(frozen=True)
class AlertPolicy(LedgerConfig, AlertRulesConfig, StallConfig):
    """Thresholds of the Prometheus rules (alerts/ is generated from these) and of the agent's webhook."""


@dataclass(frozen=True)
class DiagnosePolicy:
    """Thresholds `trainguard diagnose` needs beyond the alert thresholds (which it reads from `alerts`)."""

    warmup_steps: int = key(5, at_least(0, 10**6), "first steps of each rank left out of timing statistics "
                            "(compile, caches)")
    min_steps: int = key(10, WINDOW, "steps after warm-up a timing check needs")
    straggler_score_min: float = key(0.75, SHARE, "NVRx relative score (fastest rank's median / this rank's); "
                                     "below = straggler")
    slow_step_factor: float = key(1.5, above(1), "a step slower than this times the median compute time is slow")
    jitter_max: float = key(0.10, SHARE, "share of compute time lost to slow steps that counts as a problem")
    clock_ratio_min: float = key(0.85, SHARE, "SM clock under this share of its max while busy = throttled")
    link_ratio_min: float = key(0.5, SHARE, "PCIe/NVLink link running under this share of its capability")
    leak_min_bytes: float = key(512.0 * 2**20, at_least(0), "device memory growth, not matched by the "
                                "allocator's, that counts as a leak")
    plateau_window_steps: int = key(100, at_least(2, 10**6), "loss plateau: the two halves of a log's last this "
                                    "many steps are compared (dynamics.plateau judges live, over its own window)")
    plateau_min_improvement: float = key(0.01, at_least(0), "loss plateau: relative improvement across the window "
                                         "under which the steps buy nothing")
    grad_trend_max_ratio: float = key(3.0, above(0), "grad-norm median of the last quarter over the second quarter")


@dataclass(frozen=True)
class PreflightPolicy:
    """What `trainguard preflight` accepts on a node before a long run."""

    idle_temp_c_max: float = key(60.0, above(0, 200), "a GPU hotter than this while idle has a cooling problem")
    idle_clock_ratio_min: float = key(0.5, SHARE, "max SM clock allowed now over the device's max (clock locks, "
                                      "power caps)")
    checkpoints_of_headroom: float = key(4.0, at_least(0, 10**4), "free space for this many checkpoints "
                                         "(keep_last 3 + one in flight)")
    checkpoint_write_seconds_max: float = key(300.0, above(0), "a checkpoint must write within this at the "
                                              "measured speed")
    write_probe_bytes: int = key(64 * 2**20, at_least(1, 2**40), "bytes written (and fsynced) to measure the "
                                 "write speed")
    collective_timeout_seconds: float = key(60.0, above(0, 10**6), "a test collective slower than this fails")
    # NCCL_IB_TIMEOUT is 4.096 us * 2^N per retry
    nccl_ib_timeout_min: int = key(14, at_least(1, 31), "NCCL_IB_TIMEOUT under this retries too eagerly")
    nccl_ib_timeout_max: int = key(24, at_least(1, 31), "NCCL_IB_TIMEOUT over this takes minutes to notice a "
                                   "dead peer")
    heartbeat_timeout_seconds_max: float = key(1800.0, above(0), "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC upper bound")

    def cross_check(self, where: str) -> str | None:
        if self.nccl_ib_timeout_min > self.nccl_ib_timeout_max:
            return f"{where}.nccl_ib_timeout_min: must not exceed {where}.nccl_ib_timeout_max"
        return None


EVICT_CHOICES = ("auto", "on", "off")
EVICT_STRAGGLERS_CHOICES = ("off",)


@dataclass(frozen=True)
class RestorePolicy:
    """What a restore may do beyond ending the ranks (docs/incidents.md, docs/runbooks.md#trainingstraggler)."""

    # "auto" evicts when the job is elastic (--nnodes MIN:MAX with MIN < MAX) or a hot spare waits to take the
    # node's place (trainguard/spares.py), "on" always (never below MIN, spares counted), "off" never.
    evict: str = key("auto", Choice(EVICT_CHOICES), "keep a hang's culprit node out of the job (cordon, end its "
                     "launcher, re-form on the others)")
    max_evictions_per_hour: int = key(2, at_least(0, 10**4), "evictions an hour at most")
    evidence_seconds: float = key(15.0, above(0, 3600), "how long an agent waits for the ranks' Flight Recorder "
                                  "dumps and the other nodes' evidence")
    # Evicting a fail-slow node is not built yet: "on" is refused at load rather than ignored.
    evict_stragglers: str = key("off", Choice(EVICT_STRAGGLERS_CHOICES), "evict the node of a rank "
                                "TrainingStraggler names for long (only off: alert only)")


@dataclass(frozen=True)
class ActionsPolicy:
    """How decisions reach the run (docs/trainer.md#shadow-mode): "act" carries them out; "shadow" decides and
    records each one as a `shadow_action` event with its evidence, and carries out none (no skipped step,
    no rollback, restore, stop, cordon or ended process), for the trainer, the callbacks and the agent."""

    mode: str = key(actions_mod.ACT_MODE, Choice(actions_mod.MODES), "act: carry decisions out; shadow: decide "
                    "and record them, carry out none")


RECOVERY_MODES = ("in_process", "restart")


@dataclass(frozen=True)
class RecoveryPolicy:
    """How a rank's failure is recovered (docs/recovery.md; its component is runtime/resilience/, outside the
    core). "in_process": the surviving processes tear their process group down, meet in the job's store,
    re-form it and restore the newest verified in-memory snapshot, in the same interpreters (a killed
    process's place taken by its warm standby, `standbys`); what cannot be recovered so (a barrier not met in
    time) goes the "restart" way: torchrun restarts every worker from the newest verified state."""

    mode: str = key("in_process", Choice(RECOVERY_MODES), "in_process: re-form the group in the same processes "
                    "and restore the in-memory snapshot; restart: torchrun restarts every worker (the old path)")
    # The snapshot tier's interval (the checkpoint autopilot steers it when on); its cost is each
    # `snapshot_saved` event's `blocking_seconds`.
    snapshot_every: int = key(5, at_least(0, 10**7), "steps between in-memory snapshots (host memory, "
                              "snapshot_dir); 0: none, a failure restores the durable checkpoint; with the "
                              "checkpoint autopilot on, where it starts (docs/checkpoints.md)")
    snapshot_budget: float = key(0.02, between(0.0, 0.5), "the share of training time snapshots may take (the "
                                 "seconds each blocks, writes and replicates, over the step time, measured on "
                                 "rank 0): past it the interval stretches beyond snapshot_every; 0: "
                                 "snapshot_every exactly (trainguard/decide/snapshot_pace.py)")
    snapshot_keep: int = key(2, at_least(1, 100), "in-memory snapshots kept per rank, the newest")
    snapshot_max_bytes: int = key(8 * 2**30, at_least(1, 2**50), "a rank's snapshot larger than this is not "
                                  "written (a snapshot_skipped event)")
    snapshot_dir: str = key("/dev/shm", ABSOLUTE_PATH, "the tmpfs the snapshots live on (outlives the process); "
                            "a 0700 directory of this user's per run under it")
    barrier_seconds: float = key(60.0, above(0, 3600), "how long the surviving ranks wait in the job's store "
                                 "for every rank; then the launcher restarts every worker")
    max_in_process_restarts: int = key(3, at_least(0, 10**4), "in-process restarts in a row without the run "
                                       "getting past the step that failed (the count starts again once it "
                                       "does); past it a failure goes the restart way")
    replicate: str = key("on", Choice(("on", "off")), "on: every snapshot is also held by the same local rank "
                         "on the next node (runtime/resilience/replicate.py), and a rank without its own receives "
                         "it from there (peer.py); off: each node keeps its own only")
    standbys: int = key(1, at_least(0, 1), "warm standby processes per rank (torch imported, waiting): one "
                        "takes a killed rank's place in-process; 0: a killed rank restarts every worker")


@dataclass(frozen=True)
class Policy:
    """Every threshold, by section; `load` reads a YAML file over these defaults."""

    cost: CostPolicy = field(default_factory=CostPolicy)
    guard: GuardPolicy = field(default_factory=GuardPolicy)
    alerts: AlertPolicy = field(default_factory=AlertPolicy)
    diagnose: DiagnosePolicy = field(default_factory=DiagnosePolicy)
    preflight: PreflightPolicy = field(default_factory=PreflightPolicy)
    restore: RestorePolicy = field(default_factory=RestorePolicy)
    dynamics: DynamicsPolicy = field(default_factory=DynamicsPolicy)
    actions: ActionsPolicy = field(default_factory=ActionsPolicy)
    recovery: RecoveryPolicy = field(default_factory=RecoveryPolicy)
    node_risk: NodeRiskPolicy = field(default_factory=NodeRiskPolicy)    # decide/node_risk.py, docs/node-risk.md
    checkpoint: CheckpointPolicy = field(default_factory=CheckpointPolicy)

    @property
    def shadow(self) -> bool:
        """Every action decided and recorded, none carried out (`actions.mode: shadow`)."""
        return self.actions.mode == actions_mod.SHADOW_MODE

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------------ validation

# Every declared key's check ("section.key": its range, Choice or DURATION), from the declarations.
DECLARED: dict[str, Key] = {name: declaration for name, _, declaration in leaves(Policy())}
RULES: dict[str, Range | Choice | str] = {name: declaration.check for name, declaration in DECLARED.items()}
# An older key that means the same number as a declared one: alias -> the key.
ALIASES: dict[str, str] = {d.alias: name for name, d in DECLARED.items() if d.alias}
FALLBACK = at_least(0)      # a field declared without `key` (the property test names it): finite, >= 0
ABSENT = object()           # no value at a dotted key of a decoded file


def _check_value(name: str, default: Any, value: Any) -> Any:
    """The value for field `name` (its default shows the type), or PolicyError's message."""
    rule = RULES.get(name, FALLBACK)
    if isinstance(rule, Choice):
        return rule.check(value)
    if rule == ABSOLUTE_PATH:
        if not isinstance(value, str) or not value.startswith("/") or "\0" in value:
            raise ValueError(f"expected an absolute path (like /dev/shm), got {shown(value)}")
        return value
    if rule == DURATION:
        if not isinstance(value, str):
            raise ValueError(f"expected a duration string (like 30s, 2m), got {shown(value)}")
        parse_duration(value)
        return value.strip()
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, bool) or not isinstance(value, type(default)) and not (isinstance(default, float) and numeric):
        raise ValueError(f"expected {type(default).__name__}, got {shown(value)}")
    if isinstance(default, (int, float)):
        try:
            value = type(default)(value)
        except OverflowError:
            raise ValueError(f"must be a finite number, got {shown(value)}") from None
        problem = cast(Range, rule).problem(value)      # DURATION and ABSOLUTE_PATH, the string rules, returned above
        if problem:
            raise ValueError(f"{problem}, got {shown(value)}")
    return value


def _build(cls: type, values: Any, where: str, source: str, spelled: dict[str, str]) -> Any:
    if not isinstance(values, dict):
        raise PolicyError(f"{source}: {where or 'the file'}: expected a mapping, got {type(values).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key_name, value in values.items():
        name = f"{where}.{key_name}" if where else str(key_name)
        if key_name not in fields:
            raise PolicyError(f"{source}: {name}: unknown key (known: {', '.join(sorted(fields))})")
        default = getattr(cls(), key_name)
        if declared(fields[key_name]) is None and dataclasses.is_dataclass(default):
            kwargs[key_name] = _build(type(default), value, name, source, spelled)
            continue
        try:
            kwargs[key_name] = _check_value(name, default, value)
        except ValueError as exc:
            raise PolicyError(f"{source}: {spelled.get(name, name)}: {exc}") from None
    return cls(**kwargs)


def _resolve_aliases(data: Any, source: str) -> tuple[Any, dict[str, str]]:
    """`data` with each alias given moved to the key it names (copies: the caller's mapping is left as it
    is), and which keys were spelled by an alias (their errors name what the file says). Both an alias and
    its key given, with different values, is an error: one number cannot be two."""
    spelled: dict[str, str] = {}
    for alias, name in ALIASES.items():
        given = _at(data, alias)
        if given is ABSENT:
            continue
        present = _at(data, name)
        if present is not ABSENT and present != given:
            raise PolicyError(f"{source}: {alias}: an alias of {name}, which is given too with another value "
                              f"({shown(given)} and {shown(present)}): give {name} only")
        data = _placed(_placed(data, alias, ABSENT), name, given)
        if present is ABSENT:
            spelled[name] = alias
    return data, spelled


def _at(data: Any, dotted: str) -> Any:
    """The value at a dotted key of decoded YAML, or ABSENT."""
    for part in dotted.split("."):
        if not isinstance(data, dict) or part not in data:
            return ABSENT
        data = data[part]
    return data


def _placed(data: Any, dotted: str, value: Any) -> Any:
    """A copy of `data` with `value` at the dotted key (ABSENT: removed); `data` as it is where a section on
    the way is not a mapping (`_build` names that)."""
    head, _, rest = dotted.partition(".")
    if not isinstance(data, dict):
        return data
    copy = dict(data)
    if rest:
        copy[head] = _placed(copy.get(head, {}), rest, value)
    elif value is ABSENT:
        copy.pop(head, None)
    else:
        copy[head] = value
    return copy


def from_mapping(data: Any, source: str = "policy") -> Policy:
    """A checked policy from decoded YAML (`source` names it in errors)."""
    data, spelled = _resolve_aliases({} if data is None else data, source)
    policy: Policy = _build(Policy, data, "", source, spelled)
    for problem in cross_checks(policy):
        raise PolicyError(f"{source}: {problem}")
    return policy


def load(path: str | Path | None = None) -> Policy:
    """The defaults, overridden by the YAML file at `path` when given."""
    if path is None:
        return Policy()
    try:
        data = read_yaml(path, "policy file")
    except ValueError as exc:
        raise PolicyError(str(exc)) from None
    return from_mapping(data, str(path))


def read_yaml(path: str | Path, what: str) -> Any:
    """A YAML file decoded, or ValueError naming the file and what is wrong (missing, unreadable, not
    UTF-8, not YAML, nested too deeply): the policy and the agent config read their files through this."""
    import yaml   # the built-in policy (no file) is most commands' policy: they start without YAML

    source = str(path)
    try:
        return safe_read.read_yaml(paths.regular_file(path, what), what=what)
    except FileNotFoundError as exc:  # missing, a directory, a FIFO or a device: named by trainguard.paths
        raise ValueError(str(exc)) from None
    except IsADirectoryError:
        raise ValueError(f"{source}: is a directory, not a {what}") from None
    except safe_read.RunFileError as exc:     # a FIFO swapped in after the check, too large
        raise ValueError(str(exc)) from None
    except OSError as exc:
        raise ValueError(f"{source}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{source}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{source}: not valid YAML: {exc}") from None
    except RecursionError:
        raise ValueError(f"{source}: nested too deeply") from None


def in_shadow(policy: Policy) -> Policy:
    """`policy` with every action shadowed (`--shadow` on `train` and `agent`, over the file's mode)."""
    return dataclasses.replace(policy, actions=ActionsPolicy(mode=actions_mod.SHADOW_MODE))


def dump(policy: Policy) -> str:
    import yaml

    text: str = yaml.safe_dump(policy.to_dict(), sort_keys=False)
    return text


# ------------------------------------------------------------------------------------ the reference

def reference() -> str:
    """docs/policy.md: every key, by section, with its default, what values it takes and its doc, from the
    declarations (tests/property/test_policy_doc.py holds the file to this)."""
    lines = ["# Policy keys", "",
             "Generated from the declarations beside each component (trainguard/config.py) by",
             "`python -m trainguard.policy > docs/policy.md`; do not edit by hand. A YAML file given with",
             "`--policy` / `--config` overrides any subset of these defaults; an unknown key, a wrong type or a",
             "value out of range is an error naming the file and the key (exit status 2).", ""]
    sections: dict[str, list[str]] = {}       # by section, in the order the sections first appear
    for name, default, declaration in leaves(Policy()):
        alias = f" (alias: `{declaration.alias}`)" if declaration.alias else ""
        sections.setdefault(name.rsplit(".", 1)[0], []).append(
            f"| `{name}`{alias} | `{default!r}` | {declaration.describe()} | {declaration.doc} |")
    for section, rows in sections.items():
        lines += [f"## `{section}`", "", "| key | default | values | what |", "|---|---|---|---|", *rows, ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(reference())
