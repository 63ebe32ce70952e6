"""Diagnose over recorded runs with one known cause: that cause comes first, with its evidence."""

from __future__ import annotations

import json

import pytest

from tests.diagnose import records
from trainguard.cli import main
from trainguard.diagnose import NO_DATA, OK, PROBLEM, diagnose_run, load_run
from trainguard.policy import Policy


def problems(findings):
    return [f for f in findings if f.status == PROBLEM]


def by_check(findings):
    return {f.check: f for f in findings}


def test_healthy_run_has_no_problem(tmp_path):
    records.write_ranks(tmp_path, records.run_of(records.healthy))
    findings = diagnose_run(tmp_path)
    assert problems(findings) == []
    checks = by_check(findings)
    for name in ("comm_share", "stragglers", "step_jitter", "data_wait", "data_utilization", "fragmentation",
                 "grad_norm_trend"):
        assert checks[name].status == OK, checks[name]


def test_slow_io_names_data_wait_first_with_the_steps(tmp_path):
    records.write_ranks(tmp_path, records.run_of(records.slow_io))
    findings = diagnose_run(tmp_path)
    first = findings[0]
    assert (first.layer, first.check, first.status) == ("data", "data_wait", PROBLEM)
    assert [f.check for f in problems(findings)] == ["data_wait"]   # no other layer blamed for it
    assert first.evidence["stretches"][0]["steps"] == [20, 24]
    assert first.evidence["worst_window_share"] > 0.5


def test_slow_disks_add_disk_await_evidence(tmp_path):
    records.write_ranks(tmp_path, records.run_of(records.slow_io))
    quiet, slow = {"disk_await_ms": 1.5}, {"disk_await_ms": 48.0}
    records.write_nodes(tmp_path, [quiet] * 4 + [slow] * 12 + [quiet] * 4)
    found = by_check(diagnose_run(tmp_path))
    disk = found["disk_await"]
    assert disk.status == PROBLEM and disk.layer == "data"
    assert disk.evidence["host"] == "node-a" and disk.evidence["max_ms"] == 48.0
    assert disk.evidence["stretches"][0]["rows"] == 12


def test_one_slow_disk_sample_is_not_a_diagnosis(tmp_path):
    records.write_ranks(tmp_path, records.run_of(records.healthy))
    records.write_nodes(tmp_path, [{"disk_await_ms": 2.0}] * 5 + [{"disk_await_ms": 90.0}] + [{"disk_await_ms": 2.0}] * 5)
    assert by_check(diagnose_run(tmp_path))["disk_await"].status == OK


def test_straggler_rank_is_named_with_its_nvrx_score(tmp_path):
    records.write_ranks(tmp_path, records.run_of(records.straggler))
    findings = diagnose_run(tmp_path)
    first = findings[0]
    assert (first.layer, first.check) == ("framework", "stragglers")
    assert first.evidence["rank"] == 1 and first.evidence["stragglers"] == [1]
    score = first.evidence["scores"]["compute_seconds"]["1"]
    assert 0.40 < score < 0.50          # fastest median / its median: 1 / 2.2
    assert "rank 1" in first.cause
    # the fast rank's waiting is not mistaken for a communication-bound job
    assert by_check(findings)["comm_share"].status == OK


def test_fragmented_allocator_is_named(tmp_path):
    records.write_ranks(tmp_path, records.run_of(records.fragmented))
    findings = diagnose_run(tmp_path)
    first = findings[0]
    assert (first.layer, first.check) == ("algorithm", "fragmentation")
    assert first.evidence["median_ratio"] == pytest.approx(30 / 62, abs=0.02)
    assert [f.check for f in problems(findings)] == ["fragmentation"]


def test_comm_heavy_configuration_is_named(tmp_path):
    records.write_ranks(tmp_path, records.run_of(records.comm_heavy))
    findings = diagnose_run(tmp_path)
    first = findings[0]
    assert (first.layer, first.check) == ("framework", "comm_share")
    assert first.score == pytest.approx(0.075 / 0.179, abs=0.02)
    assert [f.check for f in problems(findings)] == ["comm_share"]


def test_thresholds_come_from_the_policy(tmp_path):
    records.write_ranks(tmp_path, records.run_of(records.comm_heavy))
    lenient = Policy(alerts=Policy().alerts.__class__(comm_overhead_max=0.5))
    assert by_check(diagnose_run(tmp_path, lenient))["comm_share"].status == OK


def test_missing_fields_are_reported_as_not_enough_data(tmp_path):
    with records.tls.Writer(tmp_path / "tls" / "rank-0.jsonl") as writer:
        for step in range(1, 30):
            writer.write({"timestamp": records.START + step, "step": step, "metrics": {"loss": 3.0}})
    found = by_check(diagnose_run(tmp_path))
    assert found["data_wait"].status == NO_DATA
    assert "data_wait_seconds" in found["data_wait"].needs
    assert found["stragglers"].status == NO_DATA and "2 or more ranks" in found["stragglers"].needs
    assert found["gpu_slowdown"].status == NO_DATA and "node-<host>.jsonl" in found["gpu_slowdown"].needs
    assert found["loss_plateau"].cause.startswith("not enough data: needs metrics.loss on 100+ steps")
    assert all(f.status != PROBLEM for f in found.values())


def test_an_empty_run_says_what_every_check_needs(tmp_path):
    findings = diagnose_run(tmp_path)
    assert findings and all(f.status == NO_DATA and f.needs for f in findings)


def test_loss_plateau_and_grad_norm_trend(tmp_path):
    def flat_and_drifting(step, rank, rng):
        s = records.healthy(step, rank, rng)
        s.loss = 2.0 + rng.uniform(-0.01, 0.01)
        s.grad_norm = 0.5 * 1.03 ** step
        return s

    records.write_ranks(tmp_path, records.run_of(flat_and_drifting, ranks=1, steps=160))
    found = by_check(diagnose_run(tmp_path))
    assert found["loss_plateau"].status == PROBLEM
    assert found["grad_norm_trend"].status == PROBLEM and found["grad_norm_trend"].evidence["ratio"] > 3


def test_malformed_lines_are_reported_with_file_and_line(tmp_path, capsys):
    records.write_ranks(tmp_path, records.run_of(records.slow_io))
    with open(tmp_path / "tls" / "rank-0.jsonl", "a") as handle:
        handle.write('{"timestamp": "yesterday", "step": 61}\n{not json\n')
    data = load_run(tmp_path)
    assert data.malformed == 2
    assert data.errors[0].endswith("rank-0.jsonl:61: timestamp: not an RFC 3339 time: 'yesterday'")
    assert main(["diagnose", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["malformed"] == 2 and "rank-0.jsonl:62" in out["errors"][1]
    assert out["findings"][0]["check"] == "data_wait"


def test_cli_table_lists_the_cause_first(tmp_path, capsys):
    records.write_ranks(tmp_path, records.run_of(records.straggler))
    assert main(["diagnose", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert " 1. [framework] stragglers" in text
    assert "Not enough data in the logs for:" in text and "[hardware] gpu_errors" in text


def test_cli_missing_run_dir_is_a_clear_error(tmp_path, capsys):
    assert main(["diagnose", str(tmp_path / "nope")]) == 2
    assert "no such run directory" in capsys.readouterr().err
