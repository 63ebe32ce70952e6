"""`trainguard report DIR`, `diagnose DIR` and `replay DIR` of a Hugging Face Trainer's output folder, as
the Trainer leaves it: its logs are not at the top (``checkpoint-N/trainer_state.json``, TensorBoard events
under ``runs/<date_host>/``). All three find them through the one discovery (trainguard/formats/discover.py).

Before: `report` and `diagnose` looked only at the folder's top level: `report` wrote an empty report (no
chart, exit 0) and `diagnose` read 0 records."""

from __future__ import annotations

import json

import pytest

from trainguard import cli

STEPS, SAVE_EVERY = 12, 4


def discovered(folder):
    from trainguard.formats import discover     # here: the CLI tests ran on main before it existed
    return [log.path for log in discover.run_logs(folder)]


@pytest.fixture(scope="module")
def hf_output(tmp_path_factory):
    """A real Trainer run: 12 steps, a checkpoint every 4, TensorBoard logging on (its default folder)."""
    pytest.importorskip("transformers")
    pytest.importorskip("tensorboard")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from examples.hf_trainer import LENGTH, VOCAB, RandomTokens
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("hf") / "out"
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2))
    args = TrainingArguments(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=4,
                             learning_rate=1e-3, logging_steps=1, save_strategy="steps", save_steps=SAVE_EVERY,
                             report_to=["tensorboard"], use_cpu=True, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=RandomTokens()).train()
    return out


@pytest.mark.slow
def test_the_newest_checkpoints_trainer_state_stands_for_an_hf_output_folder(hf_output):
    assert sorted(p.name for p in hf_output.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-4", "checkpoint-8"]
    assert list(hf_output.glob("runs/*/events.out.tfevents.*"))        # the same steps again: not read twice
    assert discovered(hf_output) == [hf_output / "checkpoint-12" / "trainer_state.json"]


@pytest.mark.slow
def test_report_and_diagnose_of_an_hf_output_folder_through_the_cli(hf_output, tmp_path, capsys):
    html = tmp_path / "report.html"
    assert cli.main(["report", str(hf_output), "-o", str(html)]) == 0
    assert "<svg" in html.read_text()
    capsys.readouterr()
    assert cli.main(["diagnose", str(hf_output), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["files"] == [str(hf_output / "checkpoint-12" / "trainer_state.json")]
    assert found["malformed"] == 0 and found["records"] >= STEPS
    assert cli.main(["replay", str(hf_output), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == STEPS


def test_a_folder_of_tensorboard_runs_only_is_read_through_its_runs(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "runs" / "Dec01_host"))
    for step in range(1, 6):
        writer.add_scalar("train/loss", 1.0 / step, step)
    writer.close()
    (events,) = (tmp_path / "runs" / "Dec01_host").glob("events.out.tfevents.*")
    assert discovered(tmp_path) == [events]
