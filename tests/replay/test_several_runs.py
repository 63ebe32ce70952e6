"""A folder of unrelated logs is several runs, each replayed alone (trainguard.formats.identity, replay/sections.py).

Synthetic logs in a tmp folder (always run): Hugging Face states of two fine-tunes, checkpoint copies of one,
Megatron logs of two runs and of one run's ranks, TensorBoard files of one writer and of two. The real
folders of ../shared/real-logs are in tests/replay/test_several_runs_real.py.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timedelta

import pytest

from trainguard import cli
from trainguard.formats import identity
from trainguard.replay import sections
from tests.formats.helpers import megatron_line


def state(path, losses: dict[int, float], summary: bool = False) -> None:
    """A trainer_state.json as the Trainer writes it (indented; NaN written as Python's json writes it)."""
    history = [{"epoch": step / 1000, "grad_norm": 1.0, "learning_rate": 1e-5, "loss": loss, "step": step}
               for step, loss in losses.items()]
    if summary:
        last = max(losses)
        history.append({"epoch": last / 1000, "step": last, "train_loss": 1.0, "train_runtime": 10.0})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"global_step": max(losses), "log_history": history}, indent=2))


def falling(first: int, last: int, every: int, start: float) -> dict[int, float]:
    return {step: start * (1 - 0.1 * step / last) for step in range(first, last + 1, every)}


def replay(*argv, capsys) -> tuple[int, dict | str]:
    capsys.readouterr()
    code = cli.main(["replay", *map(str, argv)])
    out = capsys.readouterr()
    if "--json" in argv and out.out:
        return code, json.loads(out.out)
    return code, out.out + out.err


# ------------------------------------------------------------------------------- trainer states

@pytest.fixture
def two_finetunes(tmp_path):
    """A loss near 1 over steps 10-500 and, in another repository's export, near 8 over 510-1000: read as
    one run, the second looks like the first's loss jumping eightfold."""
    state(tmp_path / "exports" / "a_trainer_state.json", falling(10, 500, 10, 1.0), summary=True)
    state(tmp_path / "exports" / "b_trainer_state.json", falling(510, 1000, 10, 8.0), summary=True)
    return tmp_path / "exports"


def test_two_unrelated_trainer_states_in_a_folder_are_two_runs_and_nothing_spikes(two_finetunes, capsys):
    code, report = replay(two_finetunes, "--json", capsys=capsys)
    assert code == 0
    assert [run["files"] for run in report["runs"]] == [[str(two_finetunes / "a_trainer_state.json")],
                                                        [str(two_finetunes / "b_trainer_state.json")]]
    assert [run["steps"] for run in report["runs"]] == [50, 50] and report["steps"] == 100
    assert report["actions"] == [] and all(run["actions"] == [] for run in report["runs"])
    # the design's keys are there, summed over the runs
    assert report["records"] == sum(run["records"] for run in report["runs"]) == 102
    assert report["malformed"] == 0 and report["alerts"] == [] and report["lead_rank"] is None
    assert report["without_clock"] == report["files"]


def test_the_same_two_states_read_as_one_run_spike_which_is_what_splitting_prevents(two_finetunes, capsys):
    code, report = replay(two_finetunes, "--json", "--one-run", capsys=capsys)
    assert code == 0 and "runs" not in report and report["steps"] == 100
    assert {action["step"] for action in report["actions"]} >= {510}       # the other run's first step
    assert {action["reason"] for action in report["actions"]} & {"loss_spike", "warmup_spike"}


def test_several_runs_in_the_human_form_are_a_section_each_named_by_file(two_finetunes, capsys):
    code, out = replay(two_finetunes, capsys=capsys)
    assert code == 0
    assert out.startswith("replay: 2 runs: these logs are not the ranks or copies of one run")
    assert f"  run 1: {two_finetunes / 'a_trainer_state.json'}\n" in out
    assert f"=== run 2 of 2: {two_finetunes / 'b_trainer_state.json'}\nreplay: 1 file, 51 records" in out
    assert out.count("actions: none") == 2


def test_an_action_of_several_runs_names_its_run(tmp_path, capsys):
    spiky = falling(10, 500, 10, 1.0)
    spiky[300] = 40.0
    state(tmp_path / "a" / "trainer_state.json", falling(10, 500, 10, 1.0))
    state(tmp_path / "b_trainer_state.json", spiky)
    code, report = replay(tmp_path / "a" / "trainer_state.json", tmp_path / "b_trainer_state.json", "--json",
                          capsys=capsys)
    assert code == 0 and len(report["runs"]) == 2
    assert [(a["run"], a["step"]) for a in report["actions"]] == [(2, 300)]
    assert [a["step"] for a in report["runs"][1]["actions"]] == [300] and report["runs"][0]["actions"] == []


def test_checkpoint_copies_are_one_run_read_from_the_longest_and_said_so(tmp_path, capsys):
    losses = falling(10, 900, 10, 2.0)
    losses[400] = math.nan                                  # a NaN is equal to itself in a copy
    out = tmp_path / "export"
    state(out / "trainer_state.json", losses, summary=True)
    for step in (300, 600):
        state(out / "run_output" / f"checkpoint-{step}" / "trainer_state.json",
              {s: loss for s, loss in losses.items() if s <= step})
    code, report = replay(out, "--json", capsys=capsys)
    assert code == 0 and "runs" not in report                # one run: the design's document as ever
    assert report["files"] == [str(out / "trainer_state.json")] and report["steps"] == 90
    (note,) = report["passed_over"]
    assert note.startswith(f"{out / 'run_output' / 'checkpoint-600' / 'trainer_state.json'}: passed over, an "
                           f"earlier copy of the run in {out / 'trainer_state.json'} (its 60 log_history entries "
                           "are the first of 91 there)")
    assert [a["step"] for a in report["actions"]] == [400]  # the NaN, once


def test_every_checkpoint_given_by_name_is_a_copy_of_the_newest(tmp_path):
    losses = falling(10, 300, 10, 2.0)
    paths = []
    for step in (100, 300, 200):
        paths.append(tmp_path / f"checkpoint-{step}" / "trainer_state.json")
        state(paths[-1], {s: loss for s, loss in losses.items() if s <= step})
    (run,) = identity.split(paths)
    assert run.files == (paths[1],)
    assert [(copy.path, copy.of, copy.entries) for copy in run.copies] == [(paths[2], paths[1], 20),
                                                                           (paths[0], paths[1], 10)]


def test_two_finetunes_resumed_from_one_checkpoint_are_two_runs_not_copies(tmp_path):
    shared = falling(10, 200, 10, 2.0)
    first = tmp_path / "seed1_trainer_state.json"
    second = tmp_path / "seed2_trainer_state.json"
    state(first, {**shared, **{s: 1.5 for s in range(210, 400, 10)}})
    state(second, {**shared, **{s: 1.6 for s in range(210, 400, 10)}})
    assert [run.files for run in identity.split([first, second])] == [(first,), (second,)]


def test_expect_and_keep_test_are_refused_for_several_runs_naming_them(two_finetunes, tmp_path, capsys):
    expectation = tmp_path / "expect.yml"
    expectation.write_text("none: true\n")
    code, out = replay(two_finetunes, "--expect", expectation, capsys=capsys)
    assert code == 2
    assert "--expect is about one run, and these inputs are 2 runs" in out
    assert f"run 1: {two_finetunes / 'a_trainer_state.json'}" in out and "--one-run" in out
    code, _ = replay(two_finetunes / "a_trainer_state.json", "--expect", expectation, capsys=capsys)
    assert code == 0                                         # one run: as ever


# ------------------------------------------------------------------------------- Megatron logs

def megatron_log(path, losses: dict[int, float], rank_tag: str = "") -> None:
    start = datetime(2026, 5, 1, 10, 0, 0)
    path.write_text("".join(f"{rank_tag}{megatron_line(i, 1000, loss, start + timedelta(seconds=i))}\n"
                            for i, loss in losses.items()))


def test_megatron_logs_of_two_runs_that_agree_at_first_and_part_later_are_two_runs(tmp_path, capsys):
    """Two jobs of one model and seed print the same first losses: every shared step is compared."""
    common = {i: 10.0 - i * 0.01 for i in range(1, 41)}
    megatron_log(tmp_path / "slurm-1.out", common)
    megatron_log(tmp_path / "slurm-2.out", {**common, **{i: 9.0 - i * 0.01 for i in range(20, 41)}})
    runs = sections.plan([str(tmp_path)])
    assert [section.inputs for section in runs] == [(str(tmp_path / "slurm-1.out"),), (str(tmp_path / "slurm-2.out"),)]


def test_megatron_rank_files_of_one_run_stay_one_run_read_once(tmp_path, capsys):
    losses = {i: 3.0 - i * 0.01 for i in range(1, 41)}
    for rank in range(3):
        megatron_log(tmp_path / f"log_rank{rank}.txt", losses, rank_tag=f"[default{rank}]: ")
    (run,) = identity.split(sorted(tmp_path.iterdir()))
    assert len(run.files) == 3 and run.why == "the same loss at each of the 40 steps they share (ranks' copies " \
                                              "of one run's steps)"
    code, report = replay(tmp_path, "--json", capsys=capsys)
    assert code == 0 and "runs" not in report and (report["steps"], report["duplicate_steps"]) == (40, 80)


def test_megatron_logs_without_a_step_in_common_are_two_runs(tmp_path):
    megatron_log(tmp_path / "a.log", {i: 3.0 for i in range(1, 11)})
    megatron_log(tmp_path / "b.log", {i: 3.0 for i in range(11, 21)})
    assert len(identity.split([tmp_path / "a.log", tmp_path / "b.log"])) == 2


def test_agreeing_losses_are_compared_to_float32s_precision_and_nan_equals_nan():
    assert identity.same_losses({1: 2.3456789, 2: math.nan}, {1: 2.3456791, 2: math.nan, 3: 1.0}) == 2
    assert identity.same_losses({1: 2.0, 2: 2.0}, {1: 2.0, 2: 2.1}) == 0
    assert identity.same_losses({1: 2.0}, {2: 2.0}) == 0


# ------------------------------------------------------------------------------- TensorBoard

def event_file(folder, losses: dict[int, float], name: str):
    """An event file as SummaryWriter writes one (tensorboard's own writer: torch's wraps it), renamed to
    `name`: its host and pid are what the name says."""
    pytest.importorskip("tensorboard")
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    scratch = folder / f"write-{name}"
    writer = EventFileWriter(str(scratch))
    for step, loss in losses.items():
        value = summary_pb2.Summary.Value(tag="train/loss", simple_value=loss)
        writer.add_event(event_pb2.Event(wall_time=1_700_000_000 + step, step=step,
                                         summary=summary_pb2.Summary(value=[value])))
    writer.close()
    (written,) = scratch.iterdir()
    written.rename(folder / name)
    scratch.rmdir()
    return folder / name


def test_event_files_of_one_writer_are_one_run_and_of_two_writers_with_other_losses_two(tmp_path):
    folder = tmp_path / "runs"
    folder.mkdir()
    train = event_file(folder, {s: 2.0 for s in range(1, 50)}, "events.out.tfevents.1700000000.node-1.lab.4242.0")
    evaluation = event_file(folder, {}, "events.out.tfevents.1700000100.node-1.lab.4242.1")
    other = event_file(folder, {s: 5.0 for s in range(1, 50)}, "events.out.tfevents.1700000000.node-2.4243.0")
    runs = identity.split([train, evaluation, other])
    assert [run.files for run in runs] == [(train, evaluation), (other,)]
    assert runs[0].why == "one TensorBoard writer's files (host node-1.lab, pid 4242)"


# ------------------------------------------------------------------------------- folders of exports

def test_a_folder_of_run_directories_is_a_run_each(tmp_path, capsys):
    from tests.replay.test_source import step_line

    for name, loss in (("exp1", 1.0), ("exp2", 9.0)):
        logs = tmp_path / name / "tls"
        logs.mkdir(parents=True)
        logs.joinpath("rank-0.jsonl").write_bytes(b"".join(step_line(s, 1_700_000_000 + s, loss=loss)
                                                           for s in range(1, 31)))
    code, report = replay(tmp_path, "--json", capsys=capsys)
    assert code == 0 and [run["files"] for run in report["runs"]] == [
        [str(tmp_path / name / "tls" / "rank-0.jsonl")] for name in ("exp1", "exp2")]
    assert [run["format"] for run in report["runs"]] == ["tls", "tls"]
    assert report["actions"] == [] and report["steps"] == 60



def test_run_directories_given_together_are_a_run_each_and_one_tls_folders_files_one_run(tmp_path, capsys):
    """`replay exp1 exp2` read both as one run: exp2's loss of 9 after exp1's 1 (the same steps again) was
    one run's loss jumping ninefold. A run's rank and node files named one by one stay one run."""
    from tests.replay.test_source import step_line

    for name, loss in (("exp1", 1.0), ("exp2", 9.0)):
        logs = tmp_path / name / "tls"
        logs.mkdir(parents=True)
        for rank in (0, 1):
            logs.joinpath(f"rank-{rank}.jsonl").write_bytes(b"".join(
                step_line(s, 1_700_000_000 + s, loss=loss) for s in range(1, 31)))
    code, report = replay(tmp_path / "exp1", tmp_path / "exp2", "--json", capsys=capsys)
    assert code == 0 and len(report["runs"]) == 2 and report["actions"] == [] and report["steps"] == 60
    code, merged = replay(tmp_path / "exp1", tmp_path / "exp2", "--json", "--one-run", capsys=capsys)
    assert code == 0 and "runs" not in merged and merged["steps"] == 30      # what it read before
    files = [tmp_path / "exp1" / "tls" / f"rank-{rank}.jsonl" for rank in (0, 1)]
    code, one = replay(*files, "--json", capsys=capsys)
    assert code == 0 and "runs" not in one and (one["steps"], one["duplicate_steps"]) == (30, 30)

def test_a_folder_without_any_log_at_any_level_is_refused(tmp_path, capsys):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "notes.txt").write_text("not a log\n")
    code, out = replay(tmp_path, capsys=capsys)
    assert code == 2 and "or its subfolders" in out


def test_each_log_is_converted_once_to_tell_the_runs_apart_and_to_replay_them(tmp_path, capsys, monkeypatch):
    from trainguard import formats

    megatron_log(tmp_path / "a.log", {i: 3.0 - i * 0.01 for i in range(1, 41)})
    megatron_log(tmp_path / "b.log", {i: 7.0 - i * 0.01 for i in range(1, 41)})
    read = []
    real_read = formats.read          # what converting a file and reading its losses for itself both call
    monkeypatch.setattr(formats, "read", lambda path, *a, **k: read.append(path) or real_read(path, *a, **k))
    code, report = replay(tmp_path, "--json", capsys=capsys)
    assert code == 0 and len(report["runs"]) == 2
    assert sorted(read) == [tmp_path / "a.log", tmp_path / "b.log"]


def test_a_run_without_records_among_others_is_named_and_only_all_empty_is_bad_input(tmp_path, capsys):
    state(tmp_path / "a_trainer_state.json", falling(10, 100, 10, 1.0))
    (tmp_path / "broken.log").write_text(" iteration        1/     100 | lm loss: 1.0.0E+00 |\n")
    code, out = replay(tmp_path, capsys=capsys)
    assert code == 0
    assert f"trainguard replay: run 2 of 2: no records in {tmp_path / 'broken.log'}: 1 malformed lines" in out
    assert f"=== run 2 of 2: {tmp_path / 'broken.log'}\nno records in" in out
    (tmp_path / "a_trainer_state.json").unlink()
    (tmp_path / "other.log").write_text(" iteration        1/     100 | lm loss: 2.0.0E+00 |\n")
    code, out = replay(tmp_path, capsys=capsys)
    assert code == 2 and out.count("no records in") == 2


def test_trainer_states_converted_to_tls_are_told_apart_as_the_states_are(two_finetunes, tmp_path, capsys):
    """`trainguard convert` each export, then replay the folder of what it wrote: still two runs, and a
    checkpoint's conversion is the first lines of the final state's."""
    converted = tmp_path / "converted"
    converted.mkdir()
    sources = {"a.jsonl": two_finetunes / "a_trainer_state.json", "b.jsonl": two_finetunes / "b_trainer_state.json"}
    for name, path in sources.items():
        assert cli.main(["convert", str(path), "-o", str(converted / name)]) == 0
    code, report = replay(converted, "--json", capsys=capsys)
    assert code == 0 and [run["files"] for run in report["runs"]] == [[str(converted / "a.jsonl")],
                                                                      [str(converted / "b.jsonl")]]
    assert report["actions"] == []
    lines = (converted / "a.jsonl").read_bytes().splitlines(keepends=True)
    (converted / "a-checkpoint.jsonl").write_bytes(b"".join(lines[:20]))        # an earlier conversion of run a
    code, report = replay(converted, "--json", capsys=capsys)
    assert code == 0 and len(report["runs"]) == 2
    assert report["runs"][0]["copies"] == [{"file": str(converted / "a-checkpoint.jsonl"),
                                            "copy_of": str(converted / "a.jsonl"), "entries": 20,
                                            "copy_of_entries": 51}]


def test_the_heading_names_each_file_of_a_run_of_several_and_why_they_are_one(tmp_path, capsys):
    losses = {i: 3.0 - i * 0.01 for i in range(1, 41)}
    for rank in range(2):
        megatron_log(tmp_path / f"job1_rank{rank}.log", losses, rank_tag=f"[default{rank}]: ")
    megatron_log(tmp_path / "job2.log", {i: 6.0 - i * 0.01 for i in range(1, 41)})
    code, out = replay(tmp_path, capsys=capsys)
    assert code == 0
    assert (f"  run 1: {tmp_path / 'job1_rank0.log'} and 1 more, one run: the same loss at each of the 40 steps "
            f"they share (ranks' copies of one run's steps)\n           {tmp_path / 'job1_rank1.log'}\n"
            f"  run 2: {tmp_path / 'job2.log'}\n") in out
    assert f"=== run 1 of 2: {tmp_path / 'job1_rank0.log'} (+1 more)\n" in out


def test_report_and_diagnose_refuse_a_folder_of_unrelated_runs_naming_them(two_finetunes, tmp_path, capsys):
    """They draw one run: two fine-tunes drawn as one were one loss curve jumping eightfold at step 510.
    Exit 2 with the runs named; one run's rank files still report as one."""
    for argv in (["report", str(two_finetunes), "-o", str(tmp_path / "r.html")], ["diagnose", str(two_finetunes)]):
        capsys.readouterr()
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "holds the logs of 2 runs" in err and "a_trainer_state.json" in err and "b_trainer_state.json" in err
        assert "Traceback" not in err
    assert not (tmp_path / "r.html").exists()
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    losses = {i: 3.0 - i * 0.01 for i in range(1, 41)}
    for rank in range(2):
        megatron_log(ranks / f"log_rank{rank}.txt", losses, rank_tag=f"[default{rank}]: ")
    assert cli.main(["report", str(ranks), "-o", str(tmp_path / "one.html")]) == 0
    assert cli.main(["diagnose", str(ranks), "--json"]) == 0
