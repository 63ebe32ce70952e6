"""preflight: this node's last `trainguard preflight` result, so Prometheus sees a failed check and the
EnvironmentMismatch alert can compare the environments of a run's nodes.

It reads the file preflight writes (RUN/preflight.json, else ~/.cache/trainguard/preflight.json; option
`path` overrides), again only when the file changes. No result yet is not an error: nothing is exported
until preflight has run. A file that is not a preflight result fails the update with the file and field.

    trainguard_preflight_success                       1 if every check passed
    trainguard_preflight_check_success{check}          1 passed, 0 failed (skipped checks are absent)
    trainguard_preflight_timestamp_seconds             when the result was made
    trainguard_environment_info{torch_version, cuda_version, nccl_version, driver_version, python_version,
                                gpu_name, lock_hash}   the versions preflight found, for EnvironmentMismatch
"""

from __future__ import annotations

import os
from pathlib import Path

from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily

from trainguard.agent.collector import Collector, Context, Sample, register
from trainguard.agent.collectors.options import options
from trainguard.runtime import preflight_result as preflight_result

# environment key -> label of trainguard_environment_info (the names the EnvironmentMismatch rule groups by)
ENV_LABELS = {"torch": "torch_version", "cuda": "cuda_version", "nccl": "nccl_version", "driver": "driver_version",
              "python": "python_version", "gpu_name": "gpu_name"}


def families(result: dict) -> list:
    """Metric families of one preflight result (as `trainguard.runtime.preflight_result.read` returns it)."""
    overall = GaugeMetricFamily("trainguard_preflight_success", "1 if every check of the last preflight passed.",
                                value=1 if result["passed"] else 0)
    checks = GaugeMetricFamily("trainguard_preflight_check_success", "1 if this preflight check passed, 0 if it "
                               "failed (skipped checks are absent).", labels=["check"])
    for check in result["checks"]:
        if check["status"] != preflight_result.SKIP:
            checks.add_metric([check["name"]], 1 if check["status"] == preflight_result.PASS else 0)
    when = GaugeMetricFamily("trainguard_preflight_timestamp_seconds", "When the last preflight ran (Unix time).",
                             value=result["timestamp"])
    info = InfoMetricFamily("trainguard_environment", "Software environment found by the last preflight; nodes of "
                            "one run should agree (EnvironmentMismatch).")
    env = result["environment"]
    info.add_metric([], {**{label: str(env.get(key, "")) for key, label in ENV_LABELS.items()},
                         "lock_hash": result["lock_hash"]})
    return [overall, checks, when, info]


@register
class PreflightCollector(Collector):
    name = "preflight"
    interval = 30.0
    timeout = 5.0

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        opts = options(ctx.options, self.name, path=None)
        self.path = Path(opts["path"]) if opts["path"] else preflight_result.default_path(ctx.run_dir)
        self._seen: tuple[int, int] | None = None     # (mtime_ns, size) of the file last parsed
        self._sample = Sample([])

    def update(self) -> Sample:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._seen, self._sample = None, Sample([])
            return self._sample
        if self._seen != (st.st_mtime_ns, st.st_size):
            result = preflight_result.read(self.path)      # ResultError: the runner reports this update failed
            self._sample = Sample(families(result), tls={"system": {"preflight_passed": result["passed"],
                                                                    "environment_hash": result["lock_hash"]}})
            self._seen = (st.st_mtime_ns, st.st_size)
        return self._sample
