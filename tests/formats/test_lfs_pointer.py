"""A Git LFS pointer where a log should be (a Trainer output cloned from the Hugging Face Hub without git-lfs,
whose `.gitattributes` stores `*tfevents*` with LFS): named as the pointer it is, with the size of the file it
stands for and how to fetch it, by every command that reads logs; never read as three malformed TLS lines."""

from __future__ import annotations

import json

import pytest

from trainguard import cli, formats
from trainguard.formats import discover, lfs_pointer

# The shape of git-lfs's docs/spec.md example, with the oid and size of a real Trainer event file
# (10844110/t5-summarization-demo's, /work/shared/real-logs/SOURCES.md).
POINTER = (b"version https://git-lfs.github.com/spec/v1\n"
           b"oid sha256:6f15599f0c1b7e3e4f6a8d3b2c1a0e9f8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a\n"
           b"size 1093412\n")
EVENT_FILE = "events.out.tfevents.1742826235.DESKTOP-41L2EO3.107869.0"


def trainer_output(tmp_path):
    """A Trainer `output_dir` as a clone without git-lfs leaves it: its event file is a pointer."""
    runs = tmp_path / "out" / "runs" / "Mar24_22-23-40_DESKTOP-41L2EO3"
    runs.mkdir(parents=True)
    (runs / EVENT_FILE).write_bytes(POINTER)
    return tmp_path / "out", runs / EVENT_FILE


def test_a_pointer_is_detected_by_its_content_under_any_name(tmp_path):
    for name in (EVENT_FILE, "trainer_state.json", "train.log", "rank-0.jsonl"):
        (tmp_path / name).write_bytes(POINTER)
        assert formats.detect(tmp_path / name) == formats.LFS_POINTER, name
    legacy = POINTER.replace(b"git-lfs.github.com", b"hawser.github.com")    # git-lfs 0.x pointers
    (tmp_path / "legacy").write_bytes(legacy)
    assert formats.detect(tmp_path / "legacy") == formats.LFS_POINTER


@pytest.mark.parametrize("text", [
    POINTER.replace(b"size 1093412", b"size many"),                   # no size in bytes
    POINTER.replace(b"oid ", b"hash "),                               # no oid
    b"version https://example.com/spec/v1\n" + POINTER.split(b"\n", 1)[1],   # another spec
    POINTER + b"\n" * 1024,                                           # not under 1024 bytes
    b"version 2.1\nSome text that happens to start like one\n",
])
def test_what_only_looks_like_a_pointer_is_not_one(tmp_path, text):
    path = tmp_path / "file"
    path.write_bytes(text)
    assert formats.detect(path) != formats.LFS_POINTER


def test_read_names_the_pointer_its_size_and_the_fix(tmp_path):
    _, event_file = trainer_output(tmp_path)
    (problem,) = formats.read(event_file)
    assert isinstance(problem, formats.Unmapped) and problem.file == str(event_file)
    assert "Git LFS pointer to a 1,093,412-byte file" in problem.error and "git lfs pull" in problem.error


def test_a_pointer_changed_after_detection_is_still_reported(tmp_path):
    path = tmp_path / "pointer"
    path.write_bytes(b"a log now\n")
    (problem,) = lfs_pointer.read(path)
    assert "not a Git LFS pointer" in problem.error


def test_replay_of_a_trainer_output_cloned_without_lfs_names_the_pointer(tmp_path, capsys):
    out, event_file = trainer_output(tmp_path)
    assert [log.path for log in discover.run_logs(out)] == [event_file]     # not "no logs in the folder"
    for target in (out, event_file):
        capsys.readouterr()
        assert cli.main(["replay", str(target), "--json"]) == 2
        err = capsys.readouterr().err
        assert "Git LFS pointer to a 1,093,412-byte file" in err and "git lfs pull" in err, err
        assert "not valid JSON" not in err


def test_convert_refuses_a_pointer_naming_it(tmp_path, capsys):
    _, event_file = trainer_output(tmp_path)
    assert cli.main(["convert", str(event_file), "-o", str(tmp_path / "out.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "Git LFS pointer" in err and not (tmp_path / "out.jsonl").exists()


def test_diagnose_lists_the_pointer_among_what_it_could_not_read(tmp_path, capsys):
    out, _ = trainer_output(tmp_path)
    cli.main(["diagnose", str(out), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert "Git LFS pointer" in json.dumps(report)
