"""The fast /metrics encoder writes exactly what client_python's encoders write, in both formats."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client import exposition as text_format
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily,
                                    Metric, StateSetMetricFamily)
from prometheus_client.openmetrics import exposition as om_format
from prometheus_client.samples import Exemplar

from trainguard.metrics import exposition

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
ACCEPT_OPENMETRICS = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"


class Fixed:
    def __init__(self, families):
        self.families = families

    def collect(self):
        return list(self.families)


def registry_of(families) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Fixed(families))
    return registry


def awkward_families() -> list[Metric]:
    gauge = GaugeMetricFamily("test_gauge_bytes", 'Help with "quotes", a \\ and a\nnewline.', labels=["a", "b"])
    gauge.add_metric(['va"l\\ue\nx', "ünïcode"], 1.5)
    gauge.add_metric(["", "plain"], float("nan"))
    gauge.add_metric(["inf", "x"], float("inf"))
    counter = CounterMetricFamily("test_events", "Counted.", labels=["kind"])
    counter.add_metric(["a"], 3)
    counter_created = CounterMetricFamily("test_created", "With a created time.", labels=["k"], created=1.0)
    counter_created.add_metric(["x"], 1, created=1700000000.0)
    info = InfoMetricFamily("test_build", "Build info.")
    info.add_metric([], {"version": "1.2.3", "python": "3.11"})
    histogram = HistogramMetricFamily("test_latency_seconds", "A histogram.", labels=["op"])
    histogram.add_metric(["read"], [("0.1", 1), ("+Inf", 3)], sum_value=0.7)
    colon = GaugeMetricFamily("test:recorded", "A name with a colon.", value=1)
    with_unit = GaugeMetricFamily("test_sized_bytes", "With a unit.", value=2, unit="bytes")
    stateset = StateSetMetricFamily("test_state", "A state set.", value={"a": True, "b": False})
    exemplars = CounterMetricFamily("test_exemplified", "Has an exemplar.")
    exemplars.add_metric([], 1)
    exemplars.samples[0] = exemplars.samples[0]._replace(exemplar=Exemplar({"trace": "1"}, 1.0))
    untyped = Metric("test_untyped", "Unknown type.", "unknown")
    untyped.add_sample("test_untyped", {}, 4)
    return [gauge, counter, counter_created, info, histogram, colon, with_unit, stateset, exemplars, untyped]


@pytest.mark.parametrize("openmetrics", [False, True], ids=["text", "openmetrics"])
def test_awkward_families_match_client_python(openmetrics):
    families = awkward_families()
    if not openmetrics:
        families = [f for f in families if f.name != "test_exemplified"]   # text format has no exemplars
    library = om_format.generate_latest if openmetrics else text_format.generate_latest
    assert exposition.render(families, openmetrics) == library(registry_of(families))


def test_negotiation_matches_client_python():
    families = awkward_families()[:4]
    for accept in ("", "text/plain", ACCEPT_OPENMETRICS, "application/openmetrics-text; version=0.0.1",
                   "text/plain;version=1.0.0;escaping=allow-utf-8", "*/*"):
        encoder, content_type = text_format.choose_encoder(accept)
        assert exposition.encode(registry_of(families), accept) == (encoder(registry_of(families)), content_type)


def test_the_whole_agent_matches_client_python(tmp_path, monkeypatch):
    """Every collector, 8 fake GPUs, a training run: the real exposition in both formats."""
    from tests.agent.test_core_server import write_run
    from tests.servers import agent_server, wait_for

    monkeypatch.setenv("TRAINGUARD_FAKE_NVML", "h100x8")
    from trainguard.agent.config import AgentConfig, CollectorConfig

    run_dir = tmp_path / "run"
    write_run(run_dir)
    config = AgentConfig(run_dir=run_dir, procfs=FIXTURES / "proc", sysfs=FIXTURES / "sys", interval=0.2,
                         collectors={"gpu": CollectorConfig(options={"nvml_module": "tests.fakes.fake_nvml"})})
    with agent_server(config) as (agent, _):
        wait_for(lambda: all(c["updates"] for c in agent.health()["collectors"].values()), 20, message="updates")
        families = list(agent.registry.collect())
    names = {family.name for family in families}
    assert {"DCGM_FI_DEV_GPU_UTIL", "node_load1", "trainguard_training_loss"} <= names
    for openmetrics, library in ((False, text_format.generate_latest), (True, om_format.generate_latest)):
        assert exposition.render(families, openmetrics) == library(registry_of(families))


@pytest.mark.parametrize("openmetrics", [False, True], ids=["text", "openmetrics"])
def test_the_renderer_renders_again_only_what_changed(openmetrics, monkeypatch):
    def families(load: float, help_text: str = "Counted.") -> list[Metric]:
        made = [f for f in awkward_families() if openmetrics or f.name != "test_exemplified"]
        made.append(GaugeMetricFamily("test_load1", "Load.", value=load))
        made.append(CounterMetricFamily("test_changing_help", help_text, value=1))
        return made

    same, changed = families(0.5), families(0.75, "Counted again.")
    text_same, text_changed = exposition.render(same, openmetrics), exposition.render(changed, openmetrics)
    text_other = exposition.render(changed, not openmetrics)
    renderer = exposition.Renderer()
    assert renderer.render(families(0.5), openmetrics) == text_same
    rendered = []
    real = exposition._family_text
    monkeypatch.setattr(exposition, "_family_text", lambda family, *rest: rendered.append(family.name) or
                        real(family, *rest))
    # other objects, the same samples: not rendered again (but for a NaN sample: NaN equals nothing)
    assert renderer.render(same, openmetrics) == text_same
    assert rendered == ["test_gauge_bytes"]
    rendered.clear()
    assert renderer.render(changed, openmetrics) == text_changed   # a new value, a new help text: rendered
    assert rendered == ["test_gauge_bytes", "test_load1", "test_changing_help"]
    rendered.clear()
    assert renderer.render(changed, not openmetrics) == text_other  # each format keeps its own texts
    assert len(rendered) == len(changed)
