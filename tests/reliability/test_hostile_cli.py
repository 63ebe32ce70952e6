"""The command line against hostile input: exit statuses, terminal escapes, refused arguments.

- Exit statuses (trainguard/exits.py): 0 ok, 1 an answer ("found something"), 2 bad input with a message
  naming file/line/field and no traceback, 70 a crash (one line; the traceback only with
  TRAINGUARD_DEBUG=1). Before, a crash exited 1: the status of "a checkpoint failed" or "a verdict differs".
- Text from the run directory is printed with its terminal control sequences escaped
  (trainguard/terminal.py): a clear-screen in an event no longer wipes the ATTENTION line above it.
- Arguments that cannot work are refused with exit 2 before anything is written.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.formats.helpers import megatron_log
from trainguard import terminal
from trainguard.cli import main
from trainguard.tls import Writer, event, make_record

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "tests" / "culprit" / "recorded" / "hang-evict" / "incidents"
T0 = 1_710_512_538.0
# ESC c (full reset), CSI 2J / 3J / H (clear screen and scrollback, cursor home), OSC 52 (write the
# clipboard), a C1 CSI, a carriage return, and a right-to-left override.
CLEAR = "\x1b[2J\x1b[3J\x1b[H\x1bc"
HOSTILE = CLEAR + "\x1b]52;c;ZWNobyBwd25lZA==\x07\x9b2J\r\u202egnp.exe"
RAW = ("\x1b", "\x07", "\x9b", "\r", "\u202e")


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """`trainguard ARGS` in this process: (exit status, stdout, stderr)."""
    try:
        code = main(list(args))
    except SystemExit as exc:       # argparse's own usage errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def shell(*args: str, env: dict | None = None, prelude: str = "") -> subprocess.CompletedProcess:
    """`trainguard ARGS` as a script sees it: a fresh interpreter, its real exit status."""
    code = f"{prelude}\nimport sys\nfrom trainguard.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, **(env or {})})


def assert_escaped(text: str) -> None:
    assert not any(c in text for c in RAW), repr(text)
    assert "\\u001b[2J" in text


# ------------------------------------------------------------------------------------- exit statuses

@pytest.mark.parametrize("command, module, args", [
    ("checkpoint", "trainguard.runtime.checkpoint.cli", ["checkpoint", "verify", "RUN"]),
    ("incidents", "trainguard.incidents.cli", ["incidents", "replay", "RUN"]),
    ("convert", "trainguard.formats.cli", ["convert", "IN", "-o", "OUT"]),
    ("replay", "trainguard.replay.cli", ["replay", "RUN"]),
    ("status", "trainguard.report.status_cli", ["status", "RUN"]),
])
def test_a_crash_exits_70_with_one_line_and_never_1(command, module, args):
    # The command's own work raises what it did not expect (as `checkpoint verify` did when retention
    # deleted a file under it): a crash, whose status no answer uses.
    prelude = (f"import {module} as m\n"
               "def run(args):\n    raise FileNotFoundError(2, 'No such file or directory', 'step_40/model.pt')\n"
               "m.run = run")
    done = shell(*args, prelude=prelude)
    assert done.returncode == 70, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert done.stderr.startswith(f"trainguard {command}: internal error: FileNotFoundError")
    assert "TRAINGUARD_DEBUG=1" in done.stderr
    debug = shell(*args, prelude=prelude, env={"TRAINGUARD_DEBUG": "1"})
    assert debug.returncode == 70 and "Traceback (most recent call last)" in debug.stderr


def test_answers_keep_1_and_bad_input_is_2_without_a_traceback(tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(RECORDED, run / "incidents")
    [incident] = os.listdir(run / "incidents")
    verdict = run / "incidents" / incident / "incident.json"
    data = json.loads(verdict.read_text())
    # incidents replay: a verdict that differs is an answer, 1
    verdict.write_text(json.dumps({**data, "culprit": {"rank": 0, "node": "n1", "ranks": [0]}}))
    assert cli(capsys, "incidents", "replay", str(run))[0] == 1
    # ... a verdict file of the wrong shape is bad input, 2, naming file and field
    verdict.write_text(json.dumps({**data, "culprit": {"rank": 1, "node": "n2", "ranks": [[1]]}}))
    for action in ("show", "replay"):
        code, _, err = cli(capsys, "incidents", action, str(run), incident)
        assert code == 2 and "incident.json: field 'culprit.ranks'" in err and "Traceback" not in err


@pytest.mark.parametrize("ranks", [["x"], 5, {"1e400": {}}, {"-1": {}}, {"99999999999999999999999": {}}])
def test_odd_node_files_cost_their_ranks_never_the_verdict(tmp_path, capsys, monkeypatch, ranks):
    """The agent's live verdict and `incidents replay` read node files through agent/evidence.load. The odd
    file is signed (an agent's own bug, not a stranger's file: that one is refused before its ranks are read)."""
    from tests.culprit.test_recorded import signed_copy
    from trainguard import incidents
    from trainguard.agent import evidence
    from trainguard.decide import culprit
    from trainguard.runtime.checkpoint import keys

    key_path = tmp_path / "keys" / "checkpoint.key"
    monkeypatch.setenv(keys.ENV_VAR, str(key_path))
    key = keys.load_key(key_path, create=True)
    run = signed_copy("hang-evict", tmp_path, key)
    [incident] = os.listdir(run / "incidents")
    node = run / "incidents" / incident / "node-n2.json"
    node.write_text(json.dumps(incidents.sign_node(key, incident, "n2", {"ranks": ranks, "xids": [5, "x"],
                                                                          "gpus_lost": 7}, {})))
    ranks_seen, nodes = evidence.load(run, incident, key)
    assert [r.rank for r in ranks_seen] == [0]              # n2's entries were not ranks
    assert culprit.decide(ranks_seen, nodes).confidence >= 0
    code, out, err = cli(capsys, "incidents", "replay", str(run), incident)
    assert code == 1 and "DIFFERS" in out and "Traceback" not in err   # rank 1's evidence is gone: an answer
    assert cli(capsys, "incidents", "show", str(run), incident)[0] == 0


def test_a_step_beyond_int64_is_a_malformed_line_in_replay_and_diagnose(tmp_path, capsys):
    with Writer(tmp_path / "tls" / "rank-0.jsonl") as writer:
        for step in range(1, 31):
            writer.write(make_record(step=step, timestamp=T0 + step, rank=0, metrics={
                "loss": 2.0, "grad_norm": 1.0, "step_time_seconds": 0.5}))
    with open(tmp_path / "tls" / "rank-0.jsonl", "a") as log:
        log.write(json.dumps({"timestamp": T0 + 31, "rank": 0, "step": 2**63, "metrics": {"loss": 2.0}}) + "\n")
        log.write(json.dumps({"timestamp": T0 + 32, "rank": 0, "step": 10**30, "metrics": {"loss": 2.0}}) + "\n")
    code, out, err = cli(capsys, "replay", str(tmp_path), "--json")
    assert code == 0 and json.loads(out)["malformed"] == 2, err
    code, out, err = cli(capsys, "replay", str(tmp_path))
    assert "rank-0.jsonl:31: step: 9223372036854775808 is outside a 64-bit integer" in out + err
    code, out, err = cli(capsys, "diagnose", str(tmp_path), "--json")
    assert code in (0, 1) and "Traceback" not in err and json.loads(out)


# ---------------------------------------------------------------------------------- terminal escapes

def test_escape_shows_every_control_and_bidi_character_and_keeps_newlines():
    assert terminal.escape("a\x1b[2Jb\n\tc\x9b\u202e\u2066\x7f") == "a\\u001b[2Jb\n\tc\\u009b\\u202e\\u2066\\u007f"
    assert terminal.escape("naïve ∆ 日本 🙂") == "naïve ∆ 日本 🙂"
    assert json.loads(terminal.escape(json.dumps({"a": "\x9b\u202e"}, ensure_ascii=False))) == {"a": "\x9b\u202e"}


def hostile_run(root: Path) -> Path:
    """A run whose agent paged a human, then a stranger's event with a clear-screen in every field."""
    with Writer(root / "tls" / "rank-0.jsonl") as writer:
        for step in range(1, 21):
            writer.write(make_record(step=step, timestamp=T0 + step, rank=0, metrics={"loss": 2.0, "grad_norm": 1.0}))
    with Writer(root / "tls" / "node-a-actions.jsonl") as writer:
        writer.write(event("action", timestamp=T0 + 21, action="restore", outcome="paged",
                           paged={"reason": "no_restarts_left", "ranks": [0, 1]}))
        writer.write(event("alert", step=20, timestamp=T0 + 22, alertname="LossNaN" + HOSTILE, status="firing",
                           action="rollback", reason=HOSTILE))
        writer.write(event("skip_step" + HOSTILE, step=20, timestamp=T0 + 23, reason=HOSTILE))
    return root


def test_status_escapes_run_directory_text_and_the_paged_line_survives(tmp_path, capsys):
    code, out, err = cli(capsys, "status", str(hostile_run(tmp_path)))
    assert code == 0, err
    assert_escaped(out)
    assert "ATTENTION" in out and "restore NOT done, a human is paged: no_restarts_left" in out
    assert "FIRING LossNaN\\u001b[2J" in out


def test_replay_escapes_event_text(tmp_path, capsys):
    code, out, err = cli(capsys, "replay", str(hostile_run(tmp_path)))
    assert code == 0, err
    assert_escaped(out + err)
    assert "LossNaN\\u001b[2J" in out


def test_incidents_escape_verdict_text(tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(RECORDED, run / "incidents")
    [incident] = os.listdir(run / "incidents")
    verdict = run / "incidents" / incident / "incident.json"
    data = json.loads(verdict.read_text())
    verdict.write_text(json.dumps({**data, "detected_by": "agent:" + HOSTILE, "reasons": [HOSTILE, *data["reasons"]],
                                   "culprit": {**data["culprit"], "node": "n2" + CLEAR}}))
    (run / "incidents" / incident / "rank-1.stack.txt").write_text(f'Thread 1 (idle): "MainThread"\n    {HOSTILE}\n')
    for args in (("incidents", str(run)), ("incidents", "show", str(run), incident)):
        code, out, err = cli(capsys, *args)
        assert_escaped(out + err)
        assert "n2\\u001b[2J" in out


# ------------------------------------------------------------------------------------ refused arguments

@pytest.mark.parametrize("flags, named", [
    (["--nproc", "0"], "argument --nproc: must be at least 1, got 0"),
    (["--max-restarts", "-1"], "argument --max-restarts: must be at least 0, got -1"),
    (["--lr", "-1"], "optim.lr: must be a finite number above 0, got -1.0"),
    (["--lr", "nan"], "optim.lr: must be a finite number above 0, got nan"),
    (["--keep-last", "0"], "run.keep_last: must be at least 1, got 0"),
    (["--set", "model.n_layer=-1"], "model.n_layer: must be at least 1"),
    (["--nproc", "2", "--inject", "slowrank@3:2"], "rank 2 is outside the job's world of 2 rank(s)"),
    (["--inject", "hang@3:1"], "rank 1 is outside the job's world of 1 rank(s)"),
    (["--data", "/nonexistent/shards/*.bin"], "matches no directory or .bin files"),   # before: a crash in the rank
])
def test_train_refuses_arguments_that_cannot_work_before_writing_anything(tmp_path, capsys, flags, named):
    run = tmp_path / "run"
    code, _, err = cli(capsys, "train", "--run-dir", str(run), "--device", "cpu", "--steps", "2", *flags)
    assert code == 2 and named in err and "Traceback" not in err
    assert not run.exists()


def test_train_refuses_a_config_file_with_a_negative_layer_count_naming_file_and_key(tmp_path, capsys):
    config = tmp_path / "model.yaml"
    config.write_text("model: {n_layer: -1}\n")
    code, _, err = cli(capsys, "train", "--run-dir", str(tmp_path / "run"), "--device", "cpu", "--config", str(config))
    assert code == 2 and f"{config}: model.n_layer: must be at least 1" in err


def test_train_refuses_a_run_directory_whose_name_is_not_utf8(tmp_path, capsys):
    run = os.fsdecode(os.fsencode(tmp_path) + b"/run\xff")
    code, _, err = cli(capsys, "train", "--run-dir", run, "--device", "cpu", "--steps", "1")
    assert code == 2 and "run\\xff: the path is not valid UTF-8" in err and "Traceback" not in err


def test_checkpoint_restore_to_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "run" / "checkpoints" / "step_1").mkdir(parents=True)
    target = tmp_path / "target.txt"
    target.write_text("mine\n")
    code, _, err = cli(capsys, "checkpoint", "restore", str(tmp_path / "run"), "--to", str(target))
    assert code == 2 and f"--to {target}: is a regular file, not a run directory" in err
    assert target.read_text() == "mine\n"


def test_convert_never_writes_over_its_input_nor_into_a_directory(tmp_path, capsys):
    log = tmp_path / "megatron.log"
    megatron_log(log, steps=20)
    original = log.read_bytes()
    (tmp_path / "link.log").symlink_to(log)
    os.link(log, tmp_path / "hard.log")
    for output in (log, tmp_path / "link.log", tmp_path / "hard.log"):
        code, _, err = cli(capsys, "convert", str(log), "-o", str(output))
        assert code == 2 and "is the input" in err and "would destroy it" in err
        assert log.read_bytes() == original
    (tmp_path / "out").mkdir()
    code, _, err = cli(capsys, "convert", str(log), "-o", str(tmp_path / "out"))
    assert code == 2 and "is a directory" in err and "Traceback" not in err
    assert cli(capsys, "convert", str(log), "-o", str(tmp_path / "out" / "run.jsonl"))[0] == 0
    assert not list(tmp_path.glob("**/*.partial"))


def test_status_json_is_valid_json_with_a_nan_loss(tmp_path, capsys):
    with Writer(tmp_path / "tls" / "rank-0.jsonl") as writer:
        for step, loss in ((1, 2.0), (2, float("nan")), (3, float("inf"))):
            writer.write(make_record(step=step, timestamp=T0 + step, rank=0, metrics={"loss": loss, "grad_norm": 1.0}))
    code, out, _ = cli(capsys, "status", str(tmp_path), "--json")
    data = json.loads(out, parse_constant=lambda name: pytest.fail(f"bare {name} in status --json"))
    assert code == 0 and data["metrics"]["loss"] == "Infinity"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_bar_and_log_colours_still_reach_a_terminal_and_logged_values_are_escaped(monkeypatch):
    from trainguard import log
    from trainguard.trainer.progress import Progress

    screen = _Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    monkeypatch.delenv("TRAINGUARD_LOG_JSON", raising=False)
    try:
        with terminal.safe_streams():
            log.configure()
            log.get("test").warning("alert", alertname="LossNaN" + CLEAR)
            bar = Progress(total=10, log_every=1, log=None)
            bar.update(10, 1.0, 1e-3, 1000.0)
            bar.close()
    finally:
        log.configure(json=True, stream=sys.__stderr__)
    text = screen.getvalue()
    assert "\r[" in text and "step 10/10" in text              # the bar's own carriage return
    assert "\x1b[" in text                                     # the renderer's own colours
    assert "LossNaN\\u001b[2J" in text and "\x1b[2J" not in text and "\x1bc" not in text


@pytest.mark.parametrize("flags, named", [
    (["--tail-kib", "0"], "argument --tail-kib: must be at least 1, got 0"),     # before: read 0 bytes, forever
    (["--tail-kib", "-5"], "argument --tail-kib: must be at least 1, got -5"),   # before: OSError traceback
    (["--events", "-1"], "argument --events: must be at least 0, got -1"),
])
def test_status_refuses_window_sizes_that_cannot_work(tmp_path, capsys, flags, named):
    hostile_run(tmp_path)
    code, _, err = cli(capsys, "status", str(tmp_path), *flags)
    assert code == 2 and named in err


def test_report_into_a_directory_is_refused_and_leaves_nothing(tmp_path, capsys):
    hostile_run(tmp_path / "run")
    (tmp_path / "out").mkdir()
    code, _, err = cli(capsys, "report", str(tmp_path / "run"), "-o", str(tmp_path / "out"))
    assert code == 2 and "is a directory" in err
    assert list((tmp_path / "out").iterdir()) == [] and not list(tmp_path.glob(".*.tmp"))
