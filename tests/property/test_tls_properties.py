"""The TLS reader on arbitrary and damaged input: a correct record, or a TLSError naming source and line.

Never another exception, never a record that breaks what readers assume of one (a finite timestamp they
can format, integer step and rank, numbers where numbers belong, an event with a type).
"""

from __future__ import annotations

import gzip
import json
import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.property.conftest import examples
from tests.property.mutate import DEEP_ARRAY, DEEP_OBJECT, json_values, mutated_bytes, mutated_json
from trainguard import tls

SOURCE, LINE = "rank-0.jsonl", 7

# ------------------------------------------------------------------------------------- valid records

finite = st.floats(min_value=-1e12, max_value=1e12, allow_nan=False)
UNITS = {"%": 1.0, "GB/s": 1e9, "MiB": 2**20, "KiB": 2**10, "kB": 1e3, "": 1.0}


@st.composite
def quantity(draw) -> tuple[object, float]:
    """A value as a writer puts it (a number, a non-finite float, a unit string) and what it must read as."""
    kind = draw(st.sampled_from(["number", "integer", "unit", "nonfinite"]))
    if kind == "number":
        value = draw(finite)
        return value, value
    if kind == "integer":
        value = draw(st.integers(0, 2**53))
        return value, value
    if kind == "nonfinite":
        value = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        return value, value
    number = draw(st.integers(0, 10**6)) / 4
    unit = draw(st.sampled_from(sorted(UNITS)))
    return f"{number!r}{unit}", number * UNITS[unit]


@st.composite
def valid_records(draw) -> tuple[dict, dict]:
    """(a record as a writer writes it, the record tls.decode must return for it)."""
    moment = draw(st.floats(min_value=0, max_value=4e9, allow_nan=False))
    as_text = draw(st.booleans())
    written: dict = {"timestamp": tls.format_timestamp(moment) if as_text else moment}
    expected: dict = {"timestamp": tls.parse_timestamp(written["timestamp"])}
    for key in ("step", "rank"):
        if draw(st.booleans()):
            written[key] = expected[key] = draw(st.integers(0, 2**40))
    for section, numeric in (("metrics", tls.NUMERIC_FIELDS["metrics"] - tls.INT_FIELDS),
                             ("hardware", tls.NUMERIC_FIELDS["hardware"])):
        if draw(st.booleans()):
            names = draw(st.lists(st.sampled_from(sorted(numeric)), max_size=5, unique=True))
            pairs = {name: draw(quantity()) for name in names}
            written[section] = {name: raw for name, (raw, _) in pairs.items()}
            expected[section] = {name: value for name, (_, value) in pairs.items()}
    if draw(st.booleans()):
        kind = draw(st.text(min_size=1, max_size=12))
        written["event"] = expected["event"] = {"type": kind, "note": draw(st.text(max_size=8))}
    extra = draw(st.dictionaries(st.text(min_size=1, max_size=8).filter(lambda k: k not in written), json_values,
                                 max_size=2))
    written.update(extra)
    expected.update(extra)
    return written, expected


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, (int, float)) or isinstance(b, float) and isinstance(a, (int, float)):
        return a == b or math.isnan(a) and math.isnan(b) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


# -------------------------------------------------------------------------------------------- checks

def assert_sound(record: dict) -> None:
    """What every reader of a decoded record relies on."""
    assert isinstance(record, dict)
    stamp = record["timestamp"]
    assert type(stamp) is float and math.isfinite(stamp), stamp
    tls.format_timestamp(stamp)                                  # a reader can print it
    for key in ("step", "rank"):
        if record.get(key) is not None:
            assert type(record[key]) is int, (key, record[key])
            assert tls.INT64_MIN <= record[key] <= tls.INT64_MAX, (key, record[key])   # int64 columns
    for section in ("metrics", "hardware", "system"):
        values = record.get(section)
        if values is None:
            continue
        assert isinstance(values, dict)
        for name in tls.NUMERIC_FIELDS[section] & values.keys():
            value = values[name]
            assert value is None or type(value) in (int, float), (section, name, value)
            if name in tls.INT_FIELDS and isinstance(value, float):
                assert not math.isfinite(value), (section, name, value)
    if record.get("event") is not None:
        assert isinstance(record["event"], dict) and isinstance(record["event"]["type"], str)


def decode_or_error(line: bytes | str) -> dict | tls.TLSError:
    """tls.decode's verdict; any exception other than TLSError fails the test."""
    try:
        record = tls.decode(line, SOURCE, LINE)
    except tls.TLSError as error:
        assert (error.source, error.line) == (SOURCE, LINE)
        assert str(error).startswith(f"{SOURCE}:{LINE}: ") and error.message
        return error
    assert_sound(record)
    return record


# --------------------------------------------------------------------------------------------- tests

@settings(max_examples=examples(300))
@given(st.binary(max_size=200))
@example(DEEP_ARRAY)
@example(DEEP_OBJECT)
@example(b'{"timestamp": "nan"}')
@example(b'{"timestamp": "1e400"}')
@example(b'{"timestamp": 1e300}')
def test_arbitrary_bytes_are_a_record_or_an_error_naming_source_and_line(data):
    decode_or_error(data)


@settings(max_examples=examples(150))
@given(st.one_of(json_values, st.dictionaries(
    st.sampled_from(["timestamp", "step", "rank", "metrics", "hardware", "system", "event", "x"]),
    json_values, max_size=6)))
def test_arbitrary_json_is_a_record_or_an_error_naming_source_and_line(document):
    decode_or_error(json.dumps(document))


@settings(max_examples=examples(100))
@given(valid_records())
def test_valid_records_decode_to_what_was_written(pair):
    written, expected = pair
    for line in (tls.encode(written), json.dumps(written).encode()):
        record = decode_or_error(line)
        assert not isinstance(record, tls.TLSError), record
        assert same(record, expected), (record, expected)


@settings(max_examples=examples(200))
@given(st.data())
def test_mutated_valid_records_are_a_record_or_an_error(data):
    written, _ = data.draw(valid_records())
    line = tls.encode(written)
    if data.draw(st.booleans()):
        decode_or_error(data.draw(mutated_bytes(line)))
    else:
        decode_or_error(json.dumps(data.draw(mutated_json(written))))


@st.composite
def log_lines(draw) -> list[bytes]:
    """Lines of a TLS file: good records, damaged ones, garbage, blank lines."""
    kinds = st.sampled_from(["good", "mutated", "garbage", "blank"])
    lines = []
    for kind in draw(st.lists(kinds, max_size=12)):
        if kind == "blank":
            lines.append(draw(st.sampled_from([b"", b" ", b"\t", b"\r"])))
            continue
        good = tls.encode(draw(valid_records())[0]).rstrip(b"\n")
        if kind == "good":
            lines.append(good)
        elif kind == "mutated":
            lines.append(draw(mutated_bytes(good)))
        else:
            lines.append(draw(st.binary(max_size=60)))
    return lines


def check_file(path, data: bytes) -> None:
    """iter_lines over `path` (holding `data`, decompressed) reports every non-blank line exactly once."""
    raw_lines = _split_on_newline(data)
    expected = [(n, raw) for n, raw in enumerate(raw_lines, 1) if raw.strip()]
    got = list(tls.iter_lines(path))
    assert [line.lineno for line in got] == [n for n, _ in expected]
    for line, (_, raw) in zip(got, expected):
        check_line(line, str(path))
        if line.record is not None:
            assert same(line.record, tls.decode(raw))
        elif not raw.endswith(b"\n"):
            assert "truncated last line" in line.error.message


def _split_on_newline(data: bytes) -> list[bytes]:
    # Lines as a binary file iterates them: split on b"\n" only (bytes.splitlines also splits on \r ...).
    parts = data.split(b"\n")
    return [p + b"\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def check_line(line: tls.Line, source: str) -> None:
    assert line.source == source
    assert (line.record is None) != (line.error is None)
    if line.error is not None:
        assert isinstance(line.error, tls.TLSError)
        assert (line.error.source, line.error.line) == (source, line.lineno)
        assert str(line.error).startswith(f"{source}:{line.lineno}: ")
    else:
        assert_sound(line.record)


@settings(max_examples=examples(50))
@given(log_lines(), st.booleans())
def test_iter_lines_reports_every_line_once_by_number(tmp_path_factory, lines, final_newline):
    data = b"\n".join(lines) + (b"\n" if final_newline and lines else b"")
    path = tmp_path_factory.mktemp("tls") / "rank-0.jsonl"
    path.write_bytes(data)
    check_file(path, data)


@settings(max_examples=examples(40))
@given(log_lines(), st.sampled_from(["intact", "cut", "mutated", "garbage"]), st.data())
@example([b'{"timestamp": 1}'] * 3, "garbage", None)
def test_compressed_logs_intact_cut_or_damaged_never_raise(tmp_path_factory, lines, damage, data):
    plain = b"\n".join(lines) + b"\n"
    packed = gzip.compress(plain, mtime=0)
    if damage == "cut":
        packed = packed[:data.draw(st.integers(0, len(packed) - 1))]
    elif damage == "mutated":
        packed = data.draw(mutated_bytes(packed))
    elif damage == "garbage":
        packed = b"not gzip at all\n" + packed
    path = tmp_path_factory.mktemp("tls") / "rank-0.jsonl.gz"
    path.write_bytes(packed)
    if damage == "intact":
        check_file(path, plain)
        return
    got = list(tls.iter_lines(path))
    numbers = [line.lineno for line in got]
    assert numbers == sorted(set(numbers))
    for line in got:
        check_line(line, str(path))
    unreadable = [n for n, line in enumerate(got) if line.error and "unreadable after line" in line.error.message]
    assert unreadable in ([], [len(got) - 1])       # a broken stream ends the file with one error
    if damage == "garbage":
        assert unreadable and got[-1].lineno == 1


def test_a_missing_file_is_still_an_os_error(tmp_path):
    """Only the content is reported line by line; a file that is not there is the caller's error."""
    with pytest.raises(FileNotFoundError):
        list(tls.iter_lines(tmp_path / "rank-0.jsonl"))
