"""Replay of a whole run directory: records per second of `trainguard replay RUN`, beside the floors.

    .venv/bin/python bench/bench_replay_rundir.py                     # 64 ranks x 15,625 steps (1M records)
    .venv/bin/python bench/bench_replay_rundir.py --steps 4000 --repeat 1 --shape cpu,hang

It writes a run directory with the trainer's own writer (`runtime.telemetry.StepTelemetry`, one
`RUN/tls/rank-<r>.jsonl` per rank: the records `trainguard train` writes, layer norms, memory, the
monotonic clock; rank 0's written by it, the others its bytes with their rank and node) for `--ranks`
ranks on nodes of 8, and each node's joined agent log with the agent's own
code (`agent.nodelog.join_fragments` and `RotatingFile`, which rotates it to `node-<host>.jsonl.N.gz`);
the first ranks' logs are rotated as well (`rank-<r>.jsonl.2.gz`, `.1.zst`, the live file). Shapes:

  cuda   what a GPU run writes: every rank record says `system.gpu_count` (the world's count)
  cpu    what a CPU run writes: gpu_count 0, so the GPUs billed come from the node logs in merged order
         (parallel.py holds the lead steps until every file is read)
  hang   the cuda shape with a hang: every rank stops for HANG_SECONDS (past the policy's stall_seconds)
         a third of the way in while the agents' node logs go on sampling the step that stands still, so
         the stall pass runs (timeline.stall_notices: every file read again) and the watchdog restores

and times, each the best of `--repeat` (json.loads and the one-process path once: they are slow), over
the same files:

  json.loads            every line of every file (decompressed) through Python's json, one process
  msgspec floor         the same bytes through msgspec's typed decoder (replay's Record), one process:
                        the decode floor, nothing picked or decided
  msgspec floor, N CPU  the same on one process per CPU, a file each (the floor of any parallel replay)
  replay, one process   `TRAINGUARD_REPLAY_ONE_PROCESS=1 trainguard replay RUN --json` (the merged stream)
  replay RUN            `trainguard replay RUN --json`, a subprocess, end to end (interpreter start included)
  replay RUN, in-proc   trainguard.replay.timeline.replay_logs([RUN]) in this process (no start-up)

  start-up              `trainguard replay` of a one-record log (the interpreter and the imports: what the
                        subprocess row pays beyond the in-process one)

with the peak RSS of the largest process of each `trainguard replay` (the main one or a worker), and of
`trainguard replay` of one rank's log alone: memory stays flat when the two are alike. The machine's load
average is printed before and after: the helpers that share it depress every row alike, so the ratios to
the msgspec floor are the figures to compare.

Before timing, `python -m compileall -q` is run over the project's packages: users have .pyc files, and a
sandbox with PYTHONDONTWRITEBYTECODE=1 would otherwise compile every module at every start (~0.14 s).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # the trainer's and the agent's packages

from timing import best_of  # noqa: E402
from trainguard import tls  # noqa: E402
from trainguard.replay import columns, parallel, source, timeline  # noqa: E402

TARGET = 1_000_000
ROOT = Path(__file__).resolve().parents[1]
START = 1_710_512_538.0
STEP_SECONDS = 0.25
NODE_INTERVAL = 5.0
LAYERS = {"embed": 0.5, "h.0": 0.4, "h.1": 0.4, "ln_f": 0.02}
ROTATED_RANKS = 4
HANG_SECONDS = 150.0        # the hang shape's pause: past the default policy's stall_seconds (60)
SHAPES = ("cuda", "cpu", "hang")


# ------------------------------------------------------------------------------------------ the run

def write_run(root: Path, ranks: int, steps: int, shape: str) -> None:
    """Rank 0's log by the trainer's writer; every other rank's the same bytes with its rank and node (the
    loss and the norms are global: every rank logs the same), so a million records are written in seconds."""
    from trainguard.runtime.telemetry import StepTelemetry

    rng = random.Random(1)
    telemetry = StepTelemetry(root, rank=0, world_size=ranks, run_id="bench", node="node-0",
                              gpu_count=None if shape == "cpu" else ranks, flops_per_token=6e9, peak_flops=989e12)
    hang_after = steps // 3 if shape == "hang" else None
    for step in range(1, steps + 1):
        telemetry.step(step, loss=3.0 * (1 + 1000 / (step + 1000)) + rng.gauss(0, 0.02),
                       grad_norm=0.8 + rng.random() * 0.1, learning_rate=3e-4,
                       grad_norm_by_layer={k: v * (1 + rng.random() * 0.2) for k, v in LAYERS.items()},
                       timings={"data_wait_seconds": 0.001, "forward_backward_seconds": 0.2,
                                "optimizer_seconds": 0.03, "step_time_seconds": STEP_SECONDS},
                       tokens=32768, samples=64, timestamp=_time_of(step, hang_after))
    telemetry.close()
    lead = telemetry.path.read_bytes()
    assert lead.count(b'"node":"node-0","rank":0,') == steps, "the trainer's envelope changed: update the bench"
    for rank in range(1, ranks):
        (root / "tls" / f"rank-{rank}.jsonl").write_bytes(
            lead.replace(b'"node":"node-0","rank":0,', f'"node":"node-{rank // 8}","rank":{rank},'.encode()))
    for rank in range(min(ROTATED_RANKS, ranks)):
        _rotate(root / "tls" / f"rank-{rank}.jsonl")
    for node in range(max(1, ranks // 8)):
        _node_log(root, f"node-{node}", steps, hang_after)


def _time_of(step: int, hang_after: int | None) -> float:
    """When a step was logged: every STEP_SECONDS, and HANG_SECONDS later after the hang."""
    return START + step * STEP_SECONDS + (HANG_SECONDS if hang_after is not None and step > hang_after else 0.0)


def _rotate(live: Path) -> None:
    """Cut a rank's log in three, as rotation leaves it: the oldest third gzip'd, the next zstd'd."""
    lines = live.read_bytes().splitlines(keepends=True)
    third = len(lines) // 3
    (live.parent / f"{live.name}.2.gz").write_bytes(_gzip(b"".join(lines[:third])))
    (live.parent / f"{live.name}.1.zst").write_bytes(zstandard.ZstdCompressor().compress(b"".join(lines[third:2 * third])))
    live.write_bytes(b"".join(lines[2 * third:]))


def _gzip(data: bytes) -> bytes:
    import gzip

    return gzip.compress(data, compresslevel=6)


def _node_log(root: Path, node: str, steps: int, hang_after: int | None) -> None:
    """The agent's joined node log: the training run's latest step and 8 GPUs' readings, every interval
    (through a hang as well: the step it samples stands still)."""
    from agent.nodelog import RotatingFile, join_fragments

    out = RotatingFile(root / "tls" / f"{node}.jsonl", max_bytes=1 << 20, keep=20)
    every = int(NODE_INTERVAL / STEP_SECONDS)
    when, step = START + every * STEP_SECONDS, every
    while step <= steps:
        while step < steps and _time_of(step + 1, hang_after) <= when:
            step += 1
        gpus = [{"gpu": g, "uuid": f"GPU-{node}-{g}", "lost": False, "xid_errors": 0, "gpu_util": 97.0,
                 "gpu_temp_c": 61.0, "gpu_power_w": 640.0, "mem_used_bytes": 70 << 30, "mem_total_bytes": 80 << 30,
                 "mem_util": 87.5} for g in range(8)]
        fragments = {"gpu": {"hardware": {"gpus": gpus, "gpu_util": 97.0}, "system": {"gpu_count": 8}},
                     "training": {"run_id": "bench", "step": step,
                                  "metrics": {"loss": 3.0, "grad_norm": 0.8, "step_time_seconds": STEP_SECONDS}}}
        out.write(tls.encode(join_fragments(fragments, node, when + 0.01)))
        if step == steps:
            break
        when += NODE_INTERVAL
    out.close()


# ------------------------------------------------------------------------------------------ floors

def _data(path: Path) -> bytes:
    with tls.open_log(path) as handle:
        return handle.read()


def json_floor(files: list[Path]) -> int:
    count = 0
    for path in files:
        for line in _data(path).splitlines():
            json.loads(line)
            count += 1
    return count


_RECORDS = msgspec.json.Decoder(source.Record)


def msgspec_file(path: Path) -> int:
    return len(_RECORDS.decode_lines(_data(path)))


def msgspec_floor(files: list[Path]) -> int:
    return sum(map(msgspec_file, files))


def msgspec_floor_parallel(files: list[Path], workers: int) -> int:
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return sum(pool.imap_unordered(msgspec_file, sorted(files, key=lambda p: -p.stat().st_size)))


# ------------------------------------------------------------------------------------------ replay runs

RSS_WRAPPER = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE); "
               "u = resource.getrusage(resource.RUSAGE_CHILDREN); "
               "sys.stderr.write(f'{u.ru_maxrss} {u.ru_utime + u.ru_stime}'); "
               "sys.stdout.buffer.write(r.stdout); sys.exit(r.returncode)")


def replay_subprocess(target: Path, one_process: bool) -> tuple[float, dict, int, float]:
    """(seconds, the JSON document, peak RSS in KiB of the largest process, CPU seconds of all its processes)
    of `trainguard replay TARGET --json`."""
    env = {k: v for k, v in os.environ.items() if k != parallel.ONE_PROCESS_ENV}
    if one_process:
        env[parallel.ONE_PROCESS_ENV] = "1"
    command = [sys.executable, "-c", RSS_WRAPPER, str(Path(sys.executable).with_name("trainguard")), "replay",
               str(target), "--json"]
    began = time.perf_counter()
    done = subprocess.run(command, capture_output=True, env=env, check=True)
    seconds = time.perf_counter() - began
    rss, cpu = done.stderr.decode().strip().splitlines()[-1].split()
    return seconds, json.loads(done.stdout), int(rss), float(cpu)


def best_subprocess(repeat: int, target: Path, one_process: bool) -> tuple[float, dict, int, float]:
    runs = [replay_subprocess(target, one_process) for _ in range(repeat)]
    best = min(runs, key=lambda r: r[0])
    return best[0], best[1], max(r[2] for r in runs), best[3]


def cpu_of(run) -> float:
    """CPU seconds of `run()` in this process and the workers it forks (reaped children)."""
    began = time.process_time() + _children_cpu()
    run()
    return time.process_time() + _children_cpu() - began


def _children_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def compile_tree() -> None:
    """What users have: the .pyc files of the project's packages (pip writes those of the rest)."""
    packages = [str(ROOT / name) for name in ("trainguard", "agent", "trainer") if (ROOT / name).is_dir()]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *packages], check=True, stdout=subprocess.DEVNULL)


def start_up(folder: Path, repeat: int) -> float:
    """Seconds of `trainguard replay` of a one-record log: the interpreter, the imports, the output."""
    log = folder / "one.jsonl"
    log.write_bytes(tls.encode({"timestamp": START, "rank": 0, "step": 1, "metrics": {"loss": 1.0, "grad_norm": 1.0}}))
    return best_subprocess(repeat, log, one_process=False)[0]


def measure(run: Path, repeat: int) -> tuple[list[tuple[str, int, float]], dict]:
    """The rows (what, records, seconds); the slow peers (json.loads, the one-process path) run once."""
    files = source.expand([run])
    cpus = columns.available_cpus()
    records = msgspec_floor(files)
    rows = [("json.loads per line", records, best_of(1, lambda: json_floor(files))),
            ("msgspec floor, 1 CPU (typed Record)", records, best_of(repeat, lambda: msgspec_floor(files))),
            (f"msgspec floor, {cpus} CPUs (a file each)", records,
             best_of(repeat, lambda: msgspec_floor_parallel(files, cpus)))]
    floor_cpu = cpu_of(lambda: msgspec_floor(files))
    floor_all_cpu = cpu_of(lambda: msgspec_floor_parallel(files, cpus))
    seconds, reference, _, reference_cpu = best_subprocess(1, run, one_process=True)
    rows.append(("trainguard replay RUN, one process", reference["records"], seconds))
    seconds, found, rss, found_cpu = best_subprocess(repeat, run, one_process=False)
    assert found == reference, "the parallel path must print the one-process path's JSON"
    rows.append(("trainguard replay RUN (subprocess)", found["records"], seconds))
    rows.append(("replay_logs([RUN]) in this process", found["records"],
                 best_of(repeat, lambda: timeline.replay_logs([run]))))
    in_process_cpu = cpu_of(lambda: timeline.replay_logs([run]))
    _, one, rss_one, _ = best_subprocess(1, run / "tls" / "rank-9.jsonl", one_process=False)
    facts = {"records": records, "files": len(files), "bytes": sum(p.stat().st_size for p in files),
             "steps": found["steps"], "duplicate_steps": found["duplicate_steps"], "actions": len(found["actions"]),
             "stall_restores": sum(a["source"] == "stall" for a in found["actions"]),
             "peak_rss_kib": rss, "peak_rss_kib_one_rank_log": rss_one, "one_rank_records": one["records"],
             "start_up_seconds": start_up(run.parent, repeat),
             "cpus": cpus, "cpu_seconds": {"msgspec floor, 1 CPU": floor_cpu, f"msgspec floor, {cpus} CPUs": floor_all_cpu,
                                           "replay RUN (subprocess)": found_cpu, "replay_logs in process": in_process_cpu,
                                           "replay RUN, one process": reference_cpu}}
    return rows, facts


def report(rows: list[tuple[str, int, float]]) -> str:
    """Each row's rate, and its ratio to json.loads and to the msgspec floor on one CPU and on all."""
    json_rate, floor_one, floor_all = (rows[i][1] / rows[i][2] for i in range(3))
    lines = [f"{'what':42} {'records':>10} {'seconds':>8} {'records/s':>11} {'x json':>7} {'x floor1':>8} "
             f"{'x floorN':>8} {'target':>7}"]
    for what, count, seconds in rows:
        rate = count / seconds
        lines.append(f"{what:42} {count:10,d} {seconds:8.3f} {rate:11,.0f} {rate / json_rate:7.2f} "
                     f"{rate / floor_one:8.2f} {rate / floor_all:8.2f} {'yes' if rate >= TARGET else 'no':>7}")
    return "\n".join(lines)


def one_shape(args, shape: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-rundir-") as folder:
        run = Path(folder) / "run"
        began = time.perf_counter()
        write_run(run, args.ranks, args.steps, shape)
        print(f"run directory ({shape}): {args.ranks} ranks x {args.steps:,} steps, written in "
              f"{time.perf_counter() - began:.0f} s; best of {args.repeat}; target {TARGET:,} records/s", flush=True)
        load_before = os.getloadavg()
        rows, facts = measure(run, args.repeat)
        load_after = os.getloadavg()
    print(f"{facts['files']} files, {facts['bytes'] / 1e6:.0f} MB, {facts['records']:,} records; decided "
          f"{facts['steps']:,} steps (rank 0), {facts['duplicate_steps']:,} copies skipped, {facts['actions']} actions"
          + (f" ({facts['stall_restores']} by the stall watchdog)" if shape == "hang" else ""))
    print(report(rows))
    print(f"start-up (`trainguard replay` of a one-record log, .pyc compiled): {facts['start_up_seconds']:.3f} s")
    print(f"peak RSS (largest process): replay RUN {facts['peak_rss_kib'] / 1024:.0f} MiB; replay of one rank's log "
          f"({facts['one_rank_records']:,} records) {facts['peak_rss_kib_one_rank_log'] / 1024:.0f} MiB")
    cpu = facts["cpu_seconds"]
    print("CPU seconds (all processes; less disturbed by a shared machine than wall time): "
          + ", ".join(f"{what} {seconds:.2f} ({facts['records'] / seconds:,.0f} records per CPU-second)"
                      for what, seconds in cpu.items()))
    print(f"load average: {' '.join(f'{x:.2f}' for x in load_before)} before, "
          f"{' '.join(f'{x:.2f}' for x in load_after)} after; {facts['cpus']} CPUs", flush=True)
    return {"shape": shape, "rows": [{"what": w, "records": n, "seconds": s} for w, n, s in rows],
            "facts": facts, "load": [load_before, load_after]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--steps", type=int, default=15_625, help="steps per rank (64 x 15,625 = 1M records)")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--shape", default="cuda", help=f"one or more of {', '.join(SHAPES)}, comma-separated")
    parser.add_argument("--json", action="store_true", help="print the results as JSON too (one line, last)")
    args = parser.parse_args(argv)
    shapes = args.shape.split(",")
    if not set(shapes) <= set(SHAPES):
        parser.error(f"--shape: one or more of {', '.join(SHAPES)}")
    compile_tree()
    print("compiled the project's .pyc files first (python -m compileall -q trainguard agent trainer)")
    results = [one_shape(args, shape) for shape in shapes]
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
