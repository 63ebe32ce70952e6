"""Runs the enabled collectors, each in its own daemon thread at its own interval, and serves their cache.

A scrape never calls `update()`: it reads what each collector's last update left, so a slow driver or
disk never stalls `/metrics`. Every update is timed. One that raises is reported as failed; one still
running past its timeout is reported as hung (its thread is left alone, no next call starts while it
runs, and whatever it returns late is discarded). A collector that is failed or hung has no metrics in
the exposition, as in node_exporter, and `trainguard_scrape_collector_success` says so; the others go on.
"""

from __future__ import annotations

import platform
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import InfoMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector

import trainguard
from trainguard import log as tglog
from trainguard.agent.collector import REGISTRY, Collector, CollectorDisabled, Context, Sample
from trainguard.agent.coexist import Coexistence
from trainguard.agent.config import AgentConfig
from trainguard.metrics.families import Labels, Spec
from trainguard.agent.stop_signal import StopSignal

STARTING, OK, FAILED, HUNG, DISABLED = "starting", "ok", "failed", "hung", "disabled"


@dataclass(frozen=True)
class View:
    """A collector's state as a scrape sees it at one instant."""

    name: str
    status: str
    success: bool | None
    duration: float | None
    families: list[Metric]
    tls: dict
    last_success_time: float | None
    error: str | None
    failures: int
    updates: int
    interval: float
    timeout: float
    cpu_seconds: float

    def to_dict(self) -> dict:
        return {"status": self.status, "success": self.success, "duration_seconds": self.duration,
                "last_success_timestamp": self.last_success_time, "error": self.error,
                "failures": self.failures, "updates": self.updates, "interval_seconds": self.interval,
                "timeout_seconds": self.timeout, "cpu_seconds": round(self.cpu_seconds, 6)}


class CollectorRunner:
    """One collector: its thread, its schedule, and what its last update left."""

    def __init__(self, cls: type[Collector], ctx: Context, interval: float, timeout: float):
        self.name, self.interval, self.timeout = cls.name, interval, timeout
        self._cls, self._ctx = cls, ctx
        self._log = tglog.get("agent.collector", collector=self.name)
        self._lock = threading.Lock()
        self._stop = StopSignal()
        self._thread: threading.Thread | None = None
        self.collector: Collector | None = None
        self._status, self._success, self._duration = STARTING, None, None
        self._families: list[Metric] = []
        self._tls: dict = {}
        self._last_success_time: float | None = None
        self._error: str | None = None
        self._failures = self._updates = 0
        self._cpu_seconds = 0.0    # CPU time of this collector's updates (its thread's clock), all updates
        self._in_flight_since: float | None = None   # monotonic start of the update now running
        self._hang_logged = False

    # ------------------------------------------------------------------------------------- thread

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"collector-{self.name}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        next_due = time.monotonic()
        while not self._stop.is_set():
            if not self._run_once():
                return
            now = time.monotonic()
            # Fixed rate; ticks missed by a slow update are skipped, not made up in a burst.
            next_due = max(next_due + self.interval, now)
            if self._stop.wait(next_due - now):
                return

    def _run_once(self) -> bool:
        """One update; False when the collector disabled itself."""
        started, cpu_started = time.monotonic(), time.thread_time()
        with self._lock:
            self._in_flight_since = started
        sample, error = None, None
        try:
            if self.collector is None:
                self.collector = self._cls(self._ctx)
            sample = self.collector.update()
            if not isinstance(sample, Sample):
                sample, error = None, f"update() returned {type(sample).__name__}, not a Sample"
        except CollectorDisabled as exc:
            self._disable(str(exc))
            return False
        except Exception as exc:  # a collector's failure is reported, never propagated
            error = f"{type(exc).__name__}: {exc}"
        finally:
            self._cpu_seconds += time.thread_time() - cpu_started
        self._finish(started, sample, error)
        return True

    def _finish(self, started: float, sample: Sample | None, error: str | None) -> None:
        duration = time.monotonic() - started
        if sample is not None and duration > self.timeout:
            sample, error = None, f"update took {duration:.2f}s, over its {self.timeout:g}s timeout"
        with self._lock:
            was = self._status
            self._in_flight_since = None
            self._duration, self._updates = duration, self._updates + 1
            if sample is not None:
                self._status, self._success, self._error = OK, True, None
                self._families, self._tls = sample.families, sample.tls
                self._last_success_time = time.time()
            else:
                self._status, self._success, self._error = FAILED, False, error
                self._families, self._tls = [], {}
                self._failures += 1
            self._hang_logged = False
        # Log transitions only: a collector failing every second must not flood the log.
        if sample is None and was != FAILED:
            self._log.warning("collector failed", error=error, duration_seconds=round(duration, 4))
        elif sample is not None and was in (FAILED, HUNG):
            self._log.info("collector recovered", duration_seconds=round(duration, 4))

    def _disable(self, reason: str) -> None:
        with self._lock:
            self._status, self._success, self._error = DISABLED, None, reason
            self._in_flight_since = None
            self._families, self._tls = [], {}
        self._log.warning(f"collector disabled: {reason}")

    # ------------------------------------------------------------------------------------- reads

    def view(self, now: float | None = None) -> View:
        now = time.monotonic() if now is None else now
        with self._lock:
            status, success, duration = self._status, self._success, self._duration
            families, tls = self._families, self._tls
            running_for = None if self._in_flight_since is None else now - self._in_flight_since
            if running_for is not None and running_for > self.timeout:
                status, success, duration, families, tls = HUNG, False, running_for, [], {}
                if not self._hang_logged:
                    self._hang_logged = True
                    self._log.warning("collector hung", running_seconds=round(running_for, 2),
                                      timeout_seconds=self.timeout)
            return View(self.name, status, success, duration, families, tls, self._last_success_time,
                        self._error if status != HUNG else f"update running for {running_for:.1f}s, "
                        f"over its {self.timeout:g}s timeout", self._failures, self._updates,
                        self.interval, self.timeout, self._cpu_seconds)

    def request_stop(self) -> None:
        self._stop.set()

    def stop(self, timeout: float) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is not None and self._thread.is_alive():
            # Hung inside update(): closing under it could crash a driver; the daemon thread dies with us.
            self._log.warning("collector still running at shutdown; left behind")
            return
        if self.collector is not None:
            try:
                self.collector.close()
            except Exception as exc:
                self._log.warning("collector close failed", error=f"{type(exc).__name__}: {exc}")


def choose_policy(config: AgentConfig):
    """The agent's policy: from its own config (``policy:``, ``--policy``), else the run's RUN/policy.yaml
    when rank 0's signature on it checks with the run's checkpoint key (``webhook.checkpoint_key_file``),
    else the defaults (trainguard/runpolicy.py): a policy file anyone dropped into the run decides nothing.
    A bad given policy file raises PolicyError, as before."""
    from trainguard import runpolicy
    from trainguard.runtime import cordon_key

    if config.policy is not None or config.run_dir is None:
        return runpolicy.choose(config.run_dir, config.policy, None)
    key, where = cordon_key.signing_key(checkpoint_key_file(config))
    return runpolicy.choose(config.run_dir, None, key, where)


def checkpoint_key_file(config: AgentConfig) -> str | None:
    """``webhook.checkpoint_key_file`` as given (checked by agent/executor.py WebhookSettings), else None:
    the trainer's default place."""
    key_file = (config.webhook or {}).get("checkpoint_key_file")
    return key_file if isinstance(key_file, str) and key_file.strip() else None


class Agent:
    """The enabled collectors, their runners, and the private registry /metrics serves."""

    def __init__(self, config: AgentConfig, registry: Mapping[str, type[Collector]] | None = None,
                 coexist: Coexistence | None = None):
        self.config = config
        self.coexist = coexist or Coexistence("off")      # the families a peer exporter serves are left out
        self.started_at = time.time()
        self._log = tglog.get("agent", node=config.node)
        self._sources: list[Callable[[], Iterable[Metric]]] = []
        self._decision_handlers: list[Callable] = []
        self._health_sources: dict[str, Callable[[], dict]] = {}
        self._duplicates_logged: set[str] = set()   # family names seen twice (dropped), logged once each
        self.policy_choice = choose_policy(config)
        self._log.info("policy", used=self.policy_choice.describe())
        self.runners = self._build_runners(dict(REGISTRY if registry is None else registry))
        self._collector_labels = {name: DURATION.labels(name) for name in self.runners}   # {collector="..."}
        self._info = _agent_info(config)     # the same object every scrape: rendered once
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_CachedExposition(self))
        self.registry.register(ProcessCollector(registry=None))

    def _build_runners(self, classes: dict[str, type[Collector]]) -> dict[str, CollectorRunner]:
        runners = {}
        for name in sorted(classes):
            cls = classes[name]
            if not self.config.is_enabled(name, cls.default_enabled):
                continue
            settings = self.config.collector(name)
            ctx = Context(procfs=self.config.procfs, sysfs=self.config.sysfs, devfs=self.config.devfs,
                          run_dir=self.config.run_dir, node=self.config.node, options=dict(settings.options),
                          policy=self.policy_choice.policy, on_decision=self._dispatch_decision,
                          checkpoint_key_file=checkpoint_key_file(self.config))
            runners[name] = CollectorRunner(cls, ctx, self.config.interval_of(name, cls.interval),
                                            self.config.timeout_of(name, cls.timeout))
        return runners

    # ---------------------------------------------------------------------------------- lifecycle

    def start(self) -> "Agent":
        from trainguard.agent import collectors as loaded

        for module, reason in sorted(getattr(loaded, "UNAVAILABLE", {}).items()):
            self._log.warning(f"collector module {module} unavailable: {reason}")
        for runner in self.runners.values():
            runner.start()
        self._log.info("agent started", collectors=sorted(self.runners), version=trainguard.__version__)
        return self

    def stop(self, timeout: float = 2.0) -> None:
        deadline = time.monotonic() + timeout
        for runner in self.runners.values():
            runner.request_stop()   # all at once, so they wind down together
        for runner in self.runners.values():
            runner.stop(max(0.0, deadline - time.monotonic()))

    @property
    def check_interval(self) -> float:
        """How often to `check()`: a hang shows only once an update outlives its timeout, so twice per shortest
        timeout finds it in time, and an idle agent does not wake for nothing."""
        shortest = min((runner.timeout for runner in self.runners.values()), default=2.0)
        return min(5.0, max(1.0, shortest / 2))

    def check(self) -> list[View]:
        """Views of every collector now (also logs a newly hung one); call it every `check_interval` seconds."""
        now = time.monotonic()
        return [runner.view(now) for runner in self.runners.values()]

    # -------------------------------------------------------------------------------------- hooks

    def add_metrics_source(self, source: Callable[[], Iterable[Metric]]) -> None:
        """Add families computed on each scrape from state the caller already holds (cheap, non-blocking)."""
        self._sources.append(source)

    def add_health_source(self, name: str, source: Callable[[], dict]) -> None:
        """Add a section `name` to /healthz, computed on each request (cheap, non-blocking)."""
        self._health_sources[name] = source

    def add_decision_handler(self, handler: Callable) -> None:
        """Called with each decision the agent's own state machines make (e.g. the cost meter's cost_warn)."""
        self._decision_handlers.append(handler)

    def _dispatch_decision(self, decision) -> None:
        if not self._decision_handlers:
            self._log.info("decision (no handler attached)", action=getattr(decision, "action", decision))
        for handler in self._decision_handlers:
            try:
                handler(decision)
            except Exception as exc:
                self._log.error("decision handler failed", error=f"{type(exc).__name__}: {exc}")

    def tls_fragments(self) -> dict[str, dict]:
        """Each healthy collector's latest TLS fragment, by collector name."""
        return {view.name: view.tls for view in self.check() if view.tls}

    def health(self) -> dict:
        from trainguard.agent import collectors as loaded

        views = self.check()
        return {"status": "ok", "node": self.config.node, "version": trainguard.__version__,
                "uptime_seconds": round(time.time() - self.started_at, 3),
                "collectors": {view.name: view.to_dict() for view in views},
                "unavailable": dict(getattr(loaded, "UNAVAILABLE", {})),
                **{name: source() for name, source in self._health_sources.items()}}

    # ----------------------------------------------------------------------------------- exposition

    def families(self) -> Iterable[Metric]:
        """Every family a scrape serves; a name exported twice is served once (the first) and logged once."""
        views = self.check()
        seen: set[str] = set()
        for origin, family in self._all_families(views):
            if self.coexist.left_out_family(family):
                continue
            if family.name in seen:
                if family.name not in self._duplicates_logged:
                    self._duplicates_logged.add(family.name)
                    self._log.error("metric family exported twice; dropped", metric=family.name, source=origin)
                continue
            seen.add(family.name)
            yield family

    def _all_families(self, views: list[View]) -> Iterable[tuple[str, Metric]]:
        for view in views:
            for family in view.families:
                yield view.name, family
        for family in _scrape_families(views, self._collector_labels):
            yield "agent", family
        yield "agent", self._info
        for source in self._sources:
            try:
                families = list(source())
            except Exception as exc:
                self._log.error("metrics source failed", error=f"{type(exc).__name__}: {exc}")
                continue
            for family in families:
                yield getattr(source, "__qualname__", "source"), family


class _CachedExposition:
    """client_python's custom-collector pattern: families from state already held, nothing read on scrape."""

    def __init__(self, agent: Agent):
        self._agent = agent

    def describe(self) -> list:
        return []  # the set of names changes with what collectors find; nothing to check at registration

    def collect(self) -> Iterable[Metric]:
        return self._agent.families()


# node_exporter's per-collector duration and success, plus when each last succeeded (label: collector)
DURATION = Spec("gauge", "trainguard_scrape_collector_duration_seconds",
                "Duration of the collector's last update (of the one in flight when hung).", ["collector"])
SUCCESS = Spec("gauge", "trainguard_scrape_collector_success",
               "Whether the collector's last update succeeded (0 when failed or hung).", ["collector"])
LAST_SUCCESS = Spec("gauge", "trainguard_collector_last_success_timestamp_seconds",
                    "Unix time of the collector's last successful update.", ["collector"])
FAILURES = Spec("counter", "trainguard_collector_failures", "Failed or timed-out updates of the collector.",
                ["collector"])
CPU = Spec("counter", "trainguard_collector_cpu_seconds",
           "CPU time the collector's updates used (what sampling costs the node).", ["collector"])
DISABLED_FLAG = Spec("gauge", "trainguard_collector_disabled",
                     "1 when the collector disabled itself (it cannot run here; see /healthz).", ["collector"])


def _scrape_families(views: list[View], labels: Mapping[str, Labels]) -> list[Metric]:
    """The families above for these views; `labels[name]` is the collector's label set."""
    duration, success, last, failures, cpu, disabled = [], [], [], [], [], []
    for view in views:
        collector = labels[view.name]
        if view.status == DISABLED:
            disabled.append((collector, 1))
            continue
        if view.success is None:  # first update not finished yet
            continue
        duration.append((collector, view.duration))
        success.append((collector, 1 if view.success else 0))
        failures.append((collector, view.failures))
        cpu.append((collector, view.cpu_seconds))
        if view.last_success_time is not None:
            last.append((collector, view.last_success_time))
    return [DURATION.family(duration), SUCCESS.family(success), LAST_SUCCESS.family(last),
            FAILURES.family(failures), CPU.family(cpu), DISABLED_FLAG.family(disabled)]


def _agent_info(config: AgentConfig) -> Metric:
    info = InfoMetricFamily("trainguard_agent", "The trainguard agent's build and where it runs.")
    info.add_metric([], {"version": trainguard.__version__, "python": platform.python_version(),
                         "node": config.node})
    return info
