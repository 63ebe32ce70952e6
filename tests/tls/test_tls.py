import gzip
import json
import math

import jsonschema
import pytest
import zstandard

from trainguard import tls

SEED = ('{"timestamp": "2024-03-15T14:22:18Z", "metrics": {"loss": 2.356, "grad_norm": 0.87, '
        '"learning_rate": 1e-5}, "hardware": {"gpu_util": "78%", "mem_util": "62%"}, "system": '
        '{"last_checkpoint": "step_125000", "data_throughput": "18GB/s"}}')


def test_seed_example_is_valid_and_normalised():
    record = tls.decode(SEED)
    assert record["timestamp"] == 1710512538.0
    assert record["hardware"] == {"gpu_util": 78.0, "mem_util": 62.0}
    assert record["system"] == {"last_checkpoint": "step_125000", "data_throughput": 18e9}
    assert record["metrics"]["learning_rate"] == 1e-5
    jsonschema.validate(json.loads(SEED), json.loads(tls.SCHEMA_PATH.read_text()))


def test_round_trip_keeps_unknown_keys_and_non_finite_values():
    record = tls.make_record(step=7, timestamp=1710512538.25, metrics={"loss": float("nan"), "grad_norm": float("inf"),
                             "custom": "kept"}, extra={"anything": [1, 2]})
    line = tls.encode(record)
    assert line.endswith(b"\n") and b"NaN" in line and b"Infinity" in line
    back = tls.decode(line)
    assert back["step"] == 7 and back["timestamp"] == 1710512538.25
    assert math.isnan(back["metrics"]["loss"]) and back["metrics"]["grad_norm"] == math.inf
    assert back["metrics"]["custom"] == "kept" and back["extra"] == {"anything": [1, 2]}


@pytest.mark.parametrize("text,field,expected", [
    ("512MiB", "hardware.mem_allocated_bytes", 512 * 2**20),
    ("1.5 GB/s", "system.data_throughput", 1.5e9),
    ("12ms", "hardware.disk_await_ms", 12.0),
    ("250ms", "metrics.step_time_seconds", 0.25),
    ("2.5", "metrics.loss", 2.5),
    ("NaN", "metrics.loss", None),
])
def test_unit_strings(text, field, expected):
    value = tls.parse_quantity(text, field)
    assert math.isnan(value) if expected is None else value == pytest.approx(expected)


@pytest.mark.parametrize("timestamp,expected", [
    ("2024-03-15T14:22:18.5Z", 1710512538.5),
    ("2024-03-15T16:22:18+02:00", 1710512538.0),
    (1710512538, 1710512538.0),
    ("1710512538.5", 1710512538.5),
])
def test_timestamps(timestamp, expected):
    assert tls.parse_timestamp(timestamp) == expected


@pytest.mark.parametrize("line,message", [
    ('{"metrics": {}}', "timestamp: missing required field"),
    ('{"timestamp": "yesterday"}', "timestamp: not an RFC 3339 time"),
    ('{"timestamp": 1, "metrics": {"loss": "high"}}', "metrics.loss: expected a number"),
    ('{"timestamp": 1, "step": 1.5}', "step: expected an integer"),
    ('{"timestamp": 1, "event": {"kind": "x"}}', "event.type"),
    ('[1, 2]', "a record is a JSON object"),
    ('{"timestamp": 1,', "not valid JSON"),
])
def test_errors_name_file_line_and_field(line, message):
    with pytest.raises(tls.TLSError) as info:
        tls.decode(line, "run/tls/rank-0.jsonl", 17)
    assert str(info.value).startswith("run/tls/rank-0.jsonl:17: ")
    assert message in str(info.value)


def write_lines(path, lines, opener=open):
    with opener(path, "wb") as handle:
        handle.write("".join(lines).encode())


@pytest.mark.parametrize("suffix", ["", ".gz", ".zst"])
def test_iter_lines_reports_malformed_and_truncated_lines_and_loses_nothing(tmp_path, suffix):
    lines = [SEED + "\n", "not json\n", "\n", '{"timestamp": 2, "metrics": {"loss": NaN}}\n', '{"timestamp": 3, "met']
    path = tmp_path / f"rank-0.jsonl{suffix}"
    if suffix == ".gz":
        write_lines(path, lines, gzip.open)
    elif suffix == ".zst":
        path.write_bytes(zstandard.ZstdCompressor().compress("".join(lines).encode()))
    else:
        write_lines(path, lines)
    got = list(tls.iter_lines(path))
    assert [(g.lineno, g.record is not None) for g in got] == [(1, True), (2, False), (4, True), (5, False)]
    assert str(got[1].error).startswith(f"{path}:2: not valid JSON")
    assert "truncated last line" in str(got[3].error)
    with pytest.raises(tls.TLSError, match=":2: "):
        tls.read_records(path)


def test_writer_appends_whole_lines(tmp_path):
    path = tmp_path / "tls" / "rank-0.jsonl"
    with tls.Writer(path) as writer:
        for step in range(3):
            writer.write(tls.make_record(step=step, metrics={"loss": 1.0}))
        writer.write(tls.event("checkpoint_saved", step=2, path="step_2"))
    records = tls.read_records(path)
    assert [r.get("step") for r in records] == [0, 1, 2, 2]
    assert records[-1]["event"] == {"type": "checkpoint_saved", "path": "step_2"}
    for line in path.read_text().splitlines():
        jsonschema.validate(json.loads(line), json.loads(tls.SCHEMA_PATH.read_text()))


def test_non_finite_values_nested_in_a_section_survive_the_round_trip():
    record = tls.make_record(step=1, timestamp=1.0, metrics={"loss": 1.0, "grad_norm_by_layer": {"h.0": float("nan")}})
    assert math.isnan(tls.decode(tls.encode(record))["metrics"]["grad_norm_by_layer"]["h.0"])
