"""The report's loader beside TensorBoard's, on the same scalars of one long run, in one run on this host.

    .venv/bin/python bench/bench_report.py [--steps 200000] [--repeat 3] [--write-docs]

The run: `--steps` step records of rank 0 with eight metrics each (loss, grad norm, learning rate,
tokens/s, MFU, step time, data wait, forward+backward) and a checkpoint event every 1000 steps, written
as TLS (what the trainer writes) and, for the peer, as a TensorBoard event file with the same scalars
(what `SummaryWriter.add_scalar` writes).

Each case runs in a fresh interpreter; time is wall time of the work after imports, peak memory is the
process's VmHWM (imports included), the median of `--repeat` runs:

  ours  load_run             trainguard.report.data.load_run(goodput=False): every chart series, <= 2000 points
  ours  report               render_report(): the whole self-contained HTML, goodput included
  peer  TensorBoard          EventAccumulator(size_guidance 1000 scalars/tag, TB's default).Reload() + Scalars()
  peer  json.loads list      every line json.loads'ed into a list (what a quick script does)
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainguard.tls import Writer, make_record  # noqa: E402

METRICS = ("loss", "grad_norm", "learning_rate", "tokens_per_second", "mfu", "step_time_seconds",
           "data_wait_seconds", "forward_backward_seconds")
SECTION = "## Report (`trainguard report`)"

CASES = {
    "ours  load_run": "from trainguard.report.data import load_run\n"
                      "t=time.perf_counter(); run=load_run(RUN, goodput=False); t=time.perf_counter()-t\n"
                      "n=sum(len(s.points()) for s in run.training.values())",
    "ours  report": "from trainguard.report import render_report\n"
                    "t=time.perf_counter(); html=render_report(RUN); t=time.perf_counter()-t\n"
                    "n=len(html)",
    "peer  TensorBoard": "from tensorboard.backend.event_processing import event_accumulator as ea\n"
                         "t=time.perf_counter(); acc=ea.EventAccumulator(RUN+'/tb', size_guidance={ea.SCALARS: 1000})\n"
                         "acc.Reload(); n=sum(len(acc.Scalars(tag)) for tag in acc.Tags()['scalars'])\n"
                         "t=time.perf_counter()-t",
    "peer  json.loads list": "import json, glob\n"
                             "t=time.perf_counter(); rows=[json.loads(l) for l in open(RUN+'/tls/rank-0.jsonl')]\n"
                             "t=time.perf_counter()-t; n=len(rows)",
}
PROLOGUE = ("import sys, time; sys.path.insert(0, {root!r}); RUN={run!r}\n")
EPILOGUE = ("\nhwm=[l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]\n"
            "print(t, int(hwm) * 1024, n)")


def write_run(root: Path, steps: int) -> None:
    from torch.utils.tensorboard import SummaryWriter

    t0 = 1_700_000_000.0
    tb = SummaryWriter(str(root / "tb"))
    with Writer(root / "tls" / "rank-0.jsonl") as writer:
        for step in range(1, steps + 1):
            ts = t0 + step * 0.5
            values = {"loss": 3 + math.exp(-step / 5e4) + 0.05 * math.sin(step), "grad_norm": 1 + 0.1 * math.cos(step),
                      "learning_rate": 3e-4, "tokens_per_second": 5e5 + step % 101, "mfu": 0.42,
                      "step_time_seconds": 0.5, "data_wait_seconds": 0.01, "forward_backward_seconds": 0.4}
            writer.write(make_record(step=step, timestamp=ts, rank=0, metrics=values))
            for key in METRICS:
                tb.add_scalar(key, values[key], step, walltime=ts)
            if step % 1000 == 0:
                writer.write(make_record(step=step, timestamp=ts, rank=0, event={"type": "checkpoint_saved"}))
    tb.close()


def measure(case: str, run: Path) -> tuple[float, int, int]:
    code = PROLOGUE.format(root=str(ROOT), run=str(run)) + CASES[case] + EPILOGUE
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{case} failed:\n{done.stderr[-3000:]}")
    seconds, peak, items = done.stdout.split()
    return float(seconds), int(peak), int(items)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--write-docs", action="store_true", help="write the table into docs/benchmarks.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-report-") as tmp:
        run = Path(tmp)
        started = time.perf_counter()
        write_run(run, args.steps)
        size = (run / "tls" / "rank-0.jsonl").stat().st_size
        print(f"wrote {args.steps:,} steps ({size / 2**20:.0f} MiB TLS) in {time.perf_counter() - started:.0f}s",
              file=sys.stderr)
        results = {}
        for case in CASES:
            runs = [measure(case, run) for _ in range(args.repeat)]
            results[case] = (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs), runs[0][2])
            print(f"{case:24} {results[case][0]:8.2f} s {results[case][1] / 2**20:8.0f} MiB", file=sys.stderr)
    table = render(results, args, size)
    print(table)
    if args.write_docs:
        write_docs(table)
    return 0


def render(results: dict, args, size: int) -> str:
    tb_s, tb_mem, _ = results["peer  TensorBoard"]
    lines = [SECTION, "",
             f"`.venv/bin/python bench/bench_report.py --steps {args.steps} --repeat {args.repeat}` on this host "
             f"({args.steps:,} steps x {len(METRICS)} metrics, {size / 2**20:.0f} MiB of TLS; median of "
             f"{args.repeat} fresh interpreters; peak memory is VmHWM, imports included).", "",
             "| case | seconds | peak MiB | items | time / TensorBoard | memory / TensorBoard |",
             "|---|---:|---:|---:|---:|---:|"]
    for case, (seconds, peak, items) in results.items():
        lines.append(f"| {case.replace('  ', ': ')} | {seconds:.2f} | {peak / 2**20:.0f} | {items:,} | "
                     f"{seconds / tb_s:.2f} | {peak / tb_mem:.2f} |")
    lines += ["", "items: chart points kept (load_run), HTML bytes (report), scalars kept (TensorBoard, 1000 per "
              "tag by reservoir sampling), records (json.loads).", "",
              "load_run's memory is flat in the log's length; the report's memory above it is the goodput "
              "breakdown, which keeps a few numbers per step (`trainguard report --no-goodput` leaves it out). "
              "Measured on 2 shared cores with other work running: the ratios are the point."]
    return "\n".join(lines) + "\n"


def write_docs(table: str) -> None:
    path = ROOT / "docs" / "benchmarks.md"
    text = path.read_text() if path.exists() else "# Benchmarks\n\nEach area measures itself beside its peer.\n"
    if SECTION in text:
        start = text.index(SECTION)
        following = text.find("\n## ", start + len(SECTION))
        text = text[:start] + table + (text[following + 1:] if following >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + table
    path.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
