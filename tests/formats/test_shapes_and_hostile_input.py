"""How other tools' logs arrive (behind launcher prefixes, after megabytes of set-up, several ranks in one
file) and what a stranger or a broken disk makes of them (a flipped bit in an event file, a file cut
mid-record, hostile trainer_state.json and event shapes). Each is read, or named with its position: never a
traceback, never a file shortened in silence."""

from __future__ import annotations

import json
import math
import struct

import pytest

from trainguard import cli, formats
from trainguard.formats import megatron, tensorboard, torchtitan

ITERATION = (" iteration {step:8d}/    1000 | consumed samples: {samples:12d} | elapsed time per iteration (ms): 900.0 |"
             " learning rate: 3.000E-04 | global batch size:   512 | lm loss: {loss:.6E} | loss scale: 1.0 |"
             " grad norm: 0.412 | number of skipped iterations:   0 | number of nan iterations:   0 |")


def iteration(step: int, loss: float = 2.5) -> str:
    return ITERATION.format(step=step, samples=step * 512, loss=loss)


def items(path, **kwargs) -> tuple[list[dict], list[formats.Unmapped], formats.Notes]:
    notes = formats.Notes()
    read = list(formats.read(path, kwargs.get("tag_map"), notes))
    return ([i for i in read if isinstance(i, dict)], [i for i in read if isinstance(i, formats.Unmapped)], notes)


# ------------------------------------------------------------------------------------ detection, prefixes

def test_a_megatron_log_is_found_after_megabytes_of_set_up(tmp_path):
    log = tmp_path / "slurm-1.out"
    preamble = "".join(f"  argument_{n} ........ {n}\nNCCL INFO Channel {n:02d} : 0[0] -> 1[1] via P2P\n"
                       for n in range(40_000))                     # ~2.5 MB before the first iteration
    log.write_text(preamble + iteration(1) + "\n" + iteration(2) + "\n")
    assert len(preamble) > 2 * formats.HEAD_BYTES * 16
    assert formats.detect(log) == formats.MEGATRON
    records, problems, _ = items(log)
    assert [r["step"] for r in records] == [1, 2] and problems == []


def test_a_plain_text_file_stays_tls_to_replay_which_says_it_holds_no_records(tmp_path, capsys):
    log = tmp_path / "notes.log"
    log.write_text("".join(f"line {n} of some other program\n" for n in range(1554)))
    assert formats.detect(log) == formats.TLS
    assert cli.main(["replay", str(log)]) == 2
    err = capsys.readouterr().err
    assert "no records in" in err and "1,554 malformed lines" in err


@pytest.mark.parametrize("prefix", ["[default7]: ", "[host-a:3]: ", "0: ", "[rank3]:", "[2024-05-01 10:00:00] ",
                                    "2024-05-01T10:00:00.250Z ", "[default7]:[2024-05-01 10:00:00] "])
def test_launcher_prefixes_hide_no_megatron_line(tmp_path, prefix):
    log = tmp_path / "train.log"
    log.write_text("".join(f"{prefix}{iteration(step, loss)}\n" for step, loss in ((1, 2.5), (2, 9.5), (3, 2.4))))
    assert formats.detect(log) == formats.MEGATRON
    records, problems, _ = items(log)
    assert [(r["step"], r["metrics"]["loss"]) for r in records] == [(1, 2.5), (2, 9.5), (3, 2.4)] and problems == []
    if "2024-05-01" in prefix:
        assert records[0]["timestamp"].startswith("2024-05-01T10:00:00")


def test_tqdm_carriage_returns_before_the_iteration_text(tmp_path):
    log = tmp_path / "train.log"
    bar = "\r".join(f"Loading: {n}%|####| {n}/100" for n in range(0, 101, 25))
    log.write_text(f"{bar}\r{iteration(1)}\n{bar}\r{iteration(2, 7.0)}\r\n")
    records, problems, _ = items(log)
    assert [(r["step"], r["metrics"]["loss"]) for r in records] == [(1, 2.5), (2, 7.0)] and problems == []


def test_several_ranks_in_one_file_are_one_run_and_the_copies_are_counted(tmp_path):
    log = tmp_path / "train.log"
    lines = [f"[default{rank}]: {iteration(step)}" for step in (1, 2, 3) for rank in (7, 3, 5)]
    log.write_text("\n".join(lines) + "\n")
    records, problems, notes = items(log)
    assert [r["step"] for r in records] == [1, 2, 3] and problems == []
    ((what, (count, first, _)),) = notes.skipped.items()
    assert count == 6 and first == 2 and "rank 7's are read" in what


def test_a_folder_of_rank_files_replays_each_step_once(tmp_path, capsys):
    for rank in range(3):
        (tmp_path / f"log_rank{rank}.txt").write_text(
            "".join(f"[default{rank}]: {iteration(step, 9.0 if step == 30 else 2.5)}\n" for step in range(1, 41)))
    capsys.readouterr()
    assert cli.main(["replay", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["files"]) == 3 and report["records"] == 120 and report["malformed"] == 0
    assert (report["steps"], report["duplicate_steps"]) == (40, 80)


def test_a_tls_file_with_a_torn_first_line_quoting_megatron_stays_tls(tmp_path):
    log = tmp_path / "rank-0.jsonl"
    quoted = json.dumps({"timestamp": 1.7e9, "step": 1, "event": {"type": "note", "text": iteration(1)}})
    log.write_text('{"timestamp": 1.7e9, "ste\n' + quoted + "\n")
    assert formats.detect(log) == formats.TLS


def test_a_step_past_int64_is_named_not_a_traceback(tmp_path, capsys):
    log = tmp_path / "train.log"
    log.write_text(iteration(1) + "\n" + iteration(10**30) + "\n")
    records, (problem,), _ = items(log)
    assert len(records) == 1 and problem.position == 2 and "64-bit" in problem.error
    assert cli.main(["replay", str(log)]) == 0 and "beyond a 64-bit step" in capsys.readouterr().out


def test_a_loss_that_is_not_a_number_is_named(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(iteration(1).replace("lm loss: 2.500000E+00", "lm loss: oops") + "\n")
    _, (problem,), _ = items(log)
    assert problem.position == 1 and "lm loss: 'oops' is not a number" in problem.error


def test_grad_norm_nan_is_read_as_nan(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(iteration(1).replace("grad norm: 0.412", "grad norm: nan") + "\n")
    (record,), _, _ = items(log)
    assert math.isnan(record["metrics"]["grad_norm"]) and record["metrics"]["loss"] == 2.5


def test_torchtitan_ranks_validation_and_mfu(tmp_path):
    log = tmp_path / "titan.log"
    line = ("[rank{rank}]:[titan] 2025-04-01 10:00:0{step},123 - root - INFO - step: {step}  loss:  7.80  "
            "grad_norm:  1.20  memory: 31.25GiB(39.47%)  tps: 12,345  tflops: 123.45  mfu: 40.12%")
    rows = [line.format(rank=rank, step=step) for step in (1, 2) for rank in range(8)]
    rows.append("[rank0]:[titan] 2025-04-01 10:00:05,000 - root - INFO - validate step: 2  loss:  7.5012  "
                "memory: 31.25GiB(39.47%)")
    log.write_text("\n".join(rows) + "\n")
    assert formats.detect(log) == formats.TORCHTITAN
    records, problems, notes = items(log)
    assert problems == [] and [r["step"] for r in records] == [1, 2, 2]
    assert records[0]["metrics"]["mfu"] == 0.4012 and records[0]["metrics"]["tokens_per_second"] == 12345
    assert records[2]["event"] == {"type": "evaluation", "val_loss": 7.5012}
    assert sum(count for count, _, _ in notes.skipped.values()) == 14            # 7 other ranks x 2 steps


# ------------------------------------------------------------------------------------ trainer_state.json

@pytest.mark.parametrize("text, error", [
    ('{\n "log_history": 5\n}', "`log_history` is int"),
    ("{\n" + '"a": [' * 100_000 + "]" * 100_000 + "}", "not a trainer_state.json"),
    ('{\n "log_history": [', "not a trainer_state.json"),
])
def test_a_hostile_trainer_state_is_one_problem_for_the_file(tmp_path, capsys, text, error):
    state = tmp_path / "trainer_state.json"
    state.write_text(text.replace('"a"', '"log_history": 1, "a"', 1) if "[[" in text else text)
    if formats.detect(state) != formats.HF_STATE:          # too broken to be recognised: read as TLS, refused
        assert cli.main(["replay", str(state)]) == 2
        return
    records, (problem,), _ = items(state)
    assert records == [] and problem.unit == "file" and error in problem.error
    assert cli.main(["convert", str(state), "-o", str(tmp_path / "out.jsonl")]) == 2
    assert cli.main(["replay", str(state)]) == 2 and "no records" in capsys.readouterr().err


def test_hostile_trainer_state_entries_are_named_and_the_rest_is_read(tmp_path):
    history = [{"step": 1, "loss": 2.0}, {"step": 2, "eval_loss": "low"}, {"step": 3, "loss": 1e400},
               {"step": 10**30, "loss": 1.0}, {"step": True, "loss": 1.0}, 7, {"step": 4, "loss": [1]},
               {"step": 5, "eval_g0_loss": 1.5, "eval_g0_accuracy": 0.5, "eval_g1_loss": 1.7}]
    state = tmp_path / "trainer_state.json"
    state.write_text(json.dumps({"global_step": 5, "log_history": history}, indent=2).replace("Infinity", "1e400"))
    records, problems, _ = items(state)
    assert [(p.position, p.unit) for p in problems] == [(1, "entry"), (3, "entry"), (4, "entry"), (5, "entry"),
                                                        (6, "entry")]
    assert "eval_loss: 'low' is not a number" in problems[0].error and "not a step" in problems[1].error
    assert [r["step"] for r in records] == [1, 3, 5, 5]
    assert math.isinf(records[1]["metrics"]["loss"])
    assert [r["event"]["dataset"] for r in records[2:]] == ["g0", "g1"]
    assert records[2]["event"] == {"type": "evaluation", "dataset": "g0", "accuracy": 0.5, "val_loss": 1.5}
    assert records[0]["metrics"] == {"loss": 2.0}


# ------------------------------------------------------------------------------------ TensorBoard

def frame(body: bytes) -> bytes:
    header = struct.pack("<Q", len(body))
    return (header + struct.pack("<I", tensorboard.masked_crc(header)) + body
            + struct.pack("<I", tensorboard.masked_crc(body)))


def event(step: int, wall_time: float = 1.7e9, **scalars: float) -> bytes:
    from tensorboard.compat.proto import event_pb2

    message = event_pb2.Event(step=step, wall_time=wall_time)
    for tag, value in scalars.items():
        message.summary.value.add(tag=tag, simple_value=value)
    return message.SerializeToString()


def event_file(path, bodies: list[bytes]) -> None:
    from tensorboard.compat.proto import event_pb2

    version = event_pb2.Event(wall_time=1.7e9, file_version="brain.Event:2").SerializeToString()
    path.write_bytes(b"".join(frame(body) for body in [version, *bodies]))


def sixty_steps(nan_at: int = 45) -> list[bytes]:
    return [event(step, loss=math.nan if step == nan_at else 2.0, grad_norm=0.5) for step in range(1, 61)]


def test_the_crc_is_tensorflows(tmp_path):
    """A file TensorBoard's own reader reads the same (its framing and checksums are TFRecord's)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    events = tmp_path / "events.out.tfevents.1.host"
    event_file(events, sixty_steps())
    assert len(list(EventFileLoader(str(events)).Load())) == 61
    records, problems, _ = items(events)
    assert len(records) == 60 and problems == [] and math.isnan(records[44]["metrics"]["loss"])


def test_a_flipped_bit_in_a_record_names_it_and_the_rest_is_read(tmp_path):
    events = tmp_path / "events.out.tfevents.1.host"
    event_file(events, sixty_steps())
    data = bytearray(events.read_bytes())
    data[len(data) // 3] ^= 0x10
    events.write_bytes(bytes(data))
    records, (problem,), _ = items(events)
    assert len(records) == 59 and problem.unit == "event" and "checksum" in problem.error
    assert any(math.isnan(r["metrics"].get("loss", 0.0)) and r["step"] == 45 for r in records)   # still seen


def test_a_flipped_bit_in_a_length_resumes_at_the_next_whole_record(tmp_path):
    events = tmp_path / "events.out.tfevents.1.host"
    event_file(events, sixty_steps())
    first = len(frame(event(0)))          # the version record's length is not event(0)'s: find the 20th by framing
    offsets, offset, data = [], 0, events.read_bytes()
    while offset < len(data):
        offsets.append(offset)
        offset += 16 + struct.unpack("<Q", data[offset:offset + 8])[0]
    broken = bytearray(data)
    broken[offsets[20] + 1] ^= 0x01
    events.write_bytes(bytes(broken))
    records, (problem,), _ = items(events)
    assert first > 0 and len(records) == 59 and "length whose checksum fails" in problem.error
    assert records[-1]["step"] == 60 and any(r["step"] == 45 for r in records)


def test_a_file_cut_mid_record_says_so(tmp_path, capsys):
    events = tmp_path / "events.out.tfevents.1.host"
    event_file(events, sixty_steps())
    events.write_bytes(events.read_bytes()[:-7])
    records, (problem,), _ = items(events)
    assert len(records) == 59 and "cut mid-record" in problem.error
    assert cli.main(["replay", str(events)]) == 0 and "cut mid-record" in capsys.readouterr().out


@pytest.mark.parametrize("body, error", [
    (b"\xff" * 40, "not an Event protobuf"),
    (event(5, wall_time=1e300, loss=1.0), "wall time"),
])
def test_a_hostile_event_with_a_valid_crc_is_named(tmp_path, body, error):
    events = tmp_path / "events.out.tfevents.1.host"
    event_file(events, [event(1, loss=2.0), body, event(2, loss=2.0)])
    records, (problem,), _ = items(events)
    assert [r["step"] for r in records] == [1, 2] and error in problem.error and problem.position == 2


def test_a_huge_length_field_stops_loudly(tmp_path):
    events = tmp_path / "events.out.tfevents.1.host"
    event_file(events, [event(1, loss=2.0)])
    header = struct.pack("<Q", 1 << 62)
    with open(events, "ab") as out:
        out.write(header + struct.pack("<I", tensorboard.masked_crc(header)) + b"\0" * 32)
    records, (problem,), _ = items(events)
    assert len(records) == 1 and "past any summary event" in problem.error


def test_a_tensor_of_2_to_the_40_elements_is_not_allocated(tmp_path):
    from tensorboard.compat.proto import event_pb2

    message = event_pb2.Event(step=1, wall_time=1.7e9)
    value = message.summary.value.add(tag="train/loss")
    value.tensor.dtype = 1
    value.tensor.tensor_shape.dim.add(size=1 << 40)
    value.tensor.float_val.append(1.0)
    events = tmp_path / "events.out.tfevents.1.host"
    event_file(events, [message.SerializeToString(), event(2, loss=2.0)])
    records, (problem,), _ = items(events)
    assert [r["step"] for r in records] == [2] and "not a scalar" in problem.error


def many_tags(step: int, tags: int) -> bytes:
    """An Event of `tags` scalar values, encoded by hand (the protobuf API takes seconds for 200k)."""
    def varint(number: int) -> bytes:
        out = bytearray()
        while True:
            out.append(number & 0x7F | (0x80 if number > 0x7F else 0))
            number >>= 7
            if not number:
                return bytes(out)

    def values():
        for n in range(tags):
            tag = f"tag{n}".encode()
            value = b"\x0a" + varint(len(tag)) + tag + b"\x15" + struct.pack("<f", 1.0)   # tag, simple_value
            yield b"\x0a" + varint(len(value)) + value                                  # Summary.value
    summary = b"".join(values())
    return (b"\x09" + struct.pack("<d", 1.7e9) + b"\x10" + varint(step)                 # wall_time, step
            + b"\x2a" + varint(len(summary)) + summary)                                  # summary


def test_an_event_of_200k_tags_is_read_with_bounded_bookkeeping(tmp_path):
    events = tmp_path / "events.out.tfevents.1.host"
    assert many_tags(1, 2) == event(1, tag0=1.0, tag1=1.0)
    event_file(events, [many_tags(1, 200_000), event(2, loss=2.0)])
    records, problems, _ = items(events)
    assert [r["step"] for r in records] == [2]
    assert len(problems) == tensorboard.MAX_TAGS + 1 and "past the first 200" in problems[-1].error
    assert "199800 event(s)" in problems[-1].error


def test_the_readers_say_what_they_are():
    assert megatron.looks_like_text(iteration(1).encode()) and not torchtitan.looks_like_text(iteration(1).encode())


def test_a_compact_trainer_state_is_one_not_a_tls_line(tmp_path):
    state = tmp_path / "trainer_state.json"
    state.write_text(json.dumps({"global_step": 2, "log_history": [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]}))
    assert formats.detect(state) == formats.HF_STATE
    records, problems, _ = items(state)
    assert [r["metrics"]["loss"] for r in records] == [2.0, 1.5] and problems == []


def test_the_batched_checks_agree_with_the_one_record_path(tmp_path):
    """`_framed` checks thousands of records as numpy arrays; `_single` one at a time: the same verdicts."""
    import mmap

    events = tmp_path / "events.out.tfevents.1.host"
    event_file(events, [event(step, loss=1.0, **({"big": 2.0} if step % 7 else {})) for step in range(1, 9000)])
    data = bytearray(events.read_bytes())
    data[len(data) // 2] ^= 0x01
    events.write_bytes(bytes(data))
    batched = list(tensorboard.records(events))
    one_by_one, offset, index, size = [], 0, 0, len(data)
    with open(events, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        while offset < size:
            found, offset, stop = tensorboard._single(mapped, size, offset, index)
            one_by_one.append(found)
            index += 1
            if stop:
                break
    assert batched == one_by_one and sum(isinstance(body, str) for _, _, body in batched) == 1


def test_megatrons_own_tensorboard_tags(tmp_path):
    """megatron/training/training.py training_log and evaluate_and_print_results, as Megatron writes them."""
    writer_module = pytest.importorskip("torch.utils.tensorboard")
    writer = writer_module.SummaryWriter(str(tmp_path))
    for iteration in (10, 20):
        samples = iteration * 512
        for tag, value in (("learning-rate", 3e-4), ("batch-size", 512.0), ("lm loss", 2.5), ("loss-scale", 1.0),
                           ("grad-norm", 0.4), ("num-zeros", 0.0), ("params-norm", 250.0), ("iteration-time", 0.9)):
            writer.add_scalar(tag, value, iteration)
            writer.add_scalar(tag + " vs samples", value, samples)
    writer.add_scalar("lm loss validation", 2.7, 20)
    writer.add_scalar("lm loss validation ppl", 14.9, 20)
    writer.close()
    (events,) = tmp_path.glob("events.out.tfevents.*")
    records, problems, notes = items(events)
    assert problems == []
    steps = [r for r in records if "event" not in r]
    assert [r["step"] for r in steps] == [10, 20]                    # not the samples' 5120, 10240
    assert steps[0]["metrics"] == pytest.approx({"learning_rate": 3e-4, "global_batch_size": 512.0, "loss": 2.5,
                                                 "loss_scale": 1.0, "grad_norm": 0.4, "grad_num_zeros": 0.0,
                                                 "param_norm": 250.0, "step_time_seconds": 0.9})
    (evaluation,) = [r for r in records if "event" in r]
    assert evaluation["step"] == 20 and evaluation["event"] == pytest.approx(
        {"type": "evaluation", "val_loss": 2.7, "val_ppl": 14.9})
    ((what, (count, _, _)),) = notes.skipped.items()
    assert "vs samples" in what and count == 16
