"""Record the incidents the project's own trainer can produce: loss spike, NaN, gradient explosion, hang,
and a long healthy run. Each is a real `trainguard train` run with a fault injected (`--inject KIND@STEP`).

    .venv/bin/python tests/incidents/record.py                 # all of them (a few minutes on a CPU)
    .venv/bin/python tests/incidents/record.py hang nan        # some

The run's TLS logs (RUN/tls/rank-<r>.jsonl) are kept, gzip-compressed, as tests/incidents/<name>/; the
rest of the run directory (checkpoints, control) is thrown away. A hang is recorded by waiting for the
rank's `fault_injected` event and ending the run a few seconds later, as an operator would; its log
simply stops, and its expect.yml replays it with `hold` (the agent keeps exporting the last values).

Steps run at CPU speed, so a rerun writes different timestamps and numbers; expect.yml beside each log
is written by hand against what the incident must show (the injected step, the decision), not copied
from a replay.
"""

from __future__ import annotations

import gzip
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
# A low learning rate keeps the tiny model's own early gradient bursts under the guard's thresholds, so
# the only decisions in a log are the injected incident's.
COMMON = ["--lr", "1e-3", "--checkpoint-every", "50", "--seed", "1"]
HANG_GRACE_SECONDS = 3.0
RUN_TIMEOUT_SECONDS = 900.0


@dataclass(frozen=True)
class Recording:
    args: tuple[str, ...]
    hang: bool = False


RECORDINGS = {
    # three spiking steps in a row: two skips, then the rollback; the log shows the steps run again
    "loss-spike": Recording(("--steps", "260", "--inject", "spike@200", "--inject", "spike@201",
                             "--inject", "spike@202")),
    # two ranks (torchrun, gloo): both log the NaN, replay decides once
    "nan": Recording(("--nproc", "2", "--steps", "200", "--inject", "nan@150")),
    "gradient-explosion": Recording(("--steps", "200", "--inject", "gradexplode@150")),
    "hang": Recording(("--steps", "200", "--inject", "hang@80"), hang=True),
    "healthy-long": Recording(("--steps", "2000", "--checkpoint-every", "500")),
}


def trainguard() -> list[str]:
    return [sys.executable, "-m", "trainguard.cli"]


def run(run_dir: Path, recording: Recording) -> None:
    command = [*trainguard(), "train", "--run-dir", str(run_dir), *COMMON, *recording.args]
    print("  $ " + " ".join(command[2:]), flush=True)
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        if recording.hang:
            _wait_for_hang(run_dir / "tls" / "rank-0.jsonl", process)
            time.sleep(HANG_GRACE_SECONDS)
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=30)
            return
        _, stderr = process.communicate(timeout=RUN_TIMEOUT_SECONDS)
        if process.returncode != 0:
            raise SystemExit(f"the run failed (exit {process.returncode}):\n{stderr[-3000:]}")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


def _wait_for_hang(log: Path, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if log.exists() and b'"fault_injected"' in log.read_bytes():
            return
        if process.poll() is not None:
            raise SystemExit(f"the run ended before it hung (exit {process.returncode})")
        time.sleep(0.5)
    raise SystemExit("the run never reached its hang")


def keep(run_dir: Path, name: str) -> list[Path]:
    target = HERE / name
    target.mkdir(exist_ok=True)
    for old in target.glob("*.jsonl*"):
        old.unlink()
    kept = []
    for log in sorted((run_dir / "tls").glob("rank-*.jsonl")):
        path = target / (log.name + ".gz")
        path.write_bytes(gzip.compress(log.read_bytes(), compresslevel=9, mtime=0))
        kept.append(path)
    return kept


def main(argv: list[str]) -> int:
    names = argv or list(RECORDINGS)
    unknown = [name for name in names if name not in RECORDINGS]
    if unknown:
        print(f"unknown incident(s) {unknown}; known: {', '.join(RECORDINGS)}", file=sys.stderr)
        return 2
    for name in names:
        print(f"{name}:", flush=True)
        scratch = Path(tempfile.mkdtemp(prefix=f"incident-{name}-"))
        try:
            run(scratch / name, RECORDINGS[name])
            for path in keep(scratch / name, name):
                print(f"  {path.relative_to(HERE)}  {path.stat().st_size:,} bytes")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
