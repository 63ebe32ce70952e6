"""TensorBoard event files (`events.out.tfevents.*`): TFRecord framing read here, every record's two CRC-32C
checksums checked, each record an `Event` protobuf (TensorBoard's own message definitions: the `tensorboard`
package, `pip install tensorboard`).

Scalar summaries become TLS step metrics by tag: `DEFAULT_MAP` holds the tags of the Hugging Face Trainer
(`train/loss`, `train/epoch`, ...), Megatron-LM (`lm loss`, `grad-norm`, `learning-rate`, `iteration-time`,
`loss-scale`, `batch-size`, `params-norm`, `num-zeros`; `lm loss validation` an `evaluation` event; its
` vs samples` / ` vs tokens` copies, whose step is not the iteration, passed over) and plain `loss`/`grad_norm`/`lr`; `--map TAG=FIELD` (trainguard convert) adds or overrides one. Consecutive events of
one step are one record, timed by the first wall time among them. The Trainer's `eval/*` scalars are an
`evaluation` event (`eval/loss` as `val_loss`, as hf_state.py maps `eval_loss`), its closing `train/train_*`
and `train/total_flos` a `run_summary` event; a step that logged only `train/epoch` adds it to that event.
Text summaries (the Trainer's `args/text_summary`), hyperparameter summaries and the file-version header
are not data: passed over, counted in the notes. A scalar with a tag the map does not name, and a non-scalar event (histograms,
images, graphs), is `Unmapped` once per tag (its first event and how many there were).

A corrupt file is named, never shortened in silence: a record whose data checksum fails is `Unmapped` at its
index and byte offset, and reading goes on with the next (its length was checked); a length whose checksum
fails is `Unmapped`, and reading resumes at the next offset where a whole record checks out (or stops,
saying so, when none does within RESYNC_BYTES); a file cut mid-record, a length past the file's end or past
MAX_RECORD, bytes that are no Event, a wall time that is no time (1e300), a step outside 0 .. 2^63-1 and a
tensor that is not one number (a 2^40 shape is looked at, never allocated) are each `Unmapped` with their
position. Memory stays bounded: one record at a time, one step's values, at most `Notes.limit` tags counted.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from typing import Iterator

from trainguard import event_types, safe_read, tls
from trainguard.formats import Item, Notes, Unmapped, step_of

MAGIC = b"brain.Event:"
HEADER, FOOTER = 12, 4
BATCH, BATCH_BODY = 4096, 4096   # records checked at once; bodies up to this many bytes checked as one array
MAX_RECORD = 64 << 20           # a summary event this large is no event (a length bit flipped, a hostile file)
RESYNC_BYTES = 1 << 20          # how far past a broken length a next whole record is looked for (~3 s)
LATEST_TIME = 1e10              # 2286: a wall time past it (or not finite, or not positive) is no time
MAX_TAGS = 200
DEFAULT_MAP = {
    "loss": "loss", "train/loss": "loss", "train_loss": "loss", "lm loss": "loss", "train/lm loss": "loss",
    "grad_norm": "grad_norm", "train/grad_norm": "grad_norm", "grad-norm": "grad_norm",
    "lr": "learning_rate", "learning_rate": "learning_rate", "train/learning_rate": "learning_rate",
    "learning-rate": "learning_rate", "train/epoch": "epoch", "epoch": "epoch",
    # Megatron-LM's training_log (iteration-time: seconds per iteration)
    "iteration-time": "step_time_seconds", "loss-scale": "loss_scale", "batch-size": "global_batch_size",
    "params-norm": "param_norm", "num-zeros": "grad_num_zeros",
}
EVAL_PREFIX, SUMMARY_TAGS = "eval/", ("train/train_", "train/total_flos")
VALIDATION_TAGS = {"lm loss validation": "loss", "lm loss validation ppl": "val_ppl"}     # Megatron's evaluate_and_print
OTHER_AXIS = (" vs samples", " vs tokens")      # Megatron's copies of a scalar against consumed samples or tokens
OTHER_AXIS_NOTE = ("Megatron's copies of scalars against samples or tokens (` vs samples`, ` vs tokens`: their "
                   "step is not the iteration)")
DT_FLOAT, DT_DOUBLE, DT_INT32, DT_INT64, DT_HALF = 1, 2, 3, 9, 19


def looks_like(head: bytes) -> bool:
    return MAGIC in head[:128]


def looks_like_text(block: bytes) -> bool:
    return False


# ------------------------------------------------------------------------------------------ framing

def _crc_function():
    """CRC-32C: a C implementation where one is installed (google-crc32c, crc32c); else a table in Python for
    a small record (~5 MB/s: an event is ~100 bytes) and numpy lanes for a large one (~30 MB/s)."""
    try:
        import google_crc32c
        return lambda data: google_crc32c.value(bytes(data))
    except ImportError:
        pass
    try:
        import crc32c
        return crc32c.crc32c
    except ImportError:
        pass
    return lambda data: (_crc_register(data) if len(data) < LANES_FROM else _crc_lanes(data)) ^ 0xFFFFFFFF


LANES_FROM = 1 << 16


def _table() -> tuple[int, ...]:
    table = []
    for index in range(256):
        crc = index
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return tuple(table)


TABLE = _table()


def _crc_register(data, crc: int = 0xFFFFFFFF, table=TABLE) -> int:
    """The CRC-32C register after `data` (from `crc`), a byte at a time."""
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc


def _crc_lanes(data) -> int:
    """The same register, the data cut into ~sqrt(n) lanes run side by side as numpy columns, then put
    together in order: the register is linear, so a lane's is shifted over the next lane's bytes (the shift
    is the image of each of the 32 bits after a lane's length of zero bytes, applied a byte at a time)."""
    import numpy as np

    table = np.array(TABLE, dtype=np.uint32)
    lanes = max(1, int(len(data) ** 0.5))
    length = len(data) // lanes
    columns = np.frombuffer(data, dtype=np.uint8, count=lanes * length).reshape(lanes, length).T.copy()
    state = np.zeros(lanes, dtype=np.uint32)
    state[0] = 0xFFFFFFFF
    for column in columns:
        state = table[(state ^ column) & 0xFF] ^ (state >> 8)
    bits = np.uint32(1) << np.arange(32, dtype=np.uint32)
    for _ in range(length):
        bits = table[bits & 0xFF] ^ (bits >> 8)
    images = [int(bit) for bit in bits]
    shift = []
    for byte in range(4):
        part = [0] * 256
        for value in range(1, 256):
            low = value & -value
            part[value] = part[value ^ low] ^ images[8 * byte + low.bit_length() - 1]
        shift.append(part)
    t0, t1, t2, t3 = shift
    register = 0
    for lane in state.tolist():
        register = t0[register & 0xFF] ^ t1[(register >> 8) & 0xFF] ^ t2[(register >> 16) & 0xFF] ^ t3[register >> 24] ^ lane
    return _crc_register(memoryview(data)[lanes * length:], register)


_crc = None


def masked_crc(data) -> int:
    global _crc
    if _crc is None:
        _crc = _crc_function()
    crc = _crc(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def records(path: str | os.PathLike) -> Iterator[tuple[int, int, bytes | str]]:
    """(index, byte offset, data) of each whole record whose checksums hold, or (index, offset, problem)."""
    with safe_read.open_file(path, what="event file") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size == 0:
            return
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            yield from _framed(data, size)


def _framed(data, size: int) -> Iterator[tuple[int, int, bytes | str]]:
    """Records in file order. Whole batches are checked at once (`_batch`, numpy) while every checksum holds;
    the first record that is not whole and sound is read alone (`_single`), which names what is wrong."""
    offset = index = 0
    while offset < size:
        frames = _frames_from(data, size, offset)
        verdicts = _batch(data, frames) if frames else []
        for (start, length), (header_ok, body_ok) in zip(frames, verdicts):
            if not header_ok:
                break                       # the length read may be wrong: `_single` resynchronises
            end = start + HEADER + length + FOOTER
            yield (index, start, data[start + HEADER:end - FOOTER] if body_ok
                   else "a record whose data checksum fails (corrupt): skipped")
            offset, index = end, index + 1
        else:
            if frames:
                continue
        found, offset, stop = _single(data, size, offset, index)
        if found is not None:
            yield found
            index += 1
        if stop:
            return


def _frames_from(data, size: int, offset: int) -> list[tuple[int, int]]:
    """(offset, length) of up to BATCH records from `offset` whose lengths fit the file (not yet checked)."""
    frames = []
    while len(frames) < BATCH and offset + HEADER <= size:
        (length,) = struct.unpack_from("<Q", data, offset)
        end = offset + HEADER + length + FOOTER
        if length > MAX_RECORD or end > size:
            break
        frames.append((offset, length))
        offset = end
    return frames


def _batch(data, frames: list[tuple[int, int]]) -> list[tuple[bool, bool]]:
    """(length checksum holds, data checksum holds) of each frame: the headers as one numpy array, the bodies
    grouped by length (a Trainer's events come in a few lengths), a large body on its own."""
    import numpy as np

    buffer = np.frombuffer(data, dtype=np.uint8)
    starts = np.fromiter((start for start, _ in frames), dtype=np.int64, count=len(frames))
    lengths = np.fromiter((length for _, length in frames), dtype=np.int64, count=len(frames))
    header_ok = _masked_rows(buffer[starts[:, None] + np.arange(8)]) == _stored(buffer, starts + 8)
    body_ok = np.zeros(len(frames), dtype=bool)
    ends = starts + HEADER + lengths
    stored = _stored(buffer, ends)
    for length in np.unique(lengths):
        chosen = np.nonzero(lengths == length)[0]
        if length <= BATCH_BODY:
            rows = buffer[(starts[chosen] + HEADER)[:, None] + np.arange(int(length))]
            body_ok[chosen] = _masked_rows(rows) == stored[chosen]
        else:
            for at in chosen:
                body_ok[at] = masked_crc(data[int(starts[at]) + HEADER:int(ends[at])]) == int(stored[at])
    return list(zip(header_ok.tolist(), body_ok.tolist()))


def _masked_rows(rows):
    """The masked CRC-32C of each row of a 2-D uint8 array, a column (one byte of every row) at a time."""
    import numpy as np

    table = np.array(TABLE, dtype=np.uint32)
    crc = np.full(rows.shape[0], 0xFFFFFFFF, dtype=np.uint32)
    for column in rows.T:
        crc = table[(crc ^ column) & 0xFF] ^ (crc >> 8)
    crc ^= np.uint32(0xFFFFFFFF)
    return ((crc >> 15) | (crc << 17)) + np.uint32(0xA282EAD8)


def _stored(buffer, at):
    """The little-endian uint32 checksums stored at each offset of `at`."""
    import numpy as np

    raw = buffer[at[:, None] + np.arange(4)].astype(np.uint32)
    return raw[:, 0] | raw[:, 1] << 8 | raw[:, 2] << 16 | raw[:, 3] << 24


def _single(data, size: int, offset: int, index: int) -> tuple[tuple | None, int, bool]:
    """One record at `offset`, checked alone: (what to yield or None, the next offset, whether to stop)."""
    header = data[offset:offset + HEADER]
    if len(header) < HEADER:
        return (index, offset, f"the file ends {len(header)} bytes into a record's header (cut mid-record)"), size, True
    length, length_crc = struct.unpack("<QI", header)
    if masked_crc(header[:8]) != length_crc:
        found = _next_record(data, size, offset + 1)
        if found is None:
            return (index, offset, "a record length whose checksum fails, and no whole record within "
                                   f"{RESYNC_BYTES:,} bytes after it: the rest of the file is not read"), size, True
        return (index, offset, f"a record length whose checksum fails: {found - offset:,} bytes skipped to the "
                               "next whole record"), found, False
    end = offset + HEADER + length + FOOTER
    if length > MAX_RECORD:
        return (index, offset, f"a record of {length:,} bytes, past any summary event ({MAX_RECORD:,}): the rest "
                               "of the file is not read"), size, True
    if end > size:
        return (index, offset, f"the file ends inside a record of {length:,} bytes (cut mid-record)"), size, True
    body = data[offset + HEADER:end - FOOTER]
    (body_crc,) = struct.unpack("<I", data[end - FOOTER:end])
    if masked_crc(body) != body_crc:
        return (index, offset, "a record whose data checksum fails (corrupt): skipped"), end, False
    return (index, offset, body), end, False


def _next_record(data, size: int, start: int) -> int | None:
    """The first offset from `start` where a header's and its data's checksums both hold."""
    for offset in range(start, min(size - HEADER - FOOTER, start + RESYNC_BYTES) + 1):
        header = data[offset:offset + HEADER]
        length, length_crc = struct.unpack("<QI", header)
        end = offset + HEADER + length + FOOTER
        if length > MAX_RECORD or end > size or masked_crc(header[:8]) != length_crc:
            continue
        (body_crc,) = struct.unpack("<I", data[end - FOOTER:end])
        if masked_crc(data[offset + HEADER:end - FOOTER]) == body_crc:
            return offset
    return None


# ------------------------------------------------------------------------------------------- events

class _Step:
    """The values of one step's consecutive events: training metrics, evaluation values, summary values."""

    def __init__(self, step: int, when: float) -> None:
        self.step, self.when = step, when
        self.metrics: dict[str, float] = {}
        self.evaluation: dict[str, float] = {}
        self.summary: dict[str, float] = {}

    def records(self, notes: Notes, index: int) -> list[dict]:
        epoch_only = self.metrics.keys() <= {"epoch"}
        if self.metrics and epoch_only and not (self.evaluation or self.summary):
            notes.skip("steps that logged only the epoch", index, "event")
        out = []
        if self.metrics and not epoch_only:
            out.append(tls.make_record(step=self.step, timestamp=self.when, metrics=self.metrics))
        extra = self.metrics if epoch_only else {}
        if self.evaluation:
            values = dict(self.evaluation)
            if "loss" in values:
                values["val_loss"] = values.pop("loss")
            out.append(tls.event(event_types.EVALUATION, step=self.step, timestamp=self.when, **extra, **values))
        if self.summary:
            out.append(tls.event(event_types.RUN_SUMMARY, step=self.step, timestamp=self.when, **extra, **self.summary))
        return out


def read(path: str | os.PathLike, notes: Notes | None = None, tag_map: dict[str, str] | None = None) -> Iterator[Item]:
    notes = notes if notes is not None else Notes()
    source = str(path)
    try:
        from tensorboard.compat.proto import event_pb2
        from google.protobuf.message import DecodeError
    except ImportError:
        yield Unmapped(source, 0, unit="file", error="a TensorBoard event file: reading it needs `pip install tensorboard`")
        return
    mapping = {**DEFAULT_MAP, **(tag_map or {})}
    unmapped: dict[str, list] = {}
    current: _Step | None = None
    for index, offset, body in records(path):
        if isinstance(body, str):
            yield Unmapped(source, index, f"(byte {offset:,}) {body}", "event")
            continue
        event = event_pb2.Event()
        try:
            event.ParseFromString(body)
        except (DecodeError, RecursionError, ValueError) as exc:
            yield Unmapped(source, index, f"(byte {offset:,}) not an Event protobuf ({exc})", "event")
            continue
        kind = event.WhichOneof("what")
        if kind != "summary":
            if kind != "file_version":          # the header is not data
                _count(unmapped, f"a {kind} event", index)
            continue
        step = step_of(event.step)
        when = event.wall_time
        if step is None or not (0 < when < LATEST_TIME):
            what = f"step {event.step}" if step is None else f"wall time {when!r}"
            yield Unmapped(source, index, f"{what}: not a step and a time", "event")
            continue
        if event.summary.value and all(value.tag.endswith(OTHER_AXIS) for value in event.summary.value):
            notes.skip(OTHER_AXIS_NOTE, index, "event", count=len(event.summary.value))
            continue                    # its step is samples or tokens: it does not end the iteration's group
        if current is None or current.step != step:
            if current is not None:
                yield from current.records(notes, index)
            current = _Step(step, when)
        for value in event.summary.value:
            _take(value, current, mapping, unmapped, notes, index)
    if current is not None:
        yield from current.records(notes, index)
    for what, (first, count) in unmapped.items():
        yield Unmapped(source, first, f"{what}: {count} event(s) not mapped to a TLS field "
                                      "(trainguard convert --map TAG=FIELD)", "event")


def _take(value, step: _Step, mapping: dict, unmapped: dict, notes: Notes, index: int) -> None:
    tag = value.tag
    plugin = value.metadata.plugin_data.plugin_name
    scalar = _scalar(value)
    if scalar is None:
        if plugin == "text" or value.HasField("tensor") and value.tensor.dtype == 7:
            notes.skip("text summaries (e.g. the Trainer's args/text_summary)", index, "event")
        elif plugin == "hparams":
            notes.skip("hyperparameter summaries (add_hparams)", index, "event")
        else:
            _count(unmapped, f"tag {tag!r} (not a scalar)", index)
        return
    field = mapping.get(tag)
    if field is not None:
        step.metrics.setdefault(field, scalar)
    elif tag in VALIDATION_TAGS:
        step.evaluation.setdefault(VALIDATION_TAGS[tag], scalar)
    elif tag.endswith(OTHER_AXIS):
        notes.skip(OTHER_AXIS_NOTE, index, "event")
    elif tag.startswith(EVAL_PREFIX) and len(step.evaluation) < MAX_TAGS:
        step.evaluation.setdefault(tag[len(EVAL_PREFIX):], scalar)
    elif tag.startswith(SUMMARY_TAGS) and len(step.summary) < MAX_TAGS:
        step.summary.setdefault(tag[len("train/"):], scalar)
    else:
        _count(unmapped, f"tag {tag!r}", index)


def _count(unmapped: dict, what: str, index: int) -> None:
    entry = unmapped.get(what)
    if entry is None:
        if len(unmapped) >= MAX_TAGS:
            what = f"more tags (past the first {MAX_TAGS})"
            entry = unmapped.get(what)
        if entry is None:
            entry = unmapped[what] = [index, 0]
    entry[1] += 1


def _scalar(value) -> float | None:
    """The one number a summary value holds; None for anything else. A tensor's shape is looked at before
    its values: one that is not a single element is not read (a 2^40 shape is never allocated)."""
    kind = value.WhichOneof("value")
    if kind == "simple_value":
        return float(value.simple_value)
    if kind != "tensor":
        return None
    tensor = value.tensor
    if any(dim.size != 1 for dim in tensor.tensor_shape.dim):
        return None
    dtype = tensor.dtype
    if tensor.tensor_content:
        formats = {DT_FLOAT: "<f", DT_DOUBLE: "<d", DT_INT32: "<i", DT_INT64: "<q", DT_HALF: "<e"}
        layout = formats.get(dtype)
        if layout is None or len(tensor.tensor_content) != struct.calcsize(layout):
            return None
        return float(struct.unpack(layout, tensor.tensor_content)[0])
    values = {DT_FLOAT: tensor.float_val, DT_DOUBLE: tensor.double_val, DT_INT32: tensor.int_val,
              DT_INT64: tensor.int64_val, DT_HALF: tensor.half_val}.get(dtype)
    if values is None or len(values) != 1:
        return None
    if dtype == DT_HALF:
        return float(struct.unpack("<e", struct.pack("<H", values[0] & 0xFFFF))[0])
    number = float(values[0])
    return number if not math.isnan(number) or dtype in (DT_FLOAT, DT_DOUBLE) else None
