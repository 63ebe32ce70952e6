"""The runner: collectors in their own threads, timeouts, isolation, and the per-collector scrape metrics."""

from __future__ import annotations

import threading
import time

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from tests.servers import agent_server, http_get, wait_for
from trainguard.agent.collector import Collector, CollectorDisabled, Sample
from trainguard.agent.config import AgentConfig, CollectorConfig


def scrape(url: str) -> dict[tuple, float]:
    status, _, body = http_get(url + "/metrics", timeout=5)
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def make_collectors():
    """Fresh collector classes per test: steady, failing, hanging (until released), slow, disabled."""
    release = threading.Event()
    calls = {"hanging": 0, "disabled": 0}

    class Steady(Collector):
        name, interval = "steady", 0.05

        def update(self):
            return Sample([GaugeMetricFamily("test_steady_value", "A value.", value=42)], tls={"system": {"x": 1}})

    class Failing(Collector):
        name, interval = "failing", 0.05

        def update(self):
            raise RuntimeError("sensor unplugged")

    class Hanging(Collector):
        name, interval, timeout = "hanging", 0.05, 0.3

        def update(self):
            calls["hanging"] += 1
            release.wait(60)
            return Sample([GaugeMetricFamily("test_hanging_value", "Late.", value=1)])

    class Slow(Collector):
        name, interval, timeout = "slow", 0.05, 10.0

        def update(self):
            time.sleep(0.3)
            return Sample([GaugeMetricFamily("test_slow_value", "Slow but in time.", value=7)])

    class Disabled(Collector):
        name = "disabled"

        def update(self):
            calls["disabled"] += 1
            raise CollectorDisabled("no such device here")

    registry = {c.name: c for c in (Steady, Failing, Hanging, Slow, Disabled)}
    return registry, release, calls


def test_failing_and_hanging_collectors_do_not_touch_the_others():
    registry, release, calls = make_collectors()
    try:
        with agent_server(registry=registry) as (agent, url):
            wait_for(lambda: agent.health()["collectors"]["hanging"]["status"] == "hung", 10, message="hung")
            wait_for(lambda: agent.health()["collectors"]["slow"]["success"], 10, message="slow done")
            # The hanging update is still blocked: a scrape that waited on it would never return.
            samples = scrape(url)
            assert value(samples, "test_steady_value") == 42
            assert value(samples, "test_slow_value") == 7
            assert value(samples, "test_hanging_value") is None
            success = {c: value(samples, "trainguard_scrape_collector_success", collector=c)
                       for c in ("steady", "failing", "hanging", "slow")}
            assert success == {"steady": 1, "failing": 0, "hanging": 0, "slow": 1}
            assert value(samples, "trainguard_scrape_collector_duration_seconds", collector="slow") >= 0.3
            assert value(samples, "trainguard_scrape_collector_duration_seconds", collector="hanging") > 0.3
            assert value(samples, "trainguard_collector_failures_total", collector="failing") >= 1
            assert value(samples, "trainguard_collector_last_success_timestamp_seconds", collector="failing") is None
            assert value(samples, "trainguard_collector_last_success_timestamp_seconds",
                         collector="steady") <= time.time()
            assert value(samples, "trainguard_collector_disabled", collector="disabled") == 1
            assert value(samples, "trainguard_scrape_collector_success", collector="disabled") is None
            health = agent.health()["collectors"]
            assert health["failing"]["error"] == "RuntimeError: sensor unplugged"
            assert "over its 0.3s timeout" in health["hanging"]["error"]
            assert health["disabled"] == {**health["disabled"], "status": "disabled", "error": "no such device here"}
            # No next call while the hung one runs; a disabled collector is never called again.
            assert calls["hanging"] == 1
            assert calls["disabled"] == 1
            assert agent.tls_fragments() == {"steady": {"system": {"x": 1}}}
    finally:
        release.set()


def test_a_hung_update_that_returns_late_is_discarded_then_the_collector_recovers():
    registry, release, calls = make_collectors()
    hanging = {"hanging": registry["hanging"]}
    with agent_server(registry=hanging) as (agent, url):
        wait_for(lambda: agent.health()["collectors"]["hanging"]["status"] == "hung", 10, message="hung")
        assert agent.health()["collectors"]["hanging"]["updates"] == 0
        release.set()   # the late result arrives: counted as a failure, its metrics not served
        # Released, the next calls return at once and succeed.
        wait_for(lambda: agent.health()["collectors"]["hanging"]["status"] == "ok", 10, message="recovered")
        state = agent.health()["collectors"]["hanging"]
        assert state["failures"] == 1 and state["updates"] >= 2 and state["error"] is None
        samples = scrape(url)
        assert value(samples, "test_hanging_value") == 1
        assert value(samples, "trainguard_collector_failures_total", collector="hanging") == 1
        assert calls["hanging"] >= 2


def test_intervals_and_timeouts_come_from_the_config():
    registry, release, _ = make_collectors()
    config = AgentConfig(interval=0.2, collectors={"hanging": CollectorConfig(timeout=30.0),
                                                   "slow": CollectorConfig(enabled=False)})
    try:
        with agent_server(config, registry=registry) as (agent, _):
            runners = agent.runners
            assert "slow" not in runners
            assert runners["steady"].interval == 0.2
            assert runners["hanging"].timeout == 30.0 and runners["failing"].timeout == 10.0
    finally:
        release.set()


def test_the_agent_is_checked_for_hangs_twice_per_shortest_timeout():
    from trainguard.agent.runner import Agent

    registry, release, _ = make_collectors()
    release.set()
    agent = Agent(AgentConfig(), registry=registry)                       # "hanging" times out after 0.3 s
    assert agent.check_interval == 1.0                                     # but not more often than each second
    config = AgentConfig(collectors={name: CollectorConfig(timeout=6.0) for name in registry})
    assert Agent(config, registry=registry).check_interval == 3.0
    config = AgentConfig(collectors={name: CollectorConfig(timeout=60.0) for name in registry})
    assert Agent(config, registry=registry).check_interval == 5.0         # and at least every 5 s


def test_a_collector_that_returns_something_else_than_a_sample_is_failed():
    class Wrong(Collector):
        name, interval = "wrong", 0.05

        def update(self):
            return [GaugeMetricFamily("x", "y", value=1)]

    with agent_server(registry={"wrong": Wrong}) as (agent, _):
        wait_for(lambda: agent.health()["collectors"]["wrong"]["updates"], 10, message="update")
        assert agent.health()["collectors"]["wrong"]["error"] == "update() returned list, not a Sample"


def test_a_metric_exported_by_two_collectors_is_served_once():
    def exporting(name):
        class Twin(Collector):
            interval = 0.05

            def update(self):
                return Sample([GaugeMetricFamily("test_twin_value", "Twice.", value=1)])
        Twin.name = name
        return Twin

    with agent_server(registry={"a": exporting("a"), "b": exporting("b")}) as (agent, url):
        wait_for(lambda: all(c["success"] for c in agent.health()["collectors"].values()), 10, message="both")
        status, _, body = http_get(url + "/metrics")
        assert body.decode().count("# TYPE test_twin_value gauge") == 1


def test_a_stop_signal_wakes_every_sleeper_and_stays_set():
    from trainguard.agent.stop_signal import StopSignal

    stop = StopSignal()
    assert stop.wait(0) is False and stop.wait(0.01) is False and not stop.is_set()
    woken = []
    sleepers = [threading.Thread(target=lambda: woken.append(stop.wait(60))) for _ in range(3)]
    for sleeper in sleepers:
        sleeper.start()
    stop.set()
    stop.set()                                   # twice is harmless
    for sleeper in sleepers:
        sleeper.join(10)
    assert woken == [True, True, True] and stop.is_set() and stop.wait(60) is True and stop.wait() is True
