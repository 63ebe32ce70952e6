"""The real folders of ../shared/real-logs (SOURCES.md) replayed as folders: unrelated runs apart, one run's
files together. Skipped with the reason where the folder is absent (TRAINGUARD_REAL_LOGS reads it from
elsewhere); the synthetic cases that always run are in tests/replay/test_several_runs.py.
"""

from __future__ import annotations

import json

import pytest

from trainguard import cli
from tests.formats.test_real_logs import REAL

pytestmark = pytest.mark.skipif(REAL is None or not REAL.is_dir(),
                                reason="the real logs (../shared/real-logs, or TRAINGUARD_REAL_LOGS) are not here")

HF_STATES = ["10844110_t5-summarization-demo_trainer_state.json", "Dheena731_tinyLlama-finetune_trainer_state.json",
             "Jaong_Checkpoint-of-CPT_trainer_state.json", "aigoncharov_trainer_state_viz_trainer_state.json",
             "syGOAT_Mistral-v0.2-Translator-bf16_trainer_state.json"]


def replay_json(*argv, capsys) -> dict:
    capsys.readouterr()
    assert cli.main(["replay", *map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_hf_folder_is_five_runs_and_only_t5s_grad_norm_spike_acts(capsys):
    """Read as one run, the five fine-tunes made dozens of loss_spike skips and rollbacks; each alone, the one
    event in them is the T5 run's gradient norm at 190000 (14.7x its median)."""
    report = replay_json(REAL / "hf", capsys=capsys)
    assert [run["files"] for run in report["runs"]] == [[str(REAL / "hf" / name)] for name in HF_STATES]
    assert [(a["run"], a["step"], a["action"], a["reason"]) for a in report["actions"]] == [
        (1, 190000, "skip_step", "grad_explosion")]
    assert [run["steps"] for run in report["runs"]] == [430, 186, 10, 30, 866]
    # the T5 run's TensorBoard file has a clock: its 55 minutes from the last logged step to the closing
    # summary are the end of the run, not a stall to restore (decide/stall.py's ENDED_EVENTS)
    tensorboard = replay_json(REAL / "tensorboard" / "t5-summarization-demo_runs", capsys=capsys)
    assert [(a["step"], a["action"], a["reason"]) for a in tensorboard["actions"]] == [
        (190000, "skip_step", "grad_explosion")]
    assert {run["format"] for run in report["runs"]} == {"hf_trainer_state"}
    assert report["malformed"] == 0 and report["duplicate_steps"] == 0
    # the Trainer output folder beside them is the Mistral run again: its newest checkpoint passed over
    output = REAL / "hf" / "syGOAT_Mistral-v0.2-Translator-bf16_output"
    assert report["runs"][4]["copies"] == [{"file": str(output / "checkpoint-8500" / "trainer_state.json"),
                                            "copy_of": str(REAL / "hf" / HF_STATES[4]),
                                            "entries": 850, "copy_of_entries": 867}]
    assert report["passed_over"][0].startswith(f"{output / 'checkpoint-8500' / 'trainer_state.json'}: passed over")
    merged = replay_json(REAL / "hf", "--one-run", capsys=capsys)            # what the folder did before
    assert sum(a["reason"] == "loss_spike" for a in merged["actions"]) == 285


def test_every_checkpoint_of_the_output_folder_given_by_name_is_one_run(capsys):
    output = REAL / "hf" / "syGOAT_Mistral-v0.2-Translator-bf16_output"
    states = [output / f"checkpoint-{step}" / "trainer_state.json" for step in (500, 5000, 8500)]
    report = replay_json(*states, capsys=capsys)
    assert "runs" not in report and report["files"] == [str(states[2])] and report["records"] == 850
    assert len(report["passed_over"]) == 2


def test_the_megatron_folder_is_a_run_per_log_each_deciding_as_alone(capsys):
    """Twelve logs of nine jobs (the 104B chronicle's excerpts share no iteration): read as one run they
    were 15 steps decided of 463 and stall restores across 463,115 hours; each alone is what it says."""
    report = replay_json(REAL / "megatron", capsys=capsys)
    logs = sorted(path for path in (REAL / "megatron").iterdir())
    assert [run["files"] for run in report["runs"]] == [[str(path)] for path in logs]
    assert report["duplicate_steps"] == 0 and report["steps"] == 434
    for run, path in zip(report["runs"], logs):
        alone = replay_json(path, capsys=capsys)
        assert [(a["step"], a["action"], a["reason"]) for a in run["actions"]] == \
            [(a["step"], a["action"], a["reason"]) for a in alone["actions"]], path.name
    assert not [a for a in report["actions"] if a["reason"] == "stall"]


def test_the_trainers_event_files_of_one_writer_stay_one_run(capsys):
    """The training events and the evaluation file written after training: one process, one run."""
    report = replay_json(REAL / "tensorboard", capsys=capsys)
    assert "runs" not in report and len(report["files"]) == 2 and report["steps"] == 430
