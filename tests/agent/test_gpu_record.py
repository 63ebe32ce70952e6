"""The NVML recorder (tests/fakes/record_nvml.py): what it records from an NVML replays to the same metrics.

No GPU here, so the recorder is pointed at the fake itself; on a GPU node `python -m tests.fakes.record_nvml`
points it at pynvml and writes a new scenario for tests/fakes/nvml/."""

from __future__ import annotations

import json

import pytest

from tests.agent.exposition import render
from tests.fakes.fake_nvml import FakeNVML
from tests.fakes.record_nvml import record
from trainguard.agent.collector import Context
from trainguard.agent.collectors.gpu import GPUCollector


def replay(nvml: FakeNVML, updates: int, tmp_path) -> list[str]:
    (tmp_path / "dev").mkdir(exist_ok=True)
    gpu = GPUCollector(Context(devfs=tmp_path / "dev", node="node-a", options={"nvml_module": nvml}))
    now = [1000.0]
    gpu.clock = lambda: now[0]
    out = []
    for number in range(updates):
        if number:
            nvml.advance()
            now[0] += 5.0
        out.append(render(gpu.update().families))
    return out


@pytest.mark.parametrize("scenario", ["h100x8", "xid"])
def test_recorded_scenario_replays_identically(scenario, tmp_path):
    source = FakeNVML(scenario)
    recorder = record(source, updates=3, interval=0, advance=source.advance)
    spec = json.loads(json.dumps(recorder.scenario("round trip of the fake")))     # as written to disk
    assert len(spec["devices"]) == len(FakeNVML(scenario).devices) and len(spec["devices"][0]["samples"]) == 3
    assert replay(FakeNVML(spec), 3, tmp_path) == replay(FakeNVML(scenario), 3, tmp_path)


def test_records_xid_events_and_init_errors():
    source = FakeNVML("xid")
    spec = record(source, updates=3, interval=0, advance=source.advance).scenario("x")
    assert [s.get("xid_events") for s in spec["devices"][0]["samples"]] == [None, [13], [13, 31]]
    spec = record(FakeNVML("no_gpu"), updates=1, interval=0).scenario("x")
    assert spec["init"] == {"error": "NVML_ERROR_LIBRARY_NOT_FOUND"} and spec["devices"] == []
