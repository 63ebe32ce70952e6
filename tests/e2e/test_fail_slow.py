"""Fail-slow end to end: a slow rank in a real 2-rank run is scored by the agent, named by TrainingStraggler
(promtool over the agent's own scraped series), named by `trainguard diagnose`, and nothing is evicted.

Two ranks of the bundled trainer (torchrun, gloo on CPU) with `--inject slowrank@30:1` (rank 1's compute
slowed SLOWRANK_FACTOR times for SLOWRANK_STEPS steps) and `trainguard agent` beside them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml

from tests.report.agent_beside import start_agent, stop
from tests.servers import require_binary
from trainguard import tls
from trainguard.alerts import rules

TRAINGUARD = [sys.executable, "-m", "trainguard.cli"]
SCORE = re.compile(r'^trainguard_rank_straggler_score\{(?P<labels>[^}]*)\} (?P<value>\S+)$', re.M)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def _scrape(port: int) -> list[dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
            text = reply.read().decode()
    except OSError:
        return []
    return [{**dict(re.findall(r'(\w+)="([^"]*)"', m.group("labels"))), "value": float(m.group("value"))}
            for m in SCORE.finditer(text)]


@pytest.fixture(scope="module")
def slow_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("slow") / "run"
    (run_dir / "agent").mkdir(parents=True)
    config = run_dir / "agent" / "agent.yaml"
    config.write_text(yaml.safe_dump({"collectors": {"training": {"interval": 1}}}))
    agent, port = start_agent(run_dir, config)
    scraped: list[list[dict]] = []
    try:
        with open(run_dir / "train.log", "wb") as log:
            trainer = subprocess.Popen(TRAINGUARD + ["train", "--run-dir", str(run_dir), "--steps", "100", "--nproc",
                                                    "2", "--inject", "slowrank@30:1"], stdout=log,
                                       stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while trainer.poll() is None and time.monotonic() < deadline:
            scraped.append(_scrape(port))
            time.sleep(1.0)
        assert trainer.wait(30) == 0, (run_dir / "train.log").read_text()[-3000:]
    finally:
        stop(agent)
    return run_dir, scraped


def test_the_agent_scores_the_slow_rank_and_the_alert_names_rank_and_node(slow_run, tmp_path):
    run_dir, scraped = slow_run
    host = next(r["node"] for r in tls.read_records(run_dir / "tls" / "rank-1.jsonl") if r.get("node"))
    slow = [{s["rank"]: s for s in scrape} for scrape in scraped if any(s["rank"] == "1" and s["value"] < 0.75
                                                                         for s in scrape)]
    assert len(slow) >= 3, scraped                       # it persisted over several scrapes
    for scores in slow:
        assert scores["1"]["node"] == host and scores["0"]["value"] == 1.0
    assert min(scores["1"]["value"] for scores in slow) < 0.5

    # The very series the agent exported, held for the alert's `for`, through the generated rule.
    promtool = require_binary("promtool")
    rules.write(tmp_path / "rules")
    worst = min(scores["1"]["value"] for scores in slow)
    series = [{"series": f'trainguard_rank_straggler_score{{job="trainguard",instance="n1:9655",run_id="run",'
                         f'rank="{rank}",node="{host}"}}', "values": " ".join([str(value)] * 6)}
              for rank, value in (("0", 1.0), ("1", worst))]
    test = {"rule_files": [str(tmp_path / "rules" / "training.rules.yml")], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": [
                {"eval_time": "4m", "alertname": "TrainingStraggler",
                 "exp_alerts": [{"exp_labels": {"severity": "warning", "job": "trainguard", "run_id": "run",
                                                "rank": "1", "node": host},
                                 "exp_annotations": _annotations(host, worst)}]}]}]}
    (tmp_path / "straggler.test.yml").write_text(yaml.safe_dump(test))
    done = subprocess.run([promtool, "test", "rules", str(tmp_path / "straggler.test.yml")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def _annotations(host: str, score: float) -> dict:
    [rule] = [a for a in rules.alerts() if a.name == "TrainingStraggler"]
    rendered = rule.to_dict()["annotations"]
    return {**rendered, "summary": f"Rank 1 of run run on {host} is a straggler: {score:.2f} of the fastest rank's speed"}


def test_nothing_is_evicted_by_default(slow_run):
    run_dir, _ = slow_run
    assert not (run_dir / "control" / "cordon").exists()
    events = [r["event"] for r in tls.read_records(run_dir / "tls" / "rank-0.jsonl") if r.get("event")]
    assert [e.get("resumed_from") for e in events if e["type"] == "run_start"] == [None]
    assert events[-1]["type"] == "run_end" and events[-1]["reason"] == "completed"
    actions = list((run_dir / "tls").glob("node-*-actions.jsonl"))
    assert all("restore" not in path.read_text() for path in actions)


def test_diagnose_names_the_rank_that_straggled(slow_run, tmp_path):
    run_dir, _ = slow_run
    # The threshold scaled to the injected fault, as in the replay test below (a loaded machine keeps rank 0
    # of this tiny model under 0.75 for stretches; under 1/sqrt(factor) it is the fault alone).
    _, factor, _ = _slowed_stretch(run_dir)
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump({"diagnose": {"straggler_score_min": round(factor ** -0.5, 3)}}))
    done = subprocess.run(TRAINGUARD + ["diagnose", str(run_dir), "--json", "--policy", str(policy)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode in (0, 1), done.stderr
    findings = {f["check"]: f for f in json.loads(done.stdout)["findings"]}
    # Slowed for 40 of 100 steps: a stretch (straggler_windows), or, when the shared machine's own jitter
    # slows the rest too, the whole run's medians (stragglers); either way rank 1, and only rank 1.
    named = [f for f in (findings["straggler_windows"], findings["stragglers"]) if f["status"] == "problem"]
    assert named and all(f["evidence"]["rank"] == 1 and f["evidence"]["stragglers"] == [1] for f in named)
    windows = findings["straggler_windows"]
    assert windows["evidence"]["lowest_score"]["1"] < 0.75
    if windows["status"] == "problem":
        first, last = windows["evidence"]["steps"]
        assert 30 <= first and last <= 30 + 40 + 2 * 16    # while slowed, and until the window forgets it


def _slowed_stretch(run_dir) -> tuple[float, float, float]:
    """(seconds the injected slowrank stretch lasted, its slowdown factor, its first step's time), from
    rank 1's own records: the `fault_injected` event and the step records at its first and last step."""
    records = list(tls.read_records(run_dir / "tls" / "rank-1.jsonl"))
    [fault] = [r["event"] for r in records if (r.get("event") or {}).get("type") == "fault_injected"]
    times = {r["step"]: r["timestamp"] for r in records if isinstance(r.get("metrics"), dict) and "step" in r}
    first, last = fault["step"], fault["step"] + fault["steps"]
    return times[last] - times[first], fault["factor"], times[first]


def test_replay_through_prometheus_rules_names_the_straggler(slow_run, tmp_path):
    """The rule run with a hold and a threshold scaled to the injected fault, not to a 2-minute production
    hold. With `for_long: 1s` and the 0.75 threshold (before) this failed on a loaded machine, naming rank 0
    too, and rightly: on this tiny CPU model (40 ms steps) rank 0 runs 1.3x slower than rank 1 for a second
    at a time (relative scores 0.66-0.79 before the fault, measured beside two CPU burners), a real lag
    that a 1 s hold reports. The rule is NVRx's (0.75, held 2m in production); the test now asks what the
    injected fault alone answers: a rank SLOWRANK_FACTOR times slower (score about 1/4) held for half the
    stretch the fault lasted, under a threshold halfway (geometrically) between 1 and 1/factor."""
    run_dir, _ = slow_run
    host = next(r["node"] for r in tls.read_records(run_dir / "tls" / "rank-1.jsonl") if r.get("node"))
    stretch, factor, began = _slowed_stretch(run_dir)
    hold = max(1, int(stretch / 2))           # durations are whole seconds
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump({"alerts": {"for_long": f"{hold}s"},
                                      "diagnose": {"straggler_score_min": round(factor ** -0.5, 3)}}))
    from trainguard.cli import main            # rendering the rules is not what this test is about

    assert main(["alerts", "render", "--policy", str(policy), "--out", str(tmp_path / "rules")]) == 0
    done = subprocess.run(TRAINGUARD + ["replay", str(run_dir), "--rules", str(tmp_path / "rules"), "--policy",
                                        str(policy), "--scrape-interval", "0.5", "--json"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    straggler = [a for a in json.loads(done.stdout)["alerts"] if a["alertname"] == "TrainingStraggler"]
    assert straggler and all((a["labels"]["rank"], a["labels"]["node"]) == ("1", host) for a in straggler)
    # ... and it fired for the fault: after the stretch began, within its length plus the window's memory
    assert all(0 <= tls.parse_timestamp(a["starts_at"]) - began <= 2 * stretch for a in straggler)
