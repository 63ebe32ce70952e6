"""The collector interface, as node_exporter's: one small class per source, registered by name.

A collector turns what it reads (NVML, procfs, sysfs, the trainer's TLS files) into metric families and a
fragment of the joined TLS node record. It never serves a scrape itself: the runner calls `update()` in
the collector's own background thread at its own interval, with a timeout, and scrapes serve the cached
result. So a collector may block, raise or hang without touching `/metrics` or any other collector.

    @register
    class LoadavgCollector(Collector):
        name = "loadavg"
        interval = 5.0

        def update(self) -> Sample:
            one, five, fifteen = (self.ctx.procfs / "loadavg").read_text().split()[:3]
            return Sample([GaugeMetricFamily("node_load1", "1m load average.", value=float(one))],
                          tls={"system": {"load1": float(one)}})
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping

from prometheus_client.core import Metric


@dataclass(frozen=True)
class Context:
    """What a collector may know about its environment; roots are overridable for fixtures and containers."""

    procfs: Path = Path("/proc")
    sysfs: Path = Path("/sys")
    devfs: Path = Path("/dev")
    run_dir: Path | None = None
    node: str = field(default_factory=socket.gethostname)
    options: Mapping[str, Any] = field(default_factory=dict)   # this collector's own section of the config file
    policy: Any = None                 # the agent's policy (trainguard.policy.Policy, agent/runner.py choose_policy)
    checkpoint_key_file: str | None = None   # the run's checkpoint key (webhook.checkpoint_key_file): signs state
    # Where a collector's own decisions go (the training collector's cost tiers): the agent's handlers.
    on_decision: Callable[[Any], None] | None = None


@dataclass
class Sample:
    """One update's result: metric families for /metrics, and this collector's part of the TLS node record.

    A family handed out is never changed afterwards (scrapes read it while the next update runs, and the
    exposition reuses the text of a family it has seen): make new families, or hand out the same ones again
    only if nothing in them changed. trainguard/metrics/families.py builds them cheaply (`Spec`, `LabelCache`).
    """

    families: list[Metric]
    # {"hardware": {...}, "system": {...}, "metrics": {...}}: merged section by section into the node record
    tls: dict = field(default_factory=dict)


class Collector:
    """Base class. Subclasses set `name` and implement `update()`; `close()` releases what they hold."""

    name: ClassVar[str]
    default_enabled: ClassVar[bool] = True
    interval: ClassVar[float] = 5.0     # seconds between updates; overridable per collector in the config
    timeout: ClassVar[float] = 10.0     # an update running longer is reported as hung

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def update(self) -> Sample:
        """Read the source and return a fresh Sample; raise on failure (CollectorDisabled if it cannot run here)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release handles (NVML, open files); called once at shutdown."""


class CollectorDisabled(Exception):
    """Raised from __init__ or update when the collector cannot run here (e.g. no NVML).

    The runner logs the message once, in one line, reports the collector as disabled and stops calling it.
    """


REGISTRY: dict[str, type[Collector]] = {}


def register(cls: type[Collector]) -> type[Collector]:
    """Class decorator: make the collector known by its `name` (a later registration of a name replaces it)."""
    REGISTRY[cls.name] = cls
    return cls
