"""Alertmanager webhook payloads as Alertmanager 0.25 writes them, for the webhook and executor tests."""

from __future__ import annotations

import json

STARTS = "2024-03-15T14:22:18.123456789Z"
ZERO_TIME = "0001-01-01T00:00:00Z"


def alert(name: str = "LossSpike", action: str | None = "rollback", status: str = "firing",
          fingerprint: str = "a1b2c3d4e5f60718", starts_at: str = STARTS, **labels: str) -> dict:
    all_labels = {"alertname": name, "severity": "critical", "job": "trainguard", "instance": "127.0.0.1:9655",
                  **labels}
    if action:
        all_labels["action"] = action
    return {"status": status, "labels": all_labels,
            "annotations": {"summary": f"{name} fired", "runbook_url": "https://example/runbooks.md#x"},
            "startsAt": starts_at, "endsAt": ZERO_TIME if status == "firing" else "2024-03-15T14:30:00Z",
            "generatorURL": "http://127.0.0.1:9090/graph", "fingerprint": fingerprint}


def payload(*alerts: dict, status: str | None = None) -> dict:
    alerts = alerts or (alert(),)
    return {"receiver": "trainguard-agent", "status": status or alerts[0]["status"], "alerts": list(alerts),
            "groupLabels": {"job": "trainguard"}, "commonLabels": {"job": "trainguard"},
            "commonAnnotations": {}, "externalURL": "http://127.0.0.1:9093", "version": "4",
            "groupKey": '{}/{action=~"rollback"}:{job="trainguard"}', "truncatedAlerts": 0}


def body(data) -> bytes:
    return json.dumps(data).encode()


def read_jsonl(path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []
