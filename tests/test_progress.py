"""Progress of long offline work (trainguard/progress.py): a line on stderr on a terminal, nothing when piped;
and each long command (report, diagnose, goodput, convert, checkpoint verify, replay) shows it."""

from __future__ import annotations

import io
import json

import pytest

from tests.formats.helpers import megatron_log
from tests.trainer.helpers import train
from trainguard import progress
from trainguard.cli import main


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_nothing_is_drawn_when_piped_or_quick(monkeypatch):
    monkeypatch.delenv(progress.ENV, raising=False)
    piped = io.StringIO()
    with progress.Progress("report", stream=piped, delay=0) as shown:
        shown.step(1, "rank-0.jsonl")
        list(shown.counted(range(3 * progress.CHECK_EVERY)))
    assert piped.getvalue() == ""
    quick = Terminal()
    with progress.Progress("report", stream=quick, delay=60) as shown:    # done before the delay
        shown.step(1, "rank-0.jsonl")
    assert quick.getvalue() == ""


def test_a_terminal_sees_one_line_redrawn_then_erased(monkeypatch):
    monkeypatch.delenv(progress.ENV, raising=False)
    screen = Terminal()
    with progress.Progress("diagnose", total=4, unit="logs", stream=screen, delay=0, interval=0) as shown:
        shown.file("RUN/tls/rank-1.jsonl", 1, 4)
        assert "\n" not in screen.getvalue()
        assert "diagnose: rank-1.jsonl (1 of 4 logs, 25%)" in screen.getvalue()
        list(shown.counted(range(progress.CHECK_EVERY)))
        assert f"{progress.CHECK_EVERY:,} records" in screen.getvalue()
    assert screen.getvalue().endswith("\r") and "\n" not in screen.getvalue()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("progress") / "run"
    assert train(run, "--steps", "3", "--checkpoint-every", "1") == 0
    return run


@pytest.mark.parametrize("command", ["report", "diagnose", "goodput", "checkpoint verify", "replay", "convert"])
def test_each_long_command_shows_progress_on_stderr_and_keeps_stdout_as_it_was(command, run_dir, tmp_path,
                                                                                monkeypatch, capsys):
    monkeypatch.setenv(progress.ENV, "1")                  # as on a terminal
    monkeypatch.setattr(progress.Progress.__init__, "__kwdefaults__",
                        {**progress.Progress.__init__.__kwdefaults__, "delay": 0.0, "interval": 0.0})
    argv = {"report": ["report", str(run_dir), "-o", str(tmp_path / "r.html")],
            "diagnose": ["diagnose", str(run_dir), "--json"],
            "goodput": ["goodput", str(run_dir), "--json"],
            "checkpoint verify": ["checkpoint", "verify", str(run_dir), "--json"],
            "replay": ["replay", str(run_dir), "--json"],
            "convert": ["convert", str(tmp_path / "megatron.log"), "-o", str(tmp_path / "out.jsonl")]}[command]
    if command == "convert":
        megatron_log(tmp_path / "megatron.log", steps=20)
    assert main(argv) in (0, 1)
    out, err = capsys.readouterr()
    assert f"\r{command}:" in err
    if "--json" in argv:
        json.loads(out)                                     # stdout is the answer alone
    monkeypatch.setenv(progress.ENV, "0")
    assert main(argv) in (0, 1)
    assert f"\r{command}:" not in capsys.readouterr().err     # no progress line (replay still names its policy)


def test_a_file_name_from_the_run_directory_cannot_act_on_the_terminal(monkeypatch):
    from trainguard import terminal

    screen = Terminal()
    with progress.Progress("report", stream=terminal.SafeStream(screen), delay=0, interval=0, enabled=True) as shown:
        shown.file("RUN/tls/rank-0\x1b[2J.jsonl", 0, 1)
    assert "\x1b" not in screen.getvalue() and "rank-0\\u001b[2J.jsonl" in screen.getvalue()
    assert screen.getvalue().startswith("\r")             # its own carriage return does reach the terminal
