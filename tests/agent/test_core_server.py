"""The HTTP server: /metrics (text, OpenMetrics, gzip) checked by the real promtool and scraped by a real
Prometheus, /healthz, and the route table the webhook plugs into (with its body limits)."""

from __future__ import annotations

import gzip
import http.client
import json
import math

import pytest

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

from tests.servers import (agent_server, http_get, prometheus_query, promtool_check_metrics, start_prometheus,
                           wait_for)
from trainguard import tls
from trainguard.agent.collector import Collector, Sample
from trainguard.agent.server import AgentServer, json_response

FIXTURES = __import__("pathlib").Path(__file__).resolve().parents[1] / "fixtures"


def write_run(run_dir):
    """A small run: two ranks' steps (one NaN loss), a checkpoint event, a malformed line."""
    for rank in (0, 1):
        with tls.Writer(run_dir / "tls" / f"rank-{rank}.jsonl") as writer:
            for step in range(1, 4):
                writer.write(tls.make_record(step=step, timestamp=1_700_000_000 + step, run_id="exp", rank=rank,
                                             metrics={"loss": 2.0 / step if step < 3 else math.nan,
                                                      "grad_norm": 0.5, "learning_rate": 1e-4,
                                                      "tokens_per_second": 1000.0, "step_time_seconds": 0.1,
                                                      "data_wait_seconds": 0.01, "comm_seconds": 0.02, "mfu": 0.4,
                                                      "tokens_trained": 1024 * step, "tokens_loaded": 1100 * step},
                                             system={"gpu_count": 2}))
            writer.write(tls.make_record(step=3, timestamp=1_700_000_004, run_id="exp", rank=rank,
                                         event={"type": "checkpoint_saved", "step": 3}))
    with open(run_dir / "tls" / "rank-1.jsonl", "ab") as handle:
        handle.write(b'{"timestamp": "yesterday"}\n')


def full_agent(tmp_path, only=None):
    run_dir = tmp_path / "run"
    write_run(run_dir)
    return agent_server(run_dir=run_dir, procfs=FIXTURES / "proc", sysfs=FIXTURES / "sys", interval=0.2,
                        node="node-a", only=only)


def all_succeeded(agent) -> bool:
    collectors = agent.health()["collectors"]
    return all(c["status"] in ("ok", "disabled") for c in collectors.values())


@pytest.mark.parametrize("only", [("host", "training"), None], ids=["core-collectors", "every-collector"])
def test_promtool_accepts_the_whole_exposition(tmp_path, only):
    with full_agent(tmp_path, only) as (agent, url):
        wait_for(lambda: all_succeeded(agent), 20, message="every collector updated")
        status, headers, body = http_get(url + "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    text = body.decode()
    assert 'trainguard_training_loss{rank="1",run_id="exp"} NaN' in text
    assert 'trainguard_tls_malformed_lines_total{file="rank-1.jsonl"} 1.0' in text
    assert "trainguard_agent_info{" in text and "node_load1 12.34" in text
    result = promtool_check_metrics(body)
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


def test_openmetrics_when_asked_and_gzip_when_accepted(tmp_path):
    with full_agent(tmp_path) as (agent, url):
        wait_for(lambda: all_succeeded(agent), 20, message="every collector updated")
        status, headers, body = http_get(url + "/metrics", headers={
            "Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5",
            "Accept-Encoding": "gzip"})
    assert status == 200
    assert headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
    assert headers["Content-Encoding"] == "gzip"
    text = gzip.decompress(body).decode()
    assert text.endswith("# EOF\n")
    families = {family.name: family for family in parse_openmetrics(text)}
    assert families["trainguard_training_steps"].type == "counter"
    assert families["trainguard_agent"].type == "info"
    steps = {s.labels["rank"]: s.value for s in families["trainguard_training_steps"].samples
             if s.name.endswith("_total")}
    assert steps == {"0": 3, "1": 3}


def test_a_compressed_body_is_reused_for_the_same_body_only():
    server = AgentServer(None, "127.0.0.1", 0)
    try:
        first = server._gzip(b"a 1.0\n")
        assert server._gzip(b"a 1.0\n") is first
        assert gzip.decompress(server._gzip(b"a 2.0\n")) == b"a 2.0\n"
        assert gzip.decompress(server._gzip(b"a 1.0\n")) == b"a 1.0\n"
    finally:
        server.stop()


def test_healthz_reports_every_collector(tmp_path):
    with full_agent(tmp_path) as (agent, url):
        wait_for(lambda: all_succeeded(agent), 20, message="every collector updated")
        status, headers, body = http_get(url + "/healthz")
    health = json.loads(body)
    assert status == 200 and headers["Content-Type"] == "application/json"
    assert health["status"] == "ok" and health["node"] == "node-a"
    assert health["collectors"]["training"]["status"] == "ok"
    assert health["collectors"]["host"]["success"] is True
    assert set(health["collectors"]) == set(agent.runners)


def request(url: str, method: str, path: str, body: bytes | None = None, headers=None):
    host, port = url.split("//")[1].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def test_routes_added_by_others_get_the_body_within_limits():
    received = []

    def alerts(req):
        received.append((req.method, req.path, req.query, req.headers.get("authorization"), req.json()))
        return json_response(202, {"accepted": len(req.json()["alerts"])})

    def broken(req):
        raise RuntimeError("bug")

    server = AgentServer(None, "127.0.0.1", 0, max_body_bytes=1024)
    server.add_route("POST", "/api/v1/alerts", alerts)
    server.add_route("GET", "/broken", broken)
    server.start()
    try:
        payload = json.dumps({"alerts": [{"labels": {"alertname": "LossNaN"}}]}).encode()
        status, headers, body = request(server.url, "POST", "/api/v1/alerts?dry=1", payload,
                                        {"Authorization": "Bearer t", "Content-Type": "application/json"})
        assert (status, json.loads(body)) == (202, {"accepted": 1})
        assert received == [("POST", "/api/v1/alerts", {"dry": ["1"]}, "Bearer t",
                             {"alerts": [{"labels": {"alertname": "LossNaN"}}]})]
        status, _, body = request(server.url, "POST", "/api/v1/alerts", b"x" * 2048)
        assert status == 413 and b"over the limit of 1024" in body
        assert request(server.url, "GET", "/api/v1/alerts")[0] == 405
        assert request(server.url, "GET", "/api/v1/alerts")[1]["Allow"] == "POST"
        assert request(server.url, "GET", "/nowhere")[0] == 404
        assert request(server.url, "GET", "/broken")[0] == 500
        assert len(received) == 1
        try:
            server.add_route("POST", "/api/v1/alerts", alerts)
            raise AssertionError("a route cannot be taken twice")
        except ValueError:
            pass
    finally:
        server.stop()


def test_a_body_without_content_length_is_refused():
    server = AgentServer(None, "127.0.0.1", 0).start()
    server.add_route("POST", "/in", lambda req: (200, {}, b"ok"))
    try:
        host, port = server.address
        connection = http.client.HTTPConnection(host, port, timeout=10)
        connection.putrequest("POST", "/in")
        connection.putheader("Transfer-Encoding", "chunked")
        connection.endheaders()
        connection.send(b"2\r\nhi\r\n0\r\n\r\n")
        assert connection.getresponse().status == 411
        connection.close()
    finally:
        server.stop()


class Numbers(Collector):
    name, interval = "numbers", 0.2

    def update(self):
        return Sample([GaugeMetricFamily("test_numbers_value", "A number.", value=3)])


def test_a_real_prometheus_scrapes_the_agent(tmp_path):
    with agent_server(registry={"numbers": Numbers}) as (agent, url):
        target = url.split("//")[1]
        with start_prometheus(tmp_path, [target]) as prometheus:
            found = wait_for(lambda: prometheus_query(prometheus, 'test_numbers_value{job="trainguard"}'), 30,
                             message="Prometheus scraped the agent")
            assert float(found[0]["value"][1]) == 3
            up = prometheus_query(prometheus, "trainguard_scrape_collector_success")
            assert up[0]["metric"]["collector"] == "numbers" and float(up[0]["value"][1]) == 1
            # Prometheus asks for OpenMetrics first; what it got is checked by its own parser above.
            health = prometheus_query(prometheus, "up")
            assert float(health[0]["value"][1]) == 1


def test_connections_are_served_by_a_pool_of_workers():
    """A worker outlives its connection and serves the next one; connections at once get a worker each."""
    server = AgentServer(None, "127.0.0.1", 0, max_connections=4).start()
    server.add_route("GET", "/ping", lambda req: (200, {}, b"pong"))
    try:
        host, port = server.address
        for _ in range(5):                                  # one after another: one worker, reused
            assert request(server.url, "GET", "/ping")[2] == b"pong"
            wait_for(lambda: server.httpd._idle == 1, 10, message="the worker waits for the next connection")
        assert server.httpd._workers == 1
        held = [http.client.HTTPConnection(host, port, timeout=10) for _ in range(3)]
        for connection in held:                             # kept alive at once: a worker each
            connection.request("GET", "/ping")
            assert connection.getresponse().read() == b"pong"
        assert server.httpd._workers == 3 and server.httpd._idle == 0
        for connection in held:
            connection.close()
        wait_for(lambda: server.httpd._idle == 3, 10, message="workers back in the pool")
    finally:
        server.stop()


def test_connections_beyond_the_limit_get_503():
    server = AgentServer(None, "127.0.0.1", 0, max_connections=1).start()
    server.add_route("GET", "/ping", lambda req: (200, {}, b"pong"))
    try:
        host, port = server.address
        first = http.client.HTTPConnection(host, port, timeout=10)
        first.request("GET", "/ping")
        assert first.getresponse().read() == b"pong"      # kept alive: it holds the one slot
        second = http.client.HTTPConnection(host, port, timeout=10)
        second.request("GET", "/ping")
        assert second.getresponse().status == 503
        second.close()
        first.request("GET", "/ping")                       # the first connection is still served
        assert first.getresponse().read() == b"pong"
        first.close()
        wait_for(lambda: request(server.url, "GET", "/ping")[0] == 200, 10, message="slot freed")
    finally:
        server.stop()


def test_sixteen_slow_clients_lock_out_neither_healthz_nor_the_webhook_and_are_cut_at_the_deadline():
    """One byte every second per connection: a per-read timeout never fires; the
    whole-request deadline does, and the loopback slot kept for /healthz and the webhook stays usable."""
    import socket
    import threading
    import time

    server = AgentServer(None, "127.0.0.1", 0, max_connections=16, request_timeout=3.0, read_timeout=10.0).start()
    server.add_route("GET", "/healthz", lambda req: (200, {}, b"ok"))
    server.add_route("POST", "/api/v1/alerts", lambda req: (200, {}, b"alert"))
    server.add_route("GET", "/metrics", lambda req: (200, {}, b"m"))
    host, port = server.address
    stop = threading.Event()
    cut_after: list[float] = []

    def trickle():
        sock = socket.create_connection((host, port), timeout=30)
        started = time.monotonic()
        try:
            for byte in b"GET /metrics HTTP/1.1\r\nHost: x\r\n" * 10:
                if stop.is_set():
                    return
                sock.sendall(bytes([byte]))
                time.sleep(1.0)
        except OSError:
            cut_after.append(time.monotonic() - started)       # the server closed it
        finally:
            sock.close()

    slow = [threading.Thread(target=trickle, daemon=True) for _ in range(16)]
    try:
        for thread in slow:
            thread.start()
        wait_for(lambda: server.httpd._workers >= 16, 10, message="the slow clients hold every general slot")
        assert request(server.url, "GET", "/healthz")[2] == b"ok"
        # one slot is kept: the next request may have to wait until the server has seen the last one close
        wait_for(lambda: request(server.url, "POST", "/api/v1/alerts", b"{}")[2] == b"alert", 5,
                 message="the kept slot serves the webhook")
        assert request(server.url, "GET", "/metrics")[0] == 503          # the kept slot serves only those two
        wait_for(lambda: len(cut_after) == 16, 30, message="every slow client cut at its deadline")
        assert max(cut_after) < 10
        assert request(server.url, "GET", "/metrics")[2] == b"m"          # the slots are free again
    finally:
        stop.set()
        server.stop()
