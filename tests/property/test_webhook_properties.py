"""The Alertmanager webhook on arbitrary and damaged payloads: a clear 4xx that executes nothing, or a
correct parse; never an unhandled exception, never an action.

The whole handler (token, size, content type, JSON, payload) is driven with an executor that records
what reaches it and decides with a shadow ledger; one test goes over real loopback HTTP to the agent's
server with the real executor in shadow and checks that the run's control channel is never written.
"""

from __future__ import annotations

import http.client
import json
import math
from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.property.conftest import examples
from tests.property.mutate import DEEP_ARRAY, DEEP_OBJECT, json_values, mutated_bytes, mutated_json
from trainguard import actions
from trainguard.agent.executor import Executor
from trainguard.agent.server import AgentServer
from trainguard.agent.webhook import PATH, STATUSES, PayloadError, Webhook, decode_json, parse_payload
from trainguard.decide.ledger import Ledger

TOKEN = b"property-token"
HEADERS = {"Authorization": "Bearer property-token", "Content-Type": "application/json"}
REFUSALS = {400, 401, 405, 413, 415, 422}
ALERTNAMES = ["LossNaN", "LossSpike", "GradNormExplosion", "TrainingStalled", "CostBudgetStop", "GPUOverheating"]


class RecordingExecutor:
    """Decides with a shadow ledger (nothing can execute) and keeps every batch it was handed."""

    def __init__(self):
        self.ledger = Ledger(shadow=True)
        self.batches: list[list] = []

    def submit(self, notices):
        self.batches.append(list(notices))
        verdicts = self.ledger.decide_all(notices, 1_700_000_000.0)
        assert not any(v.executes for v in verdicts)
        return verdicts


# ------------------------------------------------------------------------------------- valid payloads

@st.composite
def rfc3339(draw) -> tuple[str, float]:
    """A time as Alertmanager may write it (0 to 9 fraction digits, Z or an offset) and its Unix seconds."""
    moment = datetime(2020, 1, 1, tzinfo=timezone.utc) + timedelta(seconds=draw(st.integers(0, 10**9)))
    digits = draw(st.integers(0, 9))
    fraction = draw(st.integers(0, 10**digits - 1)) if digits else 0
    minutes = draw(st.sampled_from([0, 60, -300, 330, 765, -(23 * 60 + 59)]))
    zone = "Z" if minutes == 0 and draw(st.booleans()) else \
        f"{'+' if minutes >= 0 else '-'}{abs(minutes) // 60:02d}:{abs(minutes) % 60:02d}"
    local = moment.astimezone(timezone(timedelta(minutes=minutes)))
    text = local.strftime("%Y-%m-%dT%H:%M:%S") + (f".{fraction:0{digits}d}" if digits else "") + zone
    return text, moment.timestamp() + (fraction / 10**digits if digits else 0.0)


label_text = st.text(st.characters(blacklist_categories=["Cs"]), max_size=12)


@st.composite
def alerts(draw) -> tuple[dict, dict]:
    """(an alert as Alertmanager sends it, what the parsed notice must say)."""
    name = draw(st.sampled_from(ALERTNAMES))
    action = draw(st.sampled_from([None, *actions.REMOTE_ACTIONS]))
    status = draw(st.sampled_from(STATUSES))
    labels = {**draw(st.dictionaries(label_text, label_text, max_size=3)), "alertname": name}
    labels.pop("action", None)
    if action:
        labels["action"] = action
    starts, starts_at = draw(rfc3339())
    alert = {"status": status, "labels": labels, "annotations": draw(st.dictionaries(label_text, label_text,
                                                                                     max_size=2)),
             "startsAt": starts, "endsAt": draw(rfc3339())[0],
             "fingerprint": draw(st.from_regex(r"\A[0-9a-f]{16}\Z")), "generatorURL": "http://127.0.0.1:9090/"}
    return alert, {"alertname": name, "action": action, "status": status, "starts_at": starts_at}


@st.composite
def payloads(draw) -> tuple[dict, list[dict]]:
    pairs = draw(st.lists(alerts(), min_size=1, max_size=4))
    body = {"version": "4", "status": pairs[0][0]["status"], "receiver": "trainguard-agent",
            "groupKey": "{}:{}", "truncatedAlerts": 0, "groupLabels": {}, "commonLabels": {},
            "commonAnnotations": {}, "externalURL": "http://127.0.0.1:9093", "alerts": [a for a, _ in pairs]}
    return body, [expected for _, expected in pairs]


# -------------------------------------------------------------------------------------------- checks

def assert_sound(notice) -> None:
    assert isinstance(notice.alertname, str) and notice.alertname
    assert notice.status in STATUSES
    assert notice.action is None or notice.action in actions.REMOTE_ACTIONS
    assert isinstance(notice.starts_at, float) and math.isfinite(notice.starts_at)
    assert isinstance(notice.key, str) and "@" in notice.key
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in notice.labels.items())


def parse_or_error(document):
    try:
        notices = parse_payload(document)
    except PayloadError as error:
        assert isinstance(error.field, str) and error.field
        assert str(error).startswith(f"{error.field}: ")
        return error
    for notice in notices:
        assert_sound(notice)
    return notices


def strictly_json(body: bytes) -> bool:
    try:
        decode_json(body)
        return True
    except (ValueError, RecursionError):
        return False


def handle(body: bytes, headers: dict = HEADERS) -> tuple[int, dict, RecordingExecutor]:
    """The whole handler, as the server calls it; any exception fails the test."""
    executor = RecordingExecutor()
    hook = Webhook(TOKEN, executor, max_body_bytes=64 * 1024)
    status, response_headers, response = hook.handle("POST", PATH, headers, body)
    assert response_headers["Content-Type"] == "application/json"
    answer = json.loads(response)
    if status == 200:
        assert len(executor.batches) == 1
        notices = executor.batches[0]
        assert [n.key for n in notices] == [n.key for n in parse_payload(json.loads(body))]
        for notice in notices:
            assert_sound(notice)
        assert not any(v["shadow"] is False for v in answer["verdicts"])
    else:
        assert status in REFUSALS, (status, answer)
        assert executor.batches == [], "a refused request reached the executor"
        assert isinstance(answer["error"], str) and answer["error"]
        if status == 400:       # "not valid JSON" must be true of the body
            assert not strictly_json(body), answer
        if status == 422:
            assert answer["error"].startswith(answer["field"])
    return status, answer, executor


# --------------------------------------------------------------------------------------------- tests

@settings(max_examples=examples(150))
@given(st.one_of(json_values, st.dictionaries(
    st.sampled_from(["version", "status", "alerts", "receiver", "truncatedAlerts", "commonLabels"]),
    json_values, max_size=6)))
def test_arbitrary_json_is_notices_or_an_error_naming_the_field(document):
    parse_or_error(document)


@settings(max_examples=examples(80))
@given(payloads())
def test_valid_payloads_parse_to_their_alerts_and_reach_the_executor_once(pair):
    body, expected = pair
    status, answer, executor = handle(json.dumps(body).encode())
    assert status == 200, answer
    [notices] = executor.batches
    assert [(n.alertname, n.action, n.status) for n in notices] == [
        (e["alertname"], e["action"], e["status"]) for e in expected]
    for notice, wanted in zip(notices, expected):
        assert abs(notice.starts_at - wanted["starts_at"]) < 1e-6


@settings(max_examples=examples(200))
@given(st.data())
def test_mutated_payloads_are_refused_with_a_4xx_or_parse_and_never_act(data):
    body, _ = data.draw(payloads())
    if data.draw(st.booleans()):
        handle(json.dumps(data.draw(mutated_json(body))).encode())
    else:
        handle(data.draw(mutated_bytes(json.dumps(body).encode())))


OFFSET_OUT_OF_RANGE = json.dumps({"version": "4", "status": "firing", "alerts": [{
    "status": "firing", "labels": {"alertname": "LossSpike", "action": "rollback"}, "annotations": {},
    "startsAt": "2024-03-15T14:22:18+24:00", "endsAt": "0001-01-01T00:00:00Z", "fingerprint": "ab"}]}).encode()


@settings(max_examples=examples(200))
@given(st.binary(max_size=300))
@example(DEEP_ARRAY)
@example(DEEP_OBJECT)
@example(b"\xff\xfe")
@example(b'{"version": NaN}')
@example(OFFSET_OUT_OF_RANGE)      # a time zone offset out of range is a bad field (422), not "not JSON" (400)
def test_arbitrary_bytes_are_refused_with_a_4xx_and_never_act(data):
    handle(data)


header_values = st.one_of(st.none(), st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40))


@settings(max_examples=examples(80))
@given(st.fixed_dictionaries({}, optional={"Authorization": header_values, "Content-Type": header_values,
                                           "authorization": header_values, "content-type": header_values}),
       payloads())
def test_without_the_exact_token_and_content_type_nothing_reaches_the_executor(headers, pair):
    headers = {k: v for k, v in headers.items() if v is not None}
    status, _, executor = handle(json.dumps(pair[0]).encode(), headers)
    authorized = any(k.lower() == "authorization" and v.strip() == "Bearer property-token"
                     for k, v in headers.items())
    if not authorized:
        assert status == 401 and executor.batches == []


# --------------------------------------------------------------------------------- over real HTTP

@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """The agent's HTTP server with the webhook and the real executor in shadow, on a loopback port."""
    run_dir = tmp_path_factory.mktemp("webhook-run")
    executor = Executor(run_dir, "n1", Ledger(shadow=True))
    server = AgentServer(None, "127.0.0.1", 0, max_body_bytes=64 * 1024)
    server.add_route("POST", PATH, Webhook(TOKEN, executor, max_body_bytes=64 * 1024).route)
    server.start()
    yield server, executor, run_dir
    server.stop()


def post(server, body: bytes) -> int:
    host, port = server.address
    connection = http.client.HTTPConnection(host, port, timeout=10)
    try:
        connection.request("POST", PATH, body=body, headers=HEADERS)
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


@settings(max_examples=examples(40))
@given(st.data())
def test_over_http_nothing_is_ever_executed_on_the_run(live, data):
    server, executor, run_dir = live
    body, _ = data.draw(payloads())
    choice = data.draw(st.sampled_from(["valid", "mutated-json", "mutated-bytes", "bytes"]))
    if choice == "mutated-json":
        body = json.dumps(data.draw(mutated_json(body))).encode()
    elif choice == "mutated-bytes":
        body = data.draw(mutated_bytes(json.dumps(body).encode()))
    elif choice == "bytes":
        body = data.draw(st.binary(max_size=200))
    else:
        body = json.dumps(body).encode()
    status = post(server, body)
    assert status == 200 or status in REFUSALS, status
    assert not (run_dir / "control").exists(), "the shadow executor wrote a control request"
    assert executor.counts.executed == {}
