"""Every real log of ../shared/real-logs (public files from Megatron-LM, Megatron-DeepSpeed, BLOOM's and the
104B's chronicles, Hugging Face Trainers, a TensorBoard run and torchtitan; SOURCES.md there says where each
comes from) is read with the records a person counts in it, the fields at their values, the spikes SOURCES.md
names at their steps, and nothing malformed: by `trainguard.formats`, `trainguard convert` and `trainguard
replay`. The files are read where they lie (never copied into the repository); the module skips, saying so,
where the folder is absent. Set TRAINGUARD_REAL_LOGS to read them from elsewhere.

Before: 5 of the 12 Megatron files were "not a Megatron log" (detection read 64 KiB), BLOOM's
11 lines were 11 malformed ones (the `[default7]: ` prefix), torchtitan's log was not recognised, a
trainer_state.json with per-dataset evaluations was 186 malformed entries, `predict_*` entries 10 more, and
a trainer_state.json replayed to "restore" (a stall: its steps read as seconds)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from trainguard import cli, formats, tls


def _real_logs() -> Path | None:
    given = os.environ.get("TRAINGUARD_REAL_LOGS")
    if given:
        return Path(given)
    for folder in Path(__file__).resolve().parents:      # ../shared beside the repository (or a worktree's)
        if (folder / "shared" / "real-logs" / "SOURCES.md").is_file():
            return folder / "shared" / "real-logs"
    return None


REAL = _real_logs()
pytestmark = pytest.mark.skipif(REAL is None or not REAL.is_dir(),
                                reason="the real logs (../shared/real-logs, or TRAINGUARD_REAL_LOGS) are not here")

MEG, HF, TB, TT = "megatron", "hf", "tensorboard", "torchtitan"
T5_EVENTS = "tensorboard/t5-summarization-demo_runs/events.out.tfevents.1742826235.DESKTOP-41L2EO3.107869.0"
T5_EVAL = "tensorboard/t5-summarization-demo_runs/events.out.tfevents.1742884204.DESKTOP-41L2EO3.107869.1"
HF_OUTPUT = "hf/syGOAT_Mistral-v0.2-Translator-bf16_output"

# file -> (format, training steps, events, first step, last step): the counts a person makes of the file
COUNTS = {
    "megatron/bigscience_meg_ds_3d_gpt2_perf_n16-ds-off.out": (formats.MEGATRON, 62, 0, 1, 62),
    "megatron/bigscience_meg_ds_3d_gpt2_perf_n16-ds-on.out": (formats.MEGATRON, 49, 0, 1, 49),
    "megatron/bigscience_meg_gpt2_base_n8_dp1_tp4_pp8-1809562.out": (formats.MEGATRON, 20, 2, 10, 200),
    "megatron/bigscience_meg_gpt2_base_n16_dp1_tp4_pp16-1809577.out": (formats.MEGATRON, 9, 0, 10, 90),
    "megatron/msft_megatron-deepspeed_MoE_gpt3-0.125B-with-kernel.log": (formats.MEGATRON, 213, 21, 10, 2130),
    "megatron/msft_megatron-deepspeed_random_ltd_gpt3-0.125B-baseline.log": (formats.MEGATRON, 47, 4, 10, 470),
    "megatron/bigscience_tr8-104B_excerpt_L93-97_iter6900-6940.log": (formats.MEGATRON, 5, 0, 6900, 6940),
    "megatron/bigscience_tr8-104B_excerpt_L638-643_iter11446-11448.log": (formats.MEGATRON, 3, 0, 11446, 11448),
    "megatron/bigscience_tr8-104B_excerpt_L923-934_iter8738-8743.log": (formats.MEGATRON, 6, 0, 8738, 8743),
    "megatron/bigscience_tr8-104B_excerpt_L940-943_iter9026-9027.log": (formats.MEGATRON, 2, 0, 9026, 9027),
    "megatron/bigscience_tr11-176B-BLOOM_chronicles_L202-213_first_lm_loss_spike_iter31214-31251.log":
        (formats.MEGATRON, 11, 0, 31214, 31251),
    "megatron/bigscience_tr8b-104B_chronicles_L446-460_overflow_spike_iter17060-17068.log":
        (formats.MEGATRON, 9, 0, 17060, 17068),
    "hf/Dheena731_tinyLlama-finetune_trainer_state.json": (formats.HF_STATE, 186, 14, 15, 2790),
    "hf/Jaong_Checkpoint-of-CPT_trainer_state.json": (formats.HF_STATE, 10, 21, 500, 5000),
    "hf/aigoncharov_trainer_state_viz_trainer_state.json": (formats.HF_STATE, 30, 186, 401, 12030),
    "hf/10844110_t5-summarization-demo_trainer_state.json": (formats.HF_STATE, 430, 1, 500, 215000),
    "hf/syGOAT_Mistral-v0.2-Translator-bf16_trainer_state.json": (formats.HF_STATE, 866, 1, 10, 8660),
    f"{HF_OUTPUT}/checkpoint-500/trainer_state.json": (formats.HF_STATE, 50, 0, 10, 500),
    f"{HF_OUTPUT}/checkpoint-5000/trainer_state.json": (formats.HF_STATE, 500, 0, 10, 5000),
    f"{HF_OUTPUT}/checkpoint-8500/trainer_state.json": (formats.HF_STATE, 850, 0, 10, 8500),
    T5_EVENTS: (formats.TENSORBOARD, 430, 1, 500, 215000),
    T5_EVAL: (formats.TENSORBOARD, 0, 1, None, None),
    "torchtitan/auroraGPT-ANL_torchtitan_blendcorpus_aurora_md_L121-623.log": (formats.TORCHTITAN, 105, 0, 1, 105),
}


def read(name: str) -> tuple[list[dict], list[dict], formats.Notes]:
    """(step records, event records, notes) of one real log; asserts nothing in it is malformed."""
    notes = formats.Notes()
    items = list(formats.read(REAL / name, None, notes))
    problems = [str(item) for item in items if isinstance(item, formats.Unmapped)]
    assert problems == []
    steps = [item for item in items if "event" not in item]
    return steps, [item for item in items if "event" in item], notes


def by_step(records: list[dict]) -> dict[int, dict]:
    return {record["step"]: record["metrics"] for record in records}


def test_every_real_log_is_in_the_table():
    """A file added to the folder without its count here fails, so every real log stays read."""
    found = {str(path.relative_to(REAL)) for kind in (MEG, HF, TB, TT) for path in (REAL / kind).rglob("*")
             if path.is_file()}
    assert found == set(COUNTS)


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_each_real_log_is_detected_and_read_with_the_records_a_person_counts(name):
    kind, steps_wanted, events_wanted, first, last = COUNTS[name]
    assert formats.detect(REAL / name) == kind
    steps, events, _ = read(name)
    assert (len(steps), len(events)) == (steps_wanted, events_wanted)
    if steps:
        assert (steps[0]["step"], steps[-1]["step"]) == (first, last)
        assert len({record["step"] for record in steps}) == len(steps)       # one record a step


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_convert_and_replay_of_each_real_log_say_the_same_count_and_nothing_malformed(name, tmp_path, capsys):
    kind, steps_wanted, events_wanted, _, _ = COUNTS[name]
    out = tmp_path / "out.jsonl"
    assert cli.main(["convert", str(REAL / name), "-o", str(out)]) == 0
    assert len(tls.read_records(out)) == steps_wanted + events_wanted
    capsys.readouterr()
    assert cli.main(["replay", str(REAL / name), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["records"], report["malformed"]) == (steps_wanted + events_wanted, 0)
    assert report["without_clock"] == ([str(REAL / name)] if kind == formats.HF_STATE else [])


# ------------------------------------------------------------------------------------ Megatron-LM

def test_a_whole_slurm_output_with_its_spike_at_iteration_3_and_the_climb_after():
    steps, _, notes = read("megatron/bigscience_meg_ds_3d_gpt2_perf_n16-ds-off.out")
    metrics = by_step(steps)
    assert (metrics[2]["loss"], metrics[3]["loss"]) == (12.44502, 44.24266)        # x3.6 at it. 3
    assert metrics[31]["loss"] == pytest.approx(11.65, abs=0.01) and metrics[62]["loss"] == 20.43871
    assert metrics[1]["grad_norm"] == 67.593 and metrics[1]["step_time_seconds"] == pytest.approx(144.9156)
    assert metrics[1]["learning_rate"] == 1.875e-05 and metrics[1]["consumed_samples"] == 1024
    assert notes.clock == "wall" and notes.skipped == {}


def test_deepspeed_lm_loss_with_its_placeholder_grad_norm_and_loss_scale_not_read():
    steps, _, notes = read("megatron/bigscience_meg_ds_3d_gpt2_perf_n16-ds-on.out")
    metrics = by_step(steps)
    assert metrics[3]["loss"] == 41.03157                                            # `lm-loss:`
    assert not any("grad_norm" in m or "loss_scale" in m for m in metrics.values())
    (placeholders,) = [what for what in notes.skipped if "placeholder" in what]
    assert notes.skipped[placeholders][0] == 49


def test_an_interval_all_skipped_by_the_loss_scaler_is_not_a_nan_and_the_spike_is_at_30():
    steps, events, _ = read("megatron/bigscience_meg_gpt2_base_n8_dp1_tp4_pp8-1809562.out")
    metrics = by_step(steps)
    assert "loss" not in metrics[10] and "grad_norm" not in metrics[10]
    assert metrics[10]["skipped_iterations"] == 10                                    # loss-scale search
    assert metrics[20]["loss"] == 12.10588 and "grad_norm" not in metrics[20]
    assert (metrics[20]["skipped_iterations"], metrics[20]["iterations"]) == (8, 10)
    assert (metrics[30]["loss"], metrics[30]["grad_norm"]) == (26.48119, 67.033) and metrics[40]["grad_norm"] == 81.041
    assert metrics[200]["loss"] == 7.534106
    assert [(e["step"], e["event"]["type"], e["event"]["val_loss"]) for e in events] == [
        (100, "evaluation", 8.095942), (200, "evaluation", 7.645013)]
    n16 = by_step(read("megatron/bigscience_meg_gpt2_base_n16_dp1_tp4_pp16-1809577.out")[0])
    assert n16[30]["loss"] == 32.82511 and "loss" not in n16[10]


def test_an_iteration_whose_loss_megatron_left_out_is_a_nan_loss():
    """`if avg > 0.0:`: it. 9027 has no `lm loss` with 0 of 1 iterations skipped: the loss was not finite."""
    metrics = by_step(read("megatron/bigscience_tr8-104B_excerpt_L940-943_iter9026-9027.log")[0])
    assert metrics[9026]["loss"] == 7.02458 and math.isnan(metrics[9027]["loss"])
    assert metrics[9027]["skipped_iterations"] == 0 and metrics[9027]["loss_scale"] == 8192.0


def test_the_104b_spikes_at_their_iterations():
    glitch = by_step(read("megatron/bigscience_tr8-104B_excerpt_L93-97_iter6900-6940.log")[0])
    assert glitch[6900]["loss"] == 6.365808 and glitch[6940]["loss"] == 10.23865
    assert max(m["grad_norm"] for m in glitch.values()) == 283384.13
    huge = by_step(read("megatron/bigscience_tr8-104B_excerpt_L638-643_iter11446-11448.log")[0])
    assert (huge[11447]["grad_norm"], huge[11448]["loss"]) == (262623.331, 7.71234)
    spike = by_step(read("megatron/bigscience_tr8-104B_excerpt_L923-934_iter8738-8743.log")[0])
    assert (spike[8741]["loss"], spike[8741]["grad_norm"]) == (7.267764, 3273877.676)


def test_bloom_behind_its_launcher_prefix_in_seconds_with_tokens_and_tflops():
    steps, _, notes = read(
        "megatron/bigscience_tr11-176B-BLOOM_chronicles_L202-213_first_lm_loss_spike_iter31214-31251.log")
    metrics = by_step(steps)
    assert (metrics[31218]["loss"], metrics[31219]["loss"]) == (2.345279, 5.098124)   # the first spike
    assert metrics[31219]["grad_norm"] == 960.351 and metrics[31214]["grad_norm"] == 0.242
    assert metrics[31250]["loss"] == 2.215699                                          # recovered
    first = metrics[31214]
    assert first["step_time_seconds"] == 106.46 and first["tokens_trained"] == 97829879808
    assert (first["tflops"], first["samples_per_second"]) == (147.29, 19.238)
    assert notes.clock == "elapsed"           # no time printed: the elapsed times, from an unknown start


def test_deepspeed_overflow_lines_make_the_next_iteration_a_skipped_one():
    steps, _, notes = read("megatron/bigscience_tr8b-104B_chronicles_L446-460_overflow_spike_iter17060-17068.log")
    metrics = by_step(steps)
    assert metrics[17062]["loss"] == 4.374269                                          # the spike
    skipped = [step for step, m in metrics.items() if m["skipped_iterations"]]
    assert skipped == [17062, 17063, 17064, 17065, 17067, 17068]                     # an OVERFLOW line before each
    assert all(math.isinf(metrics[step]["grad_norm"]) for step in skipped)           # not the stale 464,441.887
    assert metrics[17061]["grad_norm"] == 464441.887 and metrics[17066]["grad_norm"] == 879946.622
    assert any("stale grad norms" in what and count == 6 for what, (count, _, _) in notes.skipped.items())


def test_the_healthy_megatron_deepspeed_runs_with_tokens_and_validation():
    steps, events, _ = read("megatron/msft_megatron-deepspeed_MoE_gpt3-0.125B-with-kernel.log")
    metrics = by_step(steps)
    assert metrics[10]["loss"] == 10.69056 and metrics[2130]["loss"] == 4.569905
    assert metrics[10]["tokens_trained"] == 5242880 and metrics[10]["step_time_seconds"] == pytest.approx(0.8496)
    assert steps[0]["timestamp"].startswith("2022-10-28T")                             # DeepSpeed's own times
    assert events[0]["event"] == {"type": "evaluation", "val_loss": 9.082616, "val_ppl": 8800.958}
    _, _, notes = read("megatron/msft_megatron-deepspeed_random_ltd_gpt3-0.125B-baseline.log")
    assert [(what, count) for what, (count, _, _) in notes.skipped.items()] == [
        ("iteration-line field 'reserve_length' (TLS has no name for it)", 47)]      # said once, with its count


# ------------------------------------------------------------------------------------ Hugging Face

def test_trainer_states_map_eval_datasets_predictions_tokens_and_carry_no_clock():
    steps, events, notes = read("hf/aigoncharov_trainer_state_viz_trainer_state.json")
    datasets = {event["event"]["dataset"] for event in events}
    assert datasets == {f"g{n}" for n in range(6)}
    assert events[0]["event"]["val_loss"] == 5.741583347320557 and "accuracy" in events[0]["event"]
    assert notes.clock == formats.NO_CLOCK and all(r[formats.CLOCK_KEY] == formats.NO_CLOCK for r in steps + events)

    steps, events, _ = read("hf/Jaong_Checkpoint-of-CPT_trainer_state.json")
    kinds = [event["event"]["type"] for event in events]
    assert (kinds.count("evaluation"), kinds.count("prediction"), kinds.count("run_summary")) == (10, 10, 1)
    prediction = next(event for event in events if event["event"]["type"] == "prediction")
    assert prediction["event"]["loss"] == 0.6476863622665405 and prediction["step"] == 549   # the epoch's evaluation

    steps, events, _ = read("hf/Dheena731_tinyLlama-finetune_trainer_state.json")
    assert steps[0]["metrics"]["tokens_trained"] == 61440 and steps[0]["metrics"]["mean_token_accuracy"] > 0.5
    assert [event["step"] for event in events][:2] == [200, 400]


def test_the_t5_grad_norm_spike_at_190000_in_its_state_and_its_tensorboard_file_alike():
    state = by_step(read("hf/10844110_t5-summarization-demo_trainer_state.json")[0])
    events, summary, notes = read(T5_EVENTS)
    board = by_step(events)
    for metrics in (state, board):
        assert metrics[190000]["grad_norm"] == pytest.approx(35.5915412902832)
        assert metrics[190500]["grad_norm"] == pytest.approx(2.365534782409668)
        assert metrics[164000]["grad_norm"] == pytest.approx(13.167923927307129)
    assert board[500]["epoch"] == pytest.approx(0.006965825659315398)
    assert events[0]["timestamp"].startswith("2025-03-24T14:26") and events[-1]["timestamp"].startswith("2025-03-25T05:34")
    (closing,) = summary
    assert closing["step"] == 215337 and closing["event"]["type"] == "run_summary" and closing["event"]["epoch"] == 3.0
    assert [(what, count) for what, (count, _, _) in notes.skipped.items()] == [
        ("text summaries (e.g. the Trainer's args/text_summary)", 2)]
    _, (evaluation,), _ = read(T5_EVAL)
    assert evaluation["step"] == 215337 and evaluation["event"]["type"] == "evaluation"
    assert evaluation["event"]["val_loss"] == pytest.approx(1.7213, abs=0.2) and "rouge1" in evaluation["event"]


def test_a_trainer_output_folder_is_its_newest_checkpoint_and_replays_without_time_rules(capsys):
    from trainguard.formats import discover

    assert [log.path for log in discover.run_logs(REAL / HF_OUTPUT)] == [
        REAL / HF_OUTPUT / "checkpoint-8500" / "trainer_state.json"]
    capsys.readouterr()
    assert cli.main(["replay", str(REAL / HF_OUTPUT)]) == 0
    out = capsys.readouterr().out
    assert "850 records, 0 malformed, no wall clock" in out and out.endswith("actions: none\n")
    assert cli.main(["replay", str(REAL / HF_OUTPUT), "--rules", "alerts"]) == 2
    assert "no wall clock" in capsys.readouterr().err


def test_a_converted_trainer_state_keeps_saying_it_has_no_clock(tmp_path, capsys):
    out = tmp_path / "state.jsonl"
    assert cli.main(["convert", str(REAL / "hf/Jaong_Checkpoint-of-CPT_trainer_state.json"), "-o", str(out)]) == 0
    capsys.readouterr()
    assert cli.main(["replay", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["without_clock"] == [str(out)] and not [a for a in report["actions"] if a["reason"] == "stall"]


# ------------------------------------------------------------------------------------ torchtitan

def test_torchtitan_through_the_ezpz_logger_with_mfu_as_a_ratio():
    steps, _, notes = read("torchtitan/auroraGPT-ANL_torchtitan_blendcorpus_aurora_md_L121-623.log")
    metrics = by_step(steps)
    assert (metrics[1]["loss"], metrics[2]["loss"], metrics[3]["loss"]) == (10.8595, 14.4458, 15.2005)
    assert (metrics[2]["grad_norm"], metrics[3]["grad_norm"]) == (41.788, 66.6053)
    assert (metrics[1]["mfu"], metrics[2]["mfu"]) == (0.0047, 0.2084)                # printed 0.47%, 20.84%
    assert metrics[2]["tokens_per_second"] == 6697 and metrics[2]["tflops"] == 62.15
    assert metrics[105]["loss"] == 5.3256 and steps[0]["timestamp"] == "2025-09-11T14:09:46.954794Z"
    assert notes.clock == "wall" and notes.skipped == {}


# ------------------------------------------------------------------------------------ folders

def test_a_folder_of_slurm_outputs_is_found_by_content(tmp_path, capsys):
    """SLURM's `*.out` (read in place through a link: never copied)."""
    (tmp_path / "slurm-1809562.out").symlink_to(REAL / "megatron/bigscience_meg_gpt2_base_n8_dp1_tp4_pp8-1809562.out")
    (tmp_path / "notes.txt").write_text("not a log\n")
    capsys.readouterr()
    assert cli.main(["replay", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["files"] == [str(tmp_path / "slurm-1809562.out")] and report["records"] == 22
