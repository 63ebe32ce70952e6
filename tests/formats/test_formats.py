"""Other tools' logs read by content beside TLS: a Megatron-LM log (lines built with Megatron's own format
strings), a TensorBoard event file (written by SummaryWriter) and a trainer_state.json (written by a real
Transformers Trainer). Replay of each finds the injected spike at its step; what cannot be mapped is reported
with file and position; `trainguard convert` writes TLS from each."""

from __future__ import annotations

import json

import pytest

from tests.formats.helpers import SPIKE_AT, losses, megatron_log, torchtitan_log
from trainguard import cli, formats, tls

GUARD = "guard: {spike_min_steps: 10, spike_window: 64}\n"


def replay(capsys, tmp_path, *inputs) -> dict:
    policy = tmp_path / "guard.yaml"
    policy.write_text(GUARD)
    capsys.readouterr()
    assert cli.main(["replay", *map(str, inputs), "--policy", str(policy), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def spikes(report: dict) -> list[int]:
    return [a["step"] for a in report["actions"] if a["reason"] == "loss_spike"]


def test_a_megatron_log_replays_with_its_spike_and_a_broken_line_named(tmp_path, capsys):
    log = tmp_path / "train.log"
    megatron_log(log)
    with open(log, "a") as handle:
        handle.write(" iteration      101/     100 | consumed samples: oops |\n")
    assert formats.detect(log) == formats.MEGATRON
    report = replay(capsys, tmp_path, log)
    assert spikes(report) == [SPIKE_AT] and report["records"] == 100
    (bad,) = report["malformed_lines"]
    assert str(log) in json.dumps(bad) and "103" in json.dumps(bad)    # 2 header lines + 100 + this one


def test_a_torchtitan_log_replays_with_its_spike(tmp_path, capsys):
    log = tmp_path / "titan.log"
    torchtitan_log(log)
    assert formats.detect(log) == formats.TORCHTITAN
    report = replay(capsys, tmp_path, log)
    assert spikes(report) == [SPIKE_AT] and report["records"] == 100 and report["malformed"] == 0
    out = tmp_path / "titan.jsonl"
    assert cli.main(["convert", str(log), "-o", str(out)]) == 0
    assert tls.read_records(out)[0]["metrics"] == pytest.approx(
        {"loss": round(losses()[0], 5), "grad_norm": 0.8123, "tokens_per_second": 12346.0, "mfu": 0.4012,
         "tflops": 1234.5, "mem_peak_bytes": round(31.25 * 2**30)})   # mfu printed in percent: TLS holds a ratio


def test_a_tensorboard_run_replays_with_its_spike_and_unmapped_tags_reported(tmp_path, capsys):
    writer_module = pytest.importorskip("torch.utils.tensorboard")
    writer = writer_module.SummaryWriter(str(tmp_path / "tb"))
    for step, loss in enumerate(losses(), 1):
        writer.add_scalar("train/loss", loss, step)
        writer.add_scalar("train/grad_norm", 0.5, step)
        writer.add_scalar("my/step-seconds", 0.8, step)
    writer.close()
    (events,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    assert formats.detect(events) == formats.TENSORBOARD
    report = replay(capsys, tmp_path, tmp_path / "tb")                # the run's folder, as users have it
    assert spikes(report) == [SPIKE_AT] and report["steps"] == 100
    (unmapped,) = report["malformed_lines"]
    assert "my/step-seconds" in json.dumps(unmapped) and str(events) in json.dumps(unmapped)

    out = tmp_path / "tb.jsonl"
    assert cli.main(["convert", str(events), "-o", str(out)]) == 1                   # the unmapped tag
    assert cli.main(["convert", str(events), "-o", str(out), "--map", "my/step-seconds=step_time_seconds"]) == 0
    records = tls.read_records(out)
    assert records[SPIKE_AT - 1]["metrics"] == pytest.approx(
        {"loss": losses()[SPIKE_AT - 1], "grad_norm": 0.5, "step_time_seconds": 0.8})


@pytest.mark.slow
def test_a_real_trainer_state_replays_with_its_spike(tmp_path, capsys):
    pytest.importorskip("transformers")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from examples.hf_trainer import LENGTH, VOCAB, RandomTokens, inject
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2))
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=24, per_device_train_batch_size=4,
                             learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
                             use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens())
    inject(model, lambda: trainer.state, {20: 1e3})
    trainer.train()
    state = tmp_path / "trainer_state.json"
    trainer.state.save_to_json(str(state))          # what Trainer._save_checkpoint writes into checkpoint-N
    assert formats.detect(state) == formats.HF_STATE
    report = replay(capsys, tmp_path, state)
    assert spikes(report) == [20] and report["steps"] == 24 and report["malformed"] == 0
    out = tmp_path / "state.jsonl"
    assert cli.main(["convert", str(state), "-o", str(out)]) == 0
    kinds = [r.get("event", {}).get("type") for r in tls.read_records(out)]
    assert kinds.count(None) == 24 and kinds[-1] == "run_summary"


def test_convert_refuses_tls_and_bad_maps_with_status_2(tmp_path, capsys):
    log = tmp_path / "rank-0.jsonl"
    log.write_bytes(tls.encode(tls.make_record(step=1, metrics={"loss": 1.0})))
    assert cli.main(["convert", str(log), "-o", str(tmp_path / "x.jsonl")]) == 2
    assert cli.main(["convert", str(log), "-o", str(tmp_path / "x.jsonl"), "--map", "nofield"]) == 2
    assert "TAG=FIELD" in capsys.readouterr().err


def test_the_tls_line_reader_reads_other_formats_and_names_what_it_cannot_map(tmp_path):
    log = tmp_path / "train.log"
    megatron_log(log, steps=12, spike_at=0)
    with open(log, "a") as handle:
        handle.write(" iteration       13/      12 | consumed samples: oops |\n")
    lines = list(tls.iter_lines(log))
    assert [line.record["step"] for line in lines[:-1]] == list(range(1, 13))
    assert lines[-1].record is None and lines[-1].lineno == 15 and str(log) in str(lines[-1].error)


def test_a_tls_line_quoting_another_tools_log_stays_tls(tmp_path):
    log = tmp_path / "rank-0.jsonl"
    quoted = " iteration        1/     100 | consumed samples:          512 | lm loss: 1.0 |"
    log.write_bytes(tls.encode(tls.event("note", step=1, text=quoted)))
    assert formats.detect(log) == formats.TLS
