"""Silent data corruption: replicas that disagreed (sdc.rules.yml, docs/sdc.md)."""

from __future__ import annotations

from trainguard.alerts.promql import RATE, RUN, Alert, Group
from trainguard.policy import Policy


def sdc(policy: Policy) -> list[Group]:
    """Replica mismatches (trainer/replica_check.py): the trainer has already rolled back on its own,
    within the step; the alert tells a human, who decides about the hardware."""
    alerts = Group("sdc", "trainguard-sdc.alerts", (
        Alert("ReplicaMismatch",
              f'max by ({RUN}) (increase(trainguard_training_events_total{{type="replica_mismatch"}}[{RATE}])) > 0',
              "critical", "Replicas of run {{ $labels.run_id }} disagreed: silent data corruption",
              "Data-parallel replicas that train in lockstep held different weights or gradients at a replica "
              "check (bit-exact fingerprints). The trainer rolled every rank back to the newest verified "
              "checkpoint on its own; the incident under RUN/incidents/ names the rank and node when that can "
              "be told, and a node named twice within guard.replica_cordon_window_seconds is cordoned."),
    ))
    return [alerts]
