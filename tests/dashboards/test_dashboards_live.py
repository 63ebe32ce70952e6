"""Every dashboard query returns data after a real training run scraped by a real Prometheus.

No Grafana runs here (there is no installable server); instead the test does what Grafana would: it
resolves each dashboard variable through Prometheus's API, substitutes it into every panel and
annotation query, and runs them over the run's time range (as Grafana's range queries; instant ones as
instant queries). A query without data fails the test unless the generator marks it conditional
(`only_when`: event-only or hardware-only) with its reason; those must still run without error.

The trainer (two ranks through torch's elastic launcher, gloo), the agent (with the fake NVML, the one
allowed fake, and the InfiniBand sysfs fixture) and Prometheus (with alerts/*.rules.yml loaded) are all
real processes on loopback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlencode

import pytest
import yaml

from tests.dashboards.promql import substitute
from tests.servers import free_port, http_get, prometheus_query, start, start_prometheus, wait_for
from trainguard.dashboards import build

REPO = Path(__file__).resolve().parents[2]
TRAINGUARD = [sys.executable, "-m", "trainguard.cli"]
STEPS = 150
# Two bursts of three NaN steps: each burst is two skipped steps, then a rollback to the last checkpoint
# (a checkpoint restored), so every guard annotation has events, each kind more than once. The bursts are
# further apart than the guard's rollback_window (50 steps), so the second is judged on its own; the run
# goes on for 45 steps after it, seconds of samples for every rate.
FAULTS = ("nan@35", "nan@37", "nan@39", "nan@100", "nan@102", "nan@104")
pytestmark = [pytest.mark.servers, pytest.mark.slow]


def _agent_config(tmp_path: Path) -> Path:
    config = {"interval": 1, "collectors": {"gpu": {"enabled": True, "nvml_module": "tests.fakes.fake_nvml"},
                                            "ib": {"enabled": True}}}
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _range(url: str, expr: str, start: float, end: float) -> list[dict]:
    query = urlencode({"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": "1"})
    status, _, body = http_get(f"{url}/api/v1/query_range?{query}", timeout=30)
    payload = json.loads(body)
    if status != 200 or payload.get("status") != "success":
        raise AssertionError(f"query failed ({status}): {expr}\n{payload}")
    return payload["data"]["result"]


def _label_values(url: str, query: str, values: dict[str, str]) -> list[str]:
    """Grafana's label_values(metric{...}, label) through /api/v1/series."""
    inner = query[len("label_values("):-1]
    selector, label = (part.strip() for part in inner.rsplit(",", 1))
    status, _, body = http_get(f"{url}/api/v1/series?{urlencode({'match[]': substitute(selector, values)})}")
    assert status == 200, body
    return sorted({series[label] for series in json.loads(body)["data"] if label in series})


@pytest.fixture(scope="module")
def scraped_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("live")
    run_dir = tmp_path / "run"
    port = free_port()
    env = {**os.environ, "TRAINGUARD_FAKE_NVML": "h100x8", "PYTHONPATH": str(REPO)}
    agent = start(TRAINGUARD + ["agent", "--create", "--run-dir", str(run_dir), "--listen", f"127.0.0.1:{port}",
                                "--config", str(_agent_config(tmp_path)), "--node", "testnode",
                                "--sysfs", str(REPO / "tests" / "fixtures" / "sys")],
                  url=f"http://127.0.0.1:{port}", ready_url=f"http://127.0.0.1:{port}/metrics",
                  log_path=tmp_path / "agent.log", env=env, cwd=REPO, timeout=60)
    rules = sorted((REPO / "alerts").glob("*.rules.yml"))
    prometheus = start_prometheus(tmp_path, [f"127.0.0.1:{port}"], rule_files=rules)
    started = time.time()
    try:
        inject = [arg for fault in FAULTS for arg in ("--inject", fault)]
        train = subprocess.run(TRAINGUARD + ["train", "--run-dir", str(run_dir), "--steps", str(STEPS),
                                             "--nproc", "2", "--checkpoint-every", "25", *inject,
                                             # a CPU has no documented peak, so MFU exists only with one given
                                             "--peak-flops", "1e11"],
                               capture_output=True, text=True, timeout=240, cwd=REPO, env=env)
        assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-4000:]
        wait_for(lambda: prometheus_query(prometheus, f"max(trainguard_training_step) >= {STEPS}"), timeout=60,
                 message="Prometheus scraping the last step")
        time.sleep(5)   # a few more scrapes, so rates over the last samples have two points
        yield prometheus, started, time.time()
    finally:
        prometheus.stop()
        agent.stop()


def _variables(url: str, board: build.Board) -> dict[str, str]:
    """Each variable resolved as Grafana would, chained in order; the test uses all its values."""
    values = {"datasource": "prometheus"}
    for variable in board.variables:
        if variable.name == "datasource":
            continue
        found = _label_values(url, variable.query, values)
        assert found, f"{board.uid}: variable ${variable.name} ({variable.query}) has no values"
        values[variable.name] = "|".join(found) if len(found) > 1 else found[0]
        values[variable.name] = f"({values[variable.name]})" if len(found) > 1 else values[variable.name]
    return values


def test_every_panel_query_returns_data(scraped_run):
    url, start_time, end_time = scraped_run
    missing, checked, only_when = [], 0, []
    for board in build.boards().values():
        values = _variables(url, board)
        queries = [(panel.title, query) for panel in board.panels() for query in panel.queries]
        queries += [(f"annotation: {a.name}", build.Query(a.expr, "", a.only_when)) for a in board.annotations]
        for title, query in queries:
            expr = substitute(query.expr, values)
            if query.instant:
                result = prometheus_query(url, expr)
            else:
                result = _range(url, expr, start_time, end_time)
            checked += 1
            if query.only_when:
                only_when.append((board.uid, title))
            elif not result:
                missing.append(f"{board.uid} / {title}: {expr}")
    assert not missing, f"{len(missing)} of {checked} queries returned no data:\n" + "\n".join(missing)
    assert checked > 60 and len(only_when) < checked / 5


def test_guard_events_of_the_run_reach_the_annotations(scraped_run):
    # The annotations marked conditional do have data when their event happened in the run.
    url, start_time, end_time = scraped_run
    board = build.boards()["training.json"]
    values = _variables(url, board)
    for name in ("Checkpoints", "Skipped steps", "Rollbacks", "Restores"):
        annotation = next(a for a in board.annotations if a.name == name)
        assert _range(url, substitute(annotation.expr, values), start_time, end_time), name
