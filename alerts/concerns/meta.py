"""Meta: the agent itself, environment drift between nodes (meta.rules.yml)."""

from __future__ import annotations

from trainguard.alerts.promql import AGENT_JOB, Alert, Group
from trainguard.policy import Policy


def meta(policy: Policy, agent_job: str = AGENT_JOB) -> list[Group]:
    a = policy.alerts
    alerts = Group("meta", "trainguard-meta.alerts", (
        Alert("AgentDown", f'up{{job="{agent_job}"}} == 0',
              "critical", "trainguard agent {{ $labels.instance }} is down",
              "Prometheus cannot scrape the agent: this node's GPUs, IO and training are unwatched and "
              "its alerts cannot act. Check the agent's process and its log.",
              for_=a.for_short),
        Alert("EnvironmentMismatch",
              "count by (job) (\n"
              "  count by (job, torch, cuda, nccl, driver, python, trainguard) (trainguard_node_info)\n"
              ") > 1",
              "warning", "Nodes of {{ $labels.job }} run {{ $value }} different software environments",
              "The nodes of this run report different torch, CUDA, NCCL, driver or Python versions: "
              "numerics and collectives may differ between ranks. Compare trainguard_node_info "
              "across nodes.",
              for_=a.for_short),
    ))
    return [alerts]
