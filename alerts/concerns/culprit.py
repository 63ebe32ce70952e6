"""A hang's culprit named, and its node kept out (culprit.rules.yml, docs/incidents.md)."""

from __future__ import annotations

from trainguard.alerts.promql import Alert, Group
from trainguard.policy import Policy


def culprit(policy: Policy) -> list[Group]:
    """A hang's culprit named, and its node kept out (agent/culprit.py, docs/incidents.md)."""
    alerts = Group("culprit", "trainguard-culprit.alerts", (
        Alert("HangCulprit",
              'max by (job, node, kind) (increase(trainguard_culprit_verdicts_total{node!=""}[10m])) > 0',
              "critical", "A {{ $labels.kind }} was traced to node {{ $labels.node }}",
              "The agents gathered the evidence of a stall (Flight Recorder, py-spy stacks, the nodes' "
              "signals) and named this node's rank(s) as the culprit. `trainguard incidents RUN` shows the "
              "verdict and its evidence; with restore.evict the node is cordoned and the job re-forms "
              "without it."),
        Alert("NodeCordoned", "max by (job, node) (trainguard_node_cordoned) > 0",
              "warning", "Node {{ $labels.node }} is cordoned: kept out of the job",
              "The node was the culprit of a hang and is kept out of the job (RUN/control/cordon/<host>); "
              "its launcher refuses to join. Repair or replace it, then `trainguard uncordon RUN HOST`."),
    ))
    return [alerts]
