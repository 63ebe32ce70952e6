"""A flood on the webhook: 500 requests from 8 threads to a running `trainguard agent` on loopback.

Alertmanager repeating itself, many distinct alerts asking for the same action, every cost tier many
times over, and requests without the token, all at once and in a shuffled order. The agent must answer
every request (a 503 beyond its connection limit is an answer, and is retried as Alertmanager would),
keep serving /metrics meanwhile, apply its rate limits (cooldowns, hourly limits with escalation), and
put each action on the control channel once: the trainer acts once per incident however loud the flood.
"""

from __future__ import annotations

import json
import random
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.alerts.helpers import alert, payload, read_jsonl
from tests.e2e.stack import stack
from tests.servers import http_get

pytestmark = [pytest.mark.servers, pytest.mark.timeout(180)]

THREADS = 8
LIMITS = {"alerts": {"action_cooldown_seconds": 0, "max_restores_per_hour": 3},
          "guard": {"max_rollbacks_per_hour": 3}}


def requests_of_the_flood(token: str) -> list[tuple[str, bytes, dict]]:
    auth = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    wrong = {**auth, "Authorization": "Bearer not-the-token"}
    one = lambda name, action, fingerprint: json.dumps(payload(alert(name, action, fingerprint=fingerprint))).encode()  # noqa: E731
    flood = [("repeat", one("LossSpike", "rollback", "f000000000000000"), auth)] * 100
    flood += [("rollbacks", one("GradNormExplosion", "rollback", f"{i:016x}"), auth) for i in range(50)] * 2
    flood += [("restores", one("TrainingStalled", "restore", f"{1000 + i:016x}"), auth) for i in range(50)] * 2
    tiers = [("CostBudgetWarn", "cost_warn"), ("CostBudgetThrottle", "cost_throttle"), ("CostBudgetStop", "cost_stop")]
    flood += [("cost", one(name, action, f"{2000 + n:016x}"), auth) for n, (name, action) in enumerate(tiers)] * 34
    flood += [("no token", one("LossSpike", "rollback", "f000000000000000"), wrong)] * 98
    random.Random(9).shuffle(flood)
    return flood


def post_until_answered(url: str, body: bytes, headers: dict) -> tuple[int, int]:
    """(status, 503s seen first): a 503 is the agent's connection limit, retried as Alertmanager does."""
    busy = 0
    while True:
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, busy
        except urllib.error.HTTPError as exc:
            if exc.code != 503 or busy >= 50:
                return exc.code, busy
            busy += 1


def test_a_flood_is_rate_limited_answered_and_acts_once_per_incident(tmp_path):
    with stack(tmp_path, LIMITS) as s:
        agent = s.start_agent("n1")
        base = f"http://{agent.address}"
        flood = requests_of_the_flood(s.token_file.read_text().strip())
        assert len(flood) == 500

        scrapes: list[int] = []
        done = threading.Event()

        def scrape_meanwhile():
            while not done.is_set():
                scrapes.append(http_get(base + "/metrics", timeout=30)[0])

        scraper = threading.Thread(target=scrape_meanwhile)
        scraper.start()
        try:
            with ThreadPoolExecutor(THREADS) as pool:
                answers = list(pool.map(lambda r: (r[0], *post_until_answered(base + "/api/v1/alerts", r[1], r[2])),
                                        flood))
        finally:
            done.set()
            scraper.join(60)

        by_kind: dict[str, set[int]] = {}
        for kind, status, _ in answers:
            by_kind.setdefault(kind, set()).add(status)
        assert by_kind == {"repeat": {200}, "rollbacks": {200}, "restores": {200}, "cost": {200},
                           "no token": {401}}
        assert scrapes and set(scrapes) <= {200, 503} and 200 in scrapes, "the agent stopped serving /metrics"
        assert http_get(base + "/healthz")[0] == 200

        control = read_jsonl(s.run_dir / "control" / "actions.jsonl")
        ids = [r["id"] for r in control]
        assert len(ids) == len(set(ids)), "an action was put on the control channel twice"
        executed = [r["action"] for r in control]
        # Three rollbacks an hour, the next one escalated to a clean stop; three restores, the rest paged.
        assert executed.count("rollback") == 3
        assert executed.count("restore") == 3
        assert executed.count("cost_stop") == 1
        assert executed.count("cost_warn") <= 1 and executed.count("cost_throttle") <= 1

        recorded = [r["event"] for r in read_jsonl(s.run_dir / "tls" / "node-n1-actions.jsonl")
                    if r["event"]["type"] == "alert"]
        assert len(recorded) == 402, "every authorised alert is recorded, once per request"
        outcomes = {e["outcome"] for e in recorded}
        assert {"act", "duplicate", "escalated"} <= outcomes
        assert any(e["outcome"] == "escalated" and e["action"] == "page" for e in recorded)
        issued = [r["event"] for r in read_jsonl(s.run_dir / "tls" / "node-n1-actions.jsonl")
                  if r["event"]["type"] == "action"]
        assert sorted(e["id"] for e in issued) == sorted(ids)
