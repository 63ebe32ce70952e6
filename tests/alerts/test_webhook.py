"""The webhook: strict validation of Alertmanager's v4 payload, the token, and what reaches the executor."""

import json
import os
import threading

import pytest

from tests.alerts.helpers import alert, body, payload, read_jsonl
from trainguard.agent.executor import Executor
from trainguard.agent.webhook import PayloadError, Webhook, load_token, parse_payload, parse_time
from trainguard.decide.ledger import Ledger

TOKEN = b"s3cret-token"
GOOD_HEADERS = {"Authorization": "Bearer s3cret-token", "Content-Type": "application/json"}


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "run"


@pytest.fixture
def hook(run_dir):
    return Webhook(TOKEN, Executor(run_dir, "n1", Ledger()), max_body_bytes=64 * 1024)


def post(hook, data, headers=GOOD_HEADERS, raw: bytes | None = None):
    status, _, response = hook.handle("POST", "/api/v1/alerts", dict(headers), raw if raw is not None else body(data))
    return status, json.loads(response)


def control_requests(run_dir):
    return read_jsonl(run_dir / "control" / "actions.jsonl")


# ------------------------------------------------------------------------------------------- parsing

def test_a_real_alertmanager_payload_parses():
    notices = parse_payload(payload(alert(), alert("GPUOverheating", action=None, fingerprint="ff00")))
    assert [(n.alertname, n.status, n.action) for n in notices] == [
        ("LossSpike", "firing", "rollback"), ("GPUOverheating", "firing", None)]
    assert notices[0].key == "a1b2c3d4e5f60718@2024-03-15T14:22:18.123457Z"
    assert notices[0].labels["instance"] == "127.0.0.1:9655"


def test_alertmanager_times_parse_with_nanoseconds_and_offsets():
    assert parse_time("2024-03-15T14:22:18Z", "t") == 1710512538.0
    assert parse_time("2024-03-15T14:22:18.5+01:00", "t") == 1710512538.5 - 3600
    assert abs(parse_time("2024-03-15T14:22:18.123456789Z", "t") - 1710512538.123456789) < 1e-6
    assert parse_time("0001-01-01T00:00:00Z", "t") < 0


@pytest.mark.parametrize("mutate, field", [
    (lambda p: p.pop("version"), "version"),
    (lambda p: p.update(version="3"), "version"),
    (lambda p: p.update(version=4), "version"),
    (lambda p: p.update(status="pending"), "status"),
    (lambda p: p.pop("alerts"), "alerts"),
    (lambda p: p.update(alerts={}), "alerts"),
    (lambda p: p.update(truncatedAlerts=-1), "truncatedAlerts"),
    (lambda p: p.update(commonLabels={"a": 1}), "commonLabels.a"),
    (lambda p: p["alerts"].append("x"), "alerts[1]"),
    (lambda p: p["alerts"][0].pop("fingerprint"), "alerts[0].fingerprint"),
    (lambda p: p["alerts"][0].update(fingerprint="not hex!"), "alerts[0].fingerprint"),
    (lambda p: p["alerts"][0].update(status="firing!"), "alerts[0].status"),
    (lambda p: p["alerts"][0].update(startsAt="yesterday"), "alerts[0].startsAt"),
    (lambda p: p["alerts"][0].update(endsAt=0), "alerts[0].endsAt"),
    (lambda p: p["alerts"][0].pop("annotations"), "alerts[0].annotations"),
    (lambda p: p["alerts"][0]["labels"].pop("alertname"), "alerts[0].labels.alertname"),
    (lambda p: p["alerts"][0]["labels"].update(action="reboot"), "alerts[0].labels.action"),
    (lambda p: p["alerts"][0]["labels"].update(action="skip_step"), "alerts[0].labels.action"),
    (lambda p: p["alerts"][0]["labels"].update(severity=3), "alerts[0].labels.severity"),
])
def test_a_bad_field_is_named(mutate, field):
    data = payload(alert())
    mutate(data)
    with pytest.raises(PayloadError) as caught:
        parse_payload(data)
    assert caught.value.field == field


# ------------------------------------------------------------------------------------------- handler

def test_a_valid_alert_acts_and_is_recorded_before_the_reply(hook, run_dir):
    status, response = post(hook, payload(alert()))
    assert status == 200
    assert response["verdicts"] == [{"alertname": "LossSpike", "status": "firing", "outcome": "act",
                                     "action": "rollback", "shadow": False}]
    [request] = control_requests(run_dir)
    assert request["action"] == "rollback" and request["alertname"] == "LossSpike"
    assert set(request) == {"id", "action", "alertname", "reason", "issued_at", "run", "by", "key_id", "signature"}
    events = [r["event"] for r in read_jsonl(run_dir / "tls" / "node-n1-actions.jsonl")]
    assert [e["type"] for e in events] == ["alert", "action"]
    assert events[0]["request_id"] == events[1]["id"] == request["id"]
    assert events[1]["alertname"] == "LossSpike"


def test_repeats_from_alertmanager_act_once(hook, run_dir):
    for _ in range(3):
        assert post(hook, payload(alert()))[0] == 200
    assert len(control_requests(run_dir)) == 1


def test_resolved_never_acts(hook, run_dir):
    status, response = post(hook, payload(alert(status="resolved")))
    assert status == 200 and response["verdicts"][0]["outcome"] == "resolved"
    assert control_requests(run_dir) == []


@pytest.mark.parametrize("headers, expected", [
    ({"Content-Type": "application/json"}, 401),
    ({"Authorization": "Bearer wrong", "Content-Type": "application/json"}, 401),
    ({"Authorization": "Basic czNjcmV0LXRva2Vu", "Content-Type": "application/json"}, 401),
    ({"Authorization": "Bearer s3cret-token", "Content-Type": "text/plain"}, 415),
])
def test_refused_requests_execute_nothing(hook, run_dir, headers, expected):
    status, response = post(hook, payload(alert()), headers=headers)
    assert status == expected and response["error"]
    assert control_requests(run_dir) == []
    assert not (run_dir / "tls" / "node-n1-actions.jsonl").exists()


def test_bad_json_oversized_and_invalid_bodies_are_refused(hook, run_dir):
    assert post(hook, None, raw=b'{"version": "4", "alerts": [')[0] == 400
    assert post(hook, None, raw=b'{"version": "4", "x": NaN}')[0] == 400
    assert post(hook, None, raw=b"\xff\xfe")[0] == 400
    assert post(hook, None, raw=b" " * (64 * 1024 + 1))[0] == 413
    status, response = post(hook, payload(alert(), {"status": "firing"}))
    assert status == 422 and response["field"] == "alerts[1].labels"
    assert control_requests(run_dir) == []


def test_one_bad_alert_refuses_the_whole_payload(hook, run_dir):
    good, bad = alert(), alert("TrainingStalled", action="restart")
    assert post(hook, payload(good, bad))[0] == 422
    assert control_requests(run_dir) == []


def test_only_post_is_served(hook):
    assert hook.handle("GET", "/api/v1/alerts", GOOD_HEADERS, b"")[0] == 405


def test_request_counts_by_status_are_exported(hook):
    post(hook, payload(alert()))
    post(hook, payload(alert()), headers={})
    [family] = hook.families()
    assert {s.labels["code"]: s.value for s in family.samples} == {"200": 1.0, "401": 1.0}


# --------------------------------------------------------------------------------------------- token

def test_a_missing_token_file_is_created_private_and_random(tmp_path):
    path = tmp_path / "agent" / "webhook.token"
    token = load_token(path, create=True)
    assert len(token) >= 32 and (path.stat().st_mode & 0o777) == 0o600
    assert load_token(path, create=True) == token
    other = tmp_path / "other.token"
    assert load_token(other, create=True) != token


def test_a_token_file_others_can_read_is_refused(tmp_path):
    path = tmp_path / "webhook.token"
    path.write_text("s3cret\n")
    path.chmod(0o644)
    with pytest.raises(ValueError, match=r"readable by others \(mode 0644\); make it private: chmod 600"):
        load_token(path)
    path.chmod(0o600)
    assert load_token(path) == b"s3cret"


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_token_file_planted_by_another_user_is_refused(tmp_path):
    """The default token lives in RUN/agent/; a stranger who can write the run directory planted
    one they knew before the agent's first start, then could post any alert to the webhook."""
    path = tmp_path / "agent" / "webhook.token"
    path.parent.mkdir()
    path.write_text("the-strangers-token\n")
    path.chmod(0o600)
    os.chown(path, 12345, 12345)
    with pytest.raises(ValueError, match="belongs to uid 12345, not to this agent's user"):
        load_token(path, create=True)


def test_an_empty_token_file_is_an_error(tmp_path):
    path = tmp_path / "empty.token"
    path.write_text("\n")
    path.chmod(0o600)
    with pytest.raises(ValueError, match="empty"):
        load_token(path)
    with pytest.raises(FileNotFoundError):
        load_token(tmp_path / "absent.token")


def test_agents_creating_the_token_at_once_all_read_the_one_that_won(tmp_path):
    # Agents of several nodes start together on a shared run directory (RUN/agent/webhook.token): none may
    # read a token file another has created but not yet written, and all must end up with the same token.
    # Threads released by one barrier, over fresh paths, give the race many chances.
    def create(path, barrier, tokens, errors):
        barrier.wait()
        try:
            tokens.append(load_token(path, create=True))
        except Exception as error:         # noqa: BLE001 - the test reports what any creator raised
            errors.append(repr(error))

    for attempt in range(40):
        path = tmp_path / f"run-{attempt}" / "agent" / "webhook.token"
        barrier, tokens, errors = threading.Barrier(8), [], []
        threads = [threading.Thread(target=create, args=(path, barrier, tokens, errors)) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert errors == [] and len(tokens) == 8 and len(set(tokens)) == 1, (attempt, errors)
        assert (path.stat().st_mode & 0o777) == 0o600 and path.read_bytes().strip() == tokens[0]
        assert [p.name for p in path.parent.iterdir()] == ["webhook.token"]     # no temporary file left behind
