"""`trainguard diagnose`: the likely causes of lost throughput in a run, by layer, with the evidence.

    from trainguard.diagnose import diagnose_run
    for finding in diagnose_run("runs/exp1"):       # problems first, in the order to look at them
        print(finding.layer, finding.status, finding.cause, finding.evidence)

Layers, in the order an operator should look: hardware, driver, framework, data, algorithm. Every check
is a pure function ``check(run: RunData, policy: Policy) -> Finding`` over the columns `loader` read;
thresholds come from `policy.alerts` (the same numbers the Prometheus rules use) and `policy.diagnose`.
"""

from __future__ import annotations

from pathlib import Path

from trainguard.diagnose import algorithm, data, driver, framework, hardware
from trainguard.diagnose.finding import LAYERS, NO_DATA, OK, PROBLEM, Finding, rank_findings
from trainguard.diagnose.loader import RunData, load_run
from trainguard.policy import Policy

__all__ = ["CHECKS", "Finding", "LAYERS", "NO_DATA", "OK", "PROBLEM", "RunData", "diagnose", "diagnose_run",
           "load_run"]

# Layer order; within a layer, the order the checks' modules list them.
CHECKS = (*hardware.CHECKS, *driver.CHECKS, *framework.CHECKS, *data.CHECKS, *algorithm.CHECKS)


def diagnose(run: RunData, policy: Policy | None = None) -> list[Finding]:
    """Every check over `run`, ranked: problems (by layer, strongest first), then no-data, then ok. Pure."""
    policy = policy or Policy()
    return rank_findings([check(run, policy) for check in CHECKS])


def diagnose_run(run_dir: str | Path, policy: Policy | None = None) -> list[Finding]:
    """Read RUN/tls/*.jsonl and diagnose it (the report and the CLI call this)."""
    return diagnose(load_run(run_dir), policy)
