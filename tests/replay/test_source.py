"""Replay input: file forms, merging by time, lenient records and malformed lines (trainguard.replay.source)."""

import gzip
import json
import math
import random

import pytest
import zstandard

from trainguard import tls
from trainguard.replay import source

SEED = ('{"timestamp": "2024-03-15T14:22:18Z", "metrics": {"loss": 2.356, "grad_norm": 0.87, '
        '"learning_rate": 1e-5}, "hardware": {"gpu_util": "78%", "mem_util": "62%"}, "system": '
        '{"last_checkpoint": "step_125000", "data_throughput": "18GB/s"}}')
T0 = 1_710_512_538.0


def step_line(step, when, loss=2.0, grad_norm=1.0, **envelope) -> bytes:
    return tls.encode({"timestamp": tls.format_timestamp(when), "step": step, **envelope,
                       "metrics": {"loss": loss, "grad_norm": grad_norm}})


def read(*paths, full=False):
    stream = source.Stream(paths, full=full)
    entries = list(stream)
    return stream, entries


def test_seed_example_form_is_a_step_with_its_units_read(tmp_path):
    log = tmp_path / "seed.jsonl"
    log.write_text(SEED + "\n" + SEED.replace("14:22:18", "14:22:19") + "\n")
    stream, entries = read(log)
    assert stream.malformed == 0
    assert [e[0] for e in entries] == [T0, T0 + 1]
    assert [e[3].step for e in entries] == [1, 2]          # no step in the seed form: numbered in file order
    assert entries[0][3].metrics.loss == 2.356 and entries[0][3].metrics.grad_norm == 0.87
    _, full = read(log, full=True)
    assert full[0][4]["hardware"] == {"gpu_util": 78.0, "mem_util": 62.0}
    assert full[0][4]["system"]["data_throughput"] == 18e9


def test_records_without_step_follow_the_last_step_of_their_file(tmp_path):
    log = tmp_path / "mixed.jsonl"
    lines = [step_line(10, T0),
             b'{"timestamp": %d, "metrics": {"loss": 2.0, "grad_norm": 1.0}}\n' % (T0 + 1),
             b'{"timestamp": %d, "hardware": {"gpu_temp_c": 70}}\n' % (T0 + 2),
             b'{"timestamp": %d, "event": {"type": "checkpoint_saved"}}\n' % (T0 + 3)]
    log.write_bytes(b"".join(lines))
    _, entries = read(log)
    assert [e[3].step for e in entries] == [10, 11, None, None]   # hardware and events are not steps


def test_nan_and_infinity_literals_are_floats(tmp_path):
    log = tmp_path / "nan.jsonl"
    log.write_text('{"timestamp": 1, "step": 1, "metrics": {"loss": NaN, "grad_norm": Infinity}}\n'
                   '{"timestamp": 2, "step": 2, "metrics": {"loss": -Infinity, "grad_norm": 1.0}}\n')
    stream, entries = read(log)
    assert stream.malformed == 0
    first, second = entries[0][3].metrics, entries[1][3].metrics
    assert math.isnan(first.loss) and first.grad_norm == math.inf and second.loss == -math.inf


def test_truncated_last_line_is_reported_not_fatal(tmp_path):
    log = tmp_path / "cut.jsonl"
    log.write_bytes(step_line(1, T0) + step_line(2, T0 + 1) + step_line(3, T0 + 2)[:25])
    stream, entries = read(log)
    assert [e[3].step for e in entries] == [1, 2]
    assert stream.malformed == 1
    problem = stream.problems.kept[0]
    assert (problem.file, problem.line) == (str(log), 3)
    assert problem.error.startswith("truncated last line")


def test_a_whole_last_line_without_newline_is_a_record(tmp_path):
    log = tmp_path / "no-newline.jsonl"
    log.write_bytes(step_line(1, T0) + step_line(2, T0 + 1).rstrip(b"\n"))
    stream, entries = read(log)
    assert [e[3].step for e in entries] == [1, 2] and stream.malformed == 0


@pytest.mark.parametrize("suffix", ["", ".gz", ".zst"])
def test_plain_gzip_and_zstd_read_alike(tmp_path, suffix):
    data = b"".join(step_line(step, T0 + step) for step in range(1, 2001))
    log = tmp_path / f"rank-0.jsonl{suffix}"
    if suffix == ".gz":
        log.write_bytes(gzip.compress(data))
    elif suffix == ".zst":
        log.write_bytes(zstandard.ZstdCompressor().compress(data))
    else:
        log.write_bytes(data)
    stream, entries = read(log)
    assert stream.malformed == 0
    assert [e[3].step for e in entries] == list(range(1, 2001))


def test_files_merge_by_time_and_ties_keep_the_given_order(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_bytes(b"".join(step_line(s, T0 + s * 2) for s in range(5)))          # 0 2 4 6 8
    b.write_bytes(b"".join(step_line(100 + s, T0 + s * 3) for s in range(4)))    # 0 3 6 9
    _, entries = read(a, b)
    times = [e[0] - T0 for e in entries]
    assert times == sorted(times)
    assert [(e[0] - T0, e[1]) for e in entries if e[0] - T0 in (0, 6)] == [(0, 0), (0, 1), (6, 0), (6, 1)]


def test_merging_many_long_files_streams(tmp_path):
    """Three files, one block each at a time: every record once, in time order, from a generator."""
    paths = []
    for index in range(3):
        path = tmp_path / f"rank-{index}.jsonl.gz"
        path.write_bytes(gzip.compress(b"".join(step_line(s, T0 + s + index / 10, rank=index)
                                                for s in range(20_000))))
        paths.append(path)
    stream = source.Stream(paths)
    iterator = iter(stream)
    assert not isinstance(iterator, list)
    count, previous = 0, -math.inf
    for when, *_ in iterator:
        assert when >= previous
        previous, count = when, count + 1
    assert count == 60_000 and stream.lead_rank == 0


def test_malformed_lines_are_counted_with_file_and_line(tmp_path):
    log = tmp_path / "bad.jsonl"
    good = [step_line(s, T0 + s) for s in range(1, 3001)]
    good[9] = b"not json at all\n"
    good[1499] = b'{"step": 1500, "metrics": {"loss": 1.0}}\n'                          # no timestamp
    good[2999] = b'{"timestamp": "yesterday", "step": 3000}\n'
    good.insert(100, b"\n")                                                           # blank: skipped
    log.write_bytes(b"".join(good))
    stream, entries = read(log)
    assert len(entries) == 2997 and stream.malformed == 3
    found = [(m.file, m.line) for m in stream.problems.kept]
    assert found == [(str(log), 10), (str(log), 1501), (str(log), 3001)]
    assert "timestamp" in stream.problems.kept[1].error and "yesterday" in stream.problems.kept[2].error
    # the lenient reader agrees, line for line
    _, full = read(log, full=True)
    assert len(full) == 2997


def test_a_value_replay_cannot_use_is_malformed_naming_the_field(tmp_path):
    log = tmp_path / "types.jsonl"
    log.write_text('{"timestamp": 1, "step": 1, "metrics": {"loss": 1.0, "grad_norm": 1.0, '
                   '"grad_norm_by_layer": {"h.0": "big"}}}\n')
    stream, entries = read(log)
    assert entries == [] and stream.malformed == 1
    assert "grad_norm_by_layer" in stream.problems.kept[0].error


def test_run_directory_means_its_tls_logs(tmp_path):
    (tmp_path / "tls").mkdir()
    (tmp_path / "tls" / "rank-1.jsonl").write_bytes(step_line(1, T0 + 0.5, rank=1))
    (tmp_path / "tls" / "rank-0.jsonl").write_bytes(step_line(1, T0, rank=0))
    (tmp_path / "tls" / "node-a.jsonl.1.gz").write_bytes(gzip.compress(step_line(1, T0 + 0.7)))
    (tmp_path / "checkpoints").mkdir()
    stream, entries = read(tmp_path)
    assert [p.name for p in stream.files] == ["node-a.jsonl.1.gz", "rank-0.jsonl", "rank-1.jsonl"]
    assert len(entries) == 3 and stream.lead_rank == 0


def test_missing_input_is_a_clear_error(tmp_path):
    with pytest.raises(source.InputError, match="no such file"):
        source.Stream([tmp_path / "nope.jsonl"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(source.InputError, match="no TLS logs"):
        source.Stream([tmp_path / "empty"])


def test_malformed_details_are_capped_but_all_counted(tmp_path, monkeypatch):
    monkeypatch.setattr(source, "MAX_MALFORMED_KEPT", 5)
    log = tmp_path / "junk.jsonl"
    log.write_bytes(b"".join(b"junk %d\n" % i for i in range(50)) + step_line(1, T0))
    stream, entries = read(log)
    assert len(entries) == 1 and stream.malformed == 50 and len(stream.problems.kept) == 5
    assert json.dumps([str(m) for m in stream.problems.kept])   # printable


@pytest.mark.parametrize("full", [False, True])
def test_a_cut_off_gzip_keeps_what_was_read_and_reports_the_rest(tmp_path, full):
    data = b"".join(step_line(step, T0 + step) for step in range(1, 50_001))
    compressed = gzip.compress(data)
    log = tmp_path / "rank-0.jsonl.gz"
    log.write_bytes(compressed[: len(compressed) // 2])
    stream, entries = read(log, full=full)
    assert 10_000 < len(entries) < 50_000
    assert [e[3].step for e in entries] == list(range(1, len(entries) + 1))
    assert stream.malformed == 1
    problem = stream.problems.kept[0]
    assert problem.file == str(log) and problem.line > len(entries)
    assert "unreadable after line" in problem.error and "EOFError" in problem.error


def _steps(n):
    return "".join(json.dumps({"timestamp": 1_700_000_000 + i, "step": i + 1,
                               "metrics": {"loss": 2.0, "grad_norm": 1.0}}) + "\n" for i in range(n))


@pytest.mark.parametrize("full", [False, True], ids=["plain", "rules"])
def test_a_truncated_gz_yields_every_line_before_the_cut_on_both_paths(tmp_path, full):
    data = gzip.compress(_steps(400).encode())
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(data[: len(data) * 3 // 4])
    readable = sum(1 for line in tls.iter_lines(path) if line.record is not None)
    stream = source.Stream([path], full=full)
    records = [entry[3] for entry in stream]
    assert readable > 100 and len(records) == readable
    assert [r.step for r in records] == list(range(1, readable + 1))
    assert stream.malformed == 1


def test_a_line_nested_past_the_recursion_limit_is_one_malformed_line_on_the_plain_path(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text(_steps(2) + '{"timestamp": 1, "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n" + _steps(1))
    stream = source.Stream([path])
    assert len(list(stream)) == 3 and stream.malformed == 1


def test_a_line_many_blocks_long_comes_whole_in_one_block(tmp_path):
    """line_blocks gathers a long line's pieces and joins them once (bench: docs/benchmarks.md is not
    needed for this: adding each piece to the last was quadratic, 12 s for one 50 MB line)."""
    import io

    long_line = b'{"timestamp": 1, "x": "' + b"a" * (40 * source.BLOCK_BYTES) + b'"}\n'
    data = _steps(3).encode() + long_line + _steps(2).encode()
    blocks = list(source.line_blocks(io.BytesIO(data)))
    assert b"".join(blocks) == data and all(block.endswith(b"\n") for block in blocks)
    assert any(long_line in block for block in blocks)


def test_a_device_or_fifo_is_named_as_such_not_as_missing(tmp_path):
    import os

    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    for path in ("/dev/zero", str(fifo)):
        with pytest.raises(source.InputError, match="not a regular file"):
            source.expand([path])
    with pytest.raises(source.InputError, match="no such file or directory"):
        source.expand([tmp_path / "absent.jsonl"])


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_lines_naming_finds_the_lines_a_line_by_line_search_finds(tmp_path, monkeypatch, suffix):
    """The recorded pass's byte search (source.lines_naming) over blocks cut anywhere, a last line without
    a newline included: the same (line number, line) as testing every line."""
    rng = random.Random(4)
    marks = (b'"run_start"', b'"alert"')
    kinds = [b'{"a":1}\n', b'{"event":{"type":"alert"}}\n', b'{"x":"alert","y":"run_start"}\n', b'\n']
    data = b"".join(rng.choice(kinds) for _ in range(3000)) + b'{"last":"alert"}'
    path = tmp_path / f"log.jsonl{suffix}"
    path.write_bytes(gzip.compress(data) if suffix else data)
    want = [(n, raw) for n, raw in enumerate(data.splitlines(keepends=True), 1) if any(m in raw for m in marks)]
    for size in (5, 333, 1 << 20):
        monkeypatch.setattr(source, "SCAN_BYTES", size)
        assert list(source.lines_naming(path, marks)) == want
    assert source.head_names(path, b'"run_start"', 3000) and not source.head_names(path, b'"nowhere"', 3000)
