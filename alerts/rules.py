"""The Prometheus rules of trainguard, from one source of truth (the monitoring-mixin pattern).

Every alert and recording rule is defined once, with its thresholds taken from the policy
(`trainguard.policy.Policy().alerts` and `.cost`), and rendered into one rule file per concern:

    training.rules.yml   loss, gradients, stalls, throughput, data utilisation, checkpoints, stragglers
    hardware.rules.yml   GPU temperature, Xid errors, allocator fragmentation
    io-nccl.rules.yml    disk await, data loader starvation, communication overhead, NCCL watchdog
    cost.rules.yml       cost per 1000 steps, budget overrun, the three budget tiers
    meta.rules.yml       the agent itself, environment drift between nodes
    sdc.rules.yml, culprit.rules.yml   replicas that disagreed; a hang's culprit and its cordoned node
    fleet-shard.rules.yml   at scale (docs/scale.md): per-node aggregates each shard Prometheus records
                         and remote-writes to the global one
    fleet-global.rules.yml  on the global Prometheus: the rules that need every node (the job stalled
                         everywhere, one node far slower than the rest, the job's cost)

Where things are: a rule lives in its concern's module, `alerts/concerns/<concern>.py` (add one there);
what a rule is (Alert, Record, Group) and the windows and label sets they share, `alerts/promql.py`; the
YAML, `alerts/render.py`. This module is the index: which concerns, in which order, on which tier.

The files under alerts/ are generated with the default policy and checked in; a test renders them
again and fails on any difference. `trainguard alerts render --policy FILE` renders a run's own.

An alert that should act carries an `action` label from `trainguard.actions`; Alertmanager routes those
to the agent's webhook (see alertmanager.py) and the agent's ledger decides what to do.
"""

from __future__ import annotations

from pathlib import Path

from trainguard.alerts import render as render_mod
from trainguard.alerts.concerns.cost import cost
from trainguard.alerts.concerns.culprit import culprit
from trainguard.alerts.concerns.fleet import GLOBAL_FEED, fleet_global, fleet_shard
from trainguard.alerts.concerns.hardware import hardware
from trainguard.alerts.concerns.io_nccl import io_nccl
from trainguard.alerts.concerns.meta import meta
from trainguard.alerts.concerns.sdc import sdc
from trainguard.alerts.concerns.training import fail_slow, training
from trainguard.alerts.promql import Alert, Group, Record
from trainguard.alerts.render import HEADER, dump
from trainguard.policy import Policy

__all__ = ["CONCERNS", "FLEET_CONCERNS", "GLOBAL_FEED", "HEADER", "Alert", "Group", "Record", "alerts", "cost",
           "culprit", "dump", "fail_slow", "fleet_global", "fleet_shard", "groups", "hardware", "io_nccl", "meta",
           "render", "sdc", "training", "write"]

# The node tier, in the order of the groups in their files (training.rules.yml: training, then fail_slow).
CONCERNS = (training, hardware, io_nccl, cost, meta, sdc, culprit, fail_slow)
# The global tier's files are rendered and checked in beside the node tier's, but not loaded by
# `write()` unless asked: one Prometheus scraping the agents needs only CONCERNS.
FLEET_CONCERNS = (fleet_shard, fleet_global)


def groups(policy: Policy | None = None) -> list[Group]:
    policy = policy or Policy()
    return [group for concern in CONCERNS for group in concern(policy)]


def alerts(policy: Policy | None = None) -> list[Alert]:
    return [rule for group in groups(policy) for rule in group.rules if isinstance(rule, Alert)]


def render(policy: Policy | None = None, concerns=None, mixin=None) -> dict[str, str]:
    """{file name: YAML text} of every rule file (of `concerns`; default: both tiers), as `mixin`
    (alerts/mixin.py) says."""
    concerns = CONCERNS + FLEET_CONCERNS if concerns is None else concerns
    return render_mod.render(policy or Policy(), concerns, mixin)


def write(out_dir: str | Path, policy: Policy | None = None, concerns=None, mixin=None) -> list[Path]:
    """The rule files of `concerns` (default: the node tier, CONCERNS) written under `out_dir`."""
    concerns = CONCERNS if concerns is None else concerns
    return render_mod.write(out_dir, render(policy, concerns, mixin))
