"""`trainguard replay`: the command, its JSON document, the human timeline and exit statuses."""

import json
import subprocess
import sys
import textwrap

import pytest

from tests.servers import require_binary
from trainguard import tls
from trainguard.cli import main

T0 = 1_710_512_538.0
DESIGN_KEYS = {"records", "malformed", "first_timestamp", "last_timestamp", "actions", "alerts"}


@pytest.fixture
def log(tmp_path):
    """A NaN at step 80 (skipped by the guard), a loss above 10 from 100 s to 200 s (for the alert rule: 12
    over 9, no spike to the guard's warm-up rule, which sees x1.8), and one broken line."""
    path = tmp_path / "rank-0.jsonl"
    with tls.Writer(path) as writer:
        for i in range(60):
            loss = float("nan") if i == 40 else (12.0 if 100 <= 5 * i < 200 else 9.0)
            writer.write({"timestamp": tls.format_timestamp(T0 + 5 * i), "node": "node-a", "rank": 0,
                          "step": 2 * i, "metrics": {"loss": loss, "grad_norm": 1.0}})
    with open(path, "ab") as handle:
        handle.write(b'{"timestamp": "2024-03-15T14:30:00Z", "step": oops}\n')
    return path


@pytest.fixture
def rules_dir(tmp_path):
    folder = tmp_path / "rules"
    folder.mkdir()
    (folder / "loss.rules.yml").write_text(textwrap.dedent("""\
        groups:
        - name: loss
          rules:
          - alert: LossHigh
            expr: trainguard_training_loss > 10
            for: 30s
            labels: {severity: critical}
    """))
    return folder


def replay(*args, capsys):
    code = main(["replay", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_json_document_has_the_designs_shape(log, rules_dir, capsys):
    require_binary("promtool")
    code, out, _ = replay(log, "--rules", rules_dir, "--scrape-interval", "10", "--json", capsys=capsys)
    assert code == 0
    document = json.loads(out)
    assert DESIGN_KEYS <= set(document)
    assert document["records"] == 60 and document["malformed"] == 1
    assert document["first_timestamp"] == "2024-03-15T14:22:18.000000Z"
    assert document["last_timestamp"] == tls.format_timestamp(T0 + 295)
    assert [{k: a[k] for k in ("action", "step", "timestamp", "reason")} for a in document["actions"]] == [
        {"action": "skip_step", "step": 80, "timestamp": tls.format_timestamp(T0 + 200), "reason": "nan"}]
    assert document["actions"][0]["detail"]["loss"] == "nan"          # JSON has no NaN
    assert document["alerts"] == [{"alertname": "LossHigh", "severity": "critical",
                                   "starts_at": tls.format_timestamp(T0 + 130),
                                   "ends_at": tls.format_timestamp(T0 + 200),
                                   # an empty run_id label is no label to Prometheus
                                   "labels": {"instance": "node-a", "job": "trainguard", "rank": "0"}}]
    assert document["malformed_lines"] == [{"file": str(log), "line": 61,
                                            "error": document["malformed_lines"][0]["error"]}]
    assert "not valid JSON" in document["malformed_lines"][0]["error"]


def test_without_rules_alerts_is_empty_and_rules_null(log, capsys):
    code, out, _ = replay(log, "--json", capsys=capsys)
    document = json.loads(out)
    assert code == 0 and document["alerts"] == [] and document["rules"] is None


def test_human_timeline(log, capsys):
    code, out, _ = replay(log, capsys=capsys)
    assert code == 0
    assert "replay: 1 file, 60 records, 1 malformed" in out
    assert "+3m20s" in out and "skip_step" in out and "nan" in out
    assert f"{log}:61: not valid JSON" in out


def test_expect_mismatch_exits_1_with_a_diff(log, tmp_path, capsys):
    wrong = tmp_path / "wrong.yml"
    wrong.write_text("actions:\n  - {action: rollback, step: [70, 90]}\n")
    code, out, err = replay(log, "--expect", wrong, capsys=capsys)
    assert code == 1
    assert f"does not match {wrong}" in err
    assert "- action rollback  step 70..90   (expected by actions[0]; none found)" in err
    assert "+ action skip_step  step 80  at +3m20s  reason nan   (unexpected)" in err
    assert "expectation" in out and "NOT met" in out


def test_expect_match_exits_0(log, tmp_path, capsys):
    right = tmp_path / "right.yml"
    right.write_text("actions:\n  - {action: skip_step, step: 80, reason: nan, count: 1}\n")
    code, out, _ = replay(log, "--expect", right, "--json", capsys=capsys)
    assert code == 0
    assert json.loads(out)["expect"] == {"file": str(right), "ok": True, "diff": []}


def test_policy_file_changes_the_decisions(log, tmp_path, capsys):
    policy = tmp_path / "policy.yml"
    policy.write_text("guard: {rollback_after: 1}\n")
    code, out, _ = replay(log, "--policy", policy, "--json", capsys=capsys)
    assert code == 0
    assert [a["action"] for a in json.loads(out)["actions"]] == ["rollback"]


@pytest.mark.parametrize("extra, message", [
    (["--policy", "/nonexistent/policy.yml"], "no such policy file"),
    (["--expect", "/nonexistent/expect.yml"], "no such expectation file"),
    (["--rules", "/nonexistent/rules"], "not a directory of rule files"),
])
def test_bad_input_exits_2_naming_it(log, capsys, extra, message):
    code, _, err = replay(log, *extra, capsys=capsys)
    assert code == 2 and message in err


def test_missing_log_exits_2(tmp_path, capsys):
    code, _, err = replay(tmp_path / "nope.jsonl", capsys=capsys)
    assert code == 2 and "no such file or directory" in err


def test_the_installed_command(log):
    """The real entry point, as a user runs it."""
    done = subprocess.run([sys.executable, "-m", "trainguard.cli", "replay", str(log), "--json"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["actions"][0]["action"] == "skip_step"


def test_a_log_of_many_chunks_replays_as_its_compressed_copy(tmp_path):
    """A plain log over two chunks goes the columnar way (worker processes; trainguard.replay.columns),
    its gzip copy the one-process way: as a user runs them, the two JSON documents must be the same."""
    import gzip

    from tests.replay.test_columns import trainer_records, write
    from trainguard.replay import columns

    plain = write(tmp_path / "rank-0.jsonl", trainer_records(60_000), bad_every=997, truncate=True)
    assert plain.stat().st_size > 2 * columns.CHUNK_BYTES
    packed = tmp_path / "rank-0.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes(), compresslevel=1))
    policy = tmp_path / "policy.yml"
    policy.write_text("cost:\n  budget_per_1k_steps: 1.2\n")
    documents = []
    for path in (plain, packed):
        done = subprocess.run([sys.executable, "-m", "trainguard.cli", "replay", str(path), "--json",
                               "--policy", str(policy)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        document = json.loads(done.stdout)
        document.pop("files", None)
        for malformed in document["malformed_lines"]:
            malformed["file"] = malformed["file"].removesuffix(".gz")
        documents.append(document)
    assert documents[0]["actions"] and documents[0]["malformed"] >= 30
    assert documents[0] == documents[1]


def test_the_recorded_side_lists_every_source_once(tmp_path, capsys):
    """The trainer's decisions and restart, the agent's verdict and action, the control request: merged by id."""
    run = tmp_path / "run"
    with tls.Writer(run / "tls" / "rank-0.jsonl") as writer:
        for step in range(1, 21):
            writer.write({"timestamp": T0 + step, "rank": 0, "node": "n1", "step": step,
                          "metrics": {"loss": 2.0, "grad_norm": 1.0}})
        writer.write({"timestamp": T0 + 40, "rank": 0, "node": "n1", "step": 10,
                      "event": {"type": "run_start", "resumed_from": 10, "restart_count": 1}})
        writer.write({"timestamp": T0 + 41, "rank": 0, "node": "n1", "step": 11,
                      "metrics": {"loss": 2.0, "grad_norm": 1.0}})
    with tls.Writer(run / "tls" / "rank-1.jsonl") as writer:     # the other rank says it restarted too
        writer.write({"timestamp": T0 + 40.2, "rank": 1, "node": "n1", "step": 10,
                      "event": {"type": "run_start", "resumed_from": 10, "restart_count": 1}})
    with tls.Writer(run / "tls" / "node-n1-actions.jsonl") as writer:
        writer.write({"timestamp": T0 + 30, "node": "n1", "event": {
            "type": "alert", "alertname": "TrainingStalled", "status": "firing", "source": "embedded",
            "outcome": "act", "action": "restore", "reason": "no TLS record for 8s", "request_id": "restore-1"}})
        writer.write({"timestamp": T0 + 30, "node": "n1", "event": {
            "type": "action", "id": "restore-1", "action": "restore", "alertname": "TrainingStalled",
            "issued_at": T0 + 30, "ended": [{"rank": 0, "pid": 1}, {"rank": 1, "pid": 2}], "outcome": "issued"}})
    (run / "control").mkdir()
    (run / "control" / "actions.jsonl").write_text(
        json.dumps({"id": "restore-1", "action": "restore", "alertname": "TrainingStalled", "issued_at": T0 + 30})
        + "\n" + json.dumps({"id": "stop-9", "action": "stop", "reason": "by hand", "issued_at": T0 + 35}) + "\n{torn")
    assert main(["replay", str(run), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    actions = [(a["action"], a["step"], a["source"]) for a in document["recorded_actions"]]
    assert actions == [("restore", None, "agent+control"), ("stop", None, "control"), ("restart", 10, "trainer")]
    assert document["recorded_actions"][0]["detail"]["ended_ranks"] == [0, 1]
    [alert] = document["recorded_alerts"]
    assert (alert["alertname"], alert["source"], alert["detail"]["outcome"]) == ("TrainingStalled", "embedded", "act")
    assert main(["replay", str(run)]) == 0
    text = capsys.readouterr().out
    assert "alert TrainingStalled" in text and "resumed from step 10 (restart 1)" in text
