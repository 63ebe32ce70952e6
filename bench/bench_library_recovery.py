"""The library's recovery (docs/library.md "Recovery"): the documented loop on two processes over gloo on
loopback, an exception in rank 1's step, under each recovery path, in one run.

    .venv/bin/python bench/bench_library_recovery.py                  # 1 run of each, steps 20, fault at 18
    .venv/bin/python bench/bench_library_recovery.py --runs 3

Each run starts two workers of tests/library/recovering_loop.py (the loop exactly as docs/library.md writes
it; RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT as torchrun sets them), checkpoint every 10 steps, and rank 1
raises after its backward in step `--fault-at`:

  restart      `recovery.mode: restart`: both processes end (rank 0's collective fails when rank 1's
               connections close); the bench starts both again, as torchrun would, and they resume from
               the newest verified checkpoint
  snapshot     `in_process` with `max_in_process_restarts: 0`: the same restart, and the new processes load
               the snapshot taken on top of that checkpoint: the path of the Transformers and Lightning
               callbacks (no in-process restart under their Trainers)
  in_process   the group re-formed and the snapshot restored in the same processes

  fault -> next step   rank 0's last step record before the fault to its first one after the recovery
                       (one step's work included: the fault is in the step after that record)
  work lost            that last step less the step the run went on from
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.servers import free_port  # noqa: E402
from trainguard import tls  # noqa: E402
from trainguard.runtime import cordon_key  # noqa: E402

PATHS = {"restart": {"mode": "restart"}, "snapshot": {"mode": "in_process", "max_in_process_restarts": 0},
         "in_process": {"mode": "in_process"}}


def launch(run: Path, policy: Path, steps: int, fault_at: int, env: dict) -> list[int]:
    """Both ranks, until they end; their exit codes."""
    env = {**env, "MASTER_PORT": str(free_port())}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.library.recovering_loop", str(run), str(steps),
                               str(fault_at), str(policy), str(run.parent / f"out-{rank}.json")],
                              env={**env, "RANK": str(rank)}, cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
             for rank in range(2)]
    return [proc.wait(timeout=600) for proc in procs]


def one(path: str, steps: int, fault_at: int, work: Path) -> dict:
    work.mkdir(parents=True)
    shm = work / "shm"
    shm.mkdir(mode=0o700)
    policy = work / "policy.yaml"
    recovery = {**PATHS[path], "snapshot_every": 5, "snapshot_dir": str(shm)}
    policy.write_text("recovery:\n" + "".join(f"  {key}: {value}\n" for key, value in recovery.items()))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2", "PYTHONPATH": str(ROOT),
           "TRAINGUARD_CHECKPOINT_KEY": str(work / "checkpoint.key")}
    os.environ["TRAINGUARD_CHECKPOINT_KEY"] = env["TRAINGUARD_CHECKPOINT_KEY"]
    cordon_key.signing_key(None, create=True)          # one key for both ranks, made before they start
    run = work / "run"
    codes = launch(run, policy, steps, fault_at, env)
    if path != "in_process":
        assert codes != [0, 0], f"{path}: the fault did not end the workers"
        codes = launch(run, policy, steps, 0, env)     # the launcher's restart: no fault this time
    assert codes == [0, 0], f"{path}: exit codes {codes}"
    records = [r for r in tls.read_records(run / "tls" / "rank-0.jsonl") if "metrics" in r]
    trained = [r["step"] for r in records]
    back = next(i for i in range(1, len(trained)) if trained[i] <= trained[i - 1])
    last, after = records[back - 1], records[back]
    return {"seconds": after["timestamp"] - last["timestamp"], "lost": last["step"] - (after["step"] - 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--fault-at", type=int, default=18)
    args = parser.parse_args(argv)
    found: dict[str, list[dict]] = {path: [] for path in PATHS}
    with tempfile.TemporaryDirectory(prefix="bench-library-recovery-") as tmp:
        for index in range(args.runs):
            for path in PATHS:
                began = time.perf_counter()
                result = one(path, args.steps, args.fault_at, Path(tmp) / f"{path}-{index}")
                found[path].append(result)
                print(f"{path:10s} run {index}: fault -> next step {result['seconds']:.2f} s, work lost "
                      f"{result['lost']} steps ({time.perf_counter() - began:.0f} s wall)", flush=True)
    base = statistics.median(r["seconds"] for r in found["restart"])
    print("\n| path | fault -> next step (s), median | work lost (steps) | ratio to restart |\n|---|---:|---:|---:|")
    for path, results in found.items():
        seconds = statistics.median(r["seconds"] for r in results)
        lost = sorted({r["lost"] for r in results})
        print(f"| {path} | {seconds:.2f} | {', '.join(map(str, lost))} | {seconds / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
