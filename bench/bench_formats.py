"""Reading other tools' logs (trainguard.formats): events or lines per second, and what detection costs a
TLS log.

    .venv/bin/python bench/bench_formats.py                      # 25,000 steps, best of 2
    .venv/bin/python bench/bench_formats.py --steps 100000 --repeat 3

Rows:
  tensorboard  trainguard   a Trainer-shaped event file (4 scalars a step, one event each) through
                            trainguard.formats.tensorboard.read: both CRC-32C checksums of every record
                            checked, each Event parsed, records made
               tensorboard  the same file through TensorBoard's own EventFileLoader (without TensorFlow it
                            checks the checksums in Python as well), records not made: the reader before
  megatron     trainguard   Megatron iteration lines behind a `[default0]: ` launcher prefix
  tls          detect       trainguard.formats.detect of a TLS log (what every replay input pays: its first
                            line is a JSON object, nothing else is read)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from timing import best_of
from trainguard import formats, tls

ITERATION = (" iteration {step:8d}/ 1000000 | consumed samples: {samples:12d} | elapsed time per iteration (ms): 900.0 |"
             " learning rate: 3.000E-04 | global batch size:   512 | lm loss: 2.500000E+00 | loss scale: 1.0 |"
             " grad norm: 0.412 | number of skipped iterations:   0 | number of nan iterations:   0 |")


def event_file(path: Path, steps: int) -> int:
    """A Trainer's event file of `steps` steps: train/loss, grad_norm, learning_rate, epoch, one event each."""
    from tensorboard.summary.writer.record_writer import RecordWriter
    from tensorboard.compat.proto import event_pb2

    events = 0
    with open(path, "wb") as out:
        writer = RecordWriter(out)
        writer.write(event_pb2.Event(wall_time=1.7e9, file_version="brain.Event:2").SerializeToString())
        for step in range(1, steps + 1):
            for tag, value in (("train/loss", 2.0), ("train/grad_norm", 0.5), ("train/learning_rate", 1e-4),
                               ("train/epoch", step / 1e3)):
                event = event_pb2.Event(step=step, wall_time=1.7e9 + step)
                event.summary.value.add(tag=tag, simple_value=value)
                writer.write(event.SerializeToString())
                events += 1
    return events


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=25_000)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-formats-"))

    events_path = folder / "events.out.tfevents.1.host"
    events = event_file(events_path, args.steps)
    size = events_path.stat().st_size / 1e6
    ours = best_of(args.repeat, lambda: sum(1 for _ in formats.read(events_path)))
    print(f"tensorboard  trainguard   {events:,} events ({size:.1f} MB) in {ours:.2f} s: {events / ours:,.0f} events/s")
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    theirs = best_of(args.repeat, lambda: sum(1 for _ in EventFileLoader(str(events_path)).Load()))
    print(f"             tensorboard  {events:,} events in {theirs:.2f} s: {events / theirs:,.0f} events/s "
          f"(trainguard {theirs / ours:.1f}x)")

    log = folder / "train.log"
    log.write_text("".join(f"[default0]: {ITERATION.format(step=step, samples=step * 512)}\n"
                           for step in range(1, args.steps * 4 + 1)))
    lines = args.steps * 4
    took = best_of(args.repeat, lambda: sum(1 for _ in formats.read(log)))
    print(f"megatron     trainguard   {lines:,} iteration lines in {took:.2f} s: {lines / took:,.0f} lines/s")

    rank = folder / "rank-0.jsonl"
    with open(rank, "wb") as out:
        for step in range(1, 10_001):
            out.write(tls.encode(tls.make_record(step=step, timestamp=1.7e9 + step, metrics={"loss": 2.0})))
    took = best_of(args.repeat * 50, lambda: formats.detect(rank))
    print(f"tls          detect       {took * 1e6:,.0f} us a file")
    return 0


if __name__ == "__main__":
    sys.exit(main())
