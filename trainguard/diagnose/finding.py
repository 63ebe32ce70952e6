"""What a diagnosis check returns: one Finding per check, whatever it found.

A finding is a `problem` (the check saw a likely cause of lost throughput, with the evidence), `ok` (the
check had the data and saw nothing) or `no_data` (the logs do not hold what the check needs, and
`needs` says what). Checks never guess: a check that cannot tell says so.

`score` is the share of the run a cause takes, 0..1, so causes from different layers compare: for
timing checks the share of step time lost (0.3 = 30% of the run's time); for conditions (a throttled
GPU, slow disks, a degraded link) the share of samples in the condition; for wasted resources the share
wasted (loaded tokens never trained, reserved memory holding no tensor, steps spent on a plateau); for
error events (XID, uncorrectable ECC) 1, since they explain everything above them.

Problems are ranked by score, biggest first; equal scores go in the order an operator should look
(hardware, driver, framework, data, algorithm: a lower layer explains symptoms in the layers above).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The order an operator should look in: a bad GPU explains everything above it, the algorithm nothing below.
LAYERS = ("hardware", "driver", "framework", "data", "algorithm")

PROBLEM, OK, NO_DATA = "problem", "ok", "no_data"
_STATUS_ORDER = {PROBLEM: 0, NO_DATA: 1, OK: 2}


@dataclass(frozen=True)
class Finding:
    layer: str                 # one of LAYERS
    check: str                 # stable id of the check, e.g. "data_wait"
    status: str                # problem | ok | no_data
    cause: str                 # one line a person reads: what the check concludes
    score: float = 0.0         # 0..1, see the module docstring; 0 unless a problem
    evidence: dict[str, Any] = field(default_factory=dict)   # values, steps, time ranges
    needs: str | None = None   # for no_data: what the logs would have to hold

    def to_dict(self) -> dict:
        out = {"layer": self.layer, "check": self.check, "status": self.status, "cause": self.cause,
               "score": round(self.score, 4), "evidence": self.evidence}
        if self.needs:
            out["needs"] = self.needs
        return out


def problem(layer: str, check: str, cause: str, score: float, **evidence: Any) -> Finding:
    return Finding(layer, check, PROBLEM, cause, min(1.0, max(0.0, score)), evidence)


def ok(layer: str, check: str, cause: str, **evidence: Any) -> Finding:
    return Finding(layer, check, OK, cause, 0.0, evidence)


def no_data(layer: str, check: str, needs: str, **evidence: Any) -> Finding:
    return Finding(layer, check, NO_DATA, f"not enough data: needs {needs}", 0.0, evidence, needs)


def rank_findings(findings: list[Finding]) -> list[Finding]:
    """Problems first, biggest share of the run first (layer order breaks ties), then checks without data,
    then the clean ones, each of those in layer order."""
    return sorted(findings, key=lambda f: (_STATUS_ORDER[f.status], -round(f.score, 2), LAYERS.index(f.layer)))
