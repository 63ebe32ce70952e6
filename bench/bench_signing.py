"""What authentication costs (docs/reliability.md): the trainer's check of a signed control
request, and the agent's actions-log record signed beside the same record unsigned, in one run:

    .venv/bin/python bench/bench_signing.py [--n 20000]

Both are paid once per request or action, never per training step (rank 0 checks a request only when a new
line arrives in control/actions.jsonl). Wall and CPU microseconds per call; the load average is printed,
since the figures mean little on a busy machine.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from trainguard import rundir, tls
from trainguard.agent.executor import EventLog


def per_call(fn, n: int) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(n):
        fn()
    return (time.perf_counter() - wall) / n * 1e6, (time.process_time() - cpu) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20000)
    args = parser.parse_args()
    key = b"k" * 32
    with tempfile.TemporaryDirectory() as folder:
        run = Path(folder)
        request = rundir.sign_request(key, rundir.request("cost_warn", "cost-cost_warn", alertname="CostBudgetWarn",
                                                          reason="over"), run, by="agent:n1")
        record = {**tls.event("action", timestamp=1732870000.1, id="x", outcome="issued", alertname="A",
                              reason="r"), "node": "n1"}
        signed_log, plain_log = EventLog(run / "a.jsonl", key, "n1"), EventLog(run / "b.jsonl")
        rows = [("check a signed control request", per_call(lambda: rundir.check_request(key, request, run), args.n)),
                ("actions-log record, unsigned", per_call(lambda: plain_log._line(record), args.n // 4)),
                ("actions-log record, signed", per_call(lambda: signed_log._line(record), args.n // 4))]
    for name, (wall, cpu) in rows:
        print(f"{name:34s} {wall:8.1f} µs wall {cpu:8.1f} µs CPU")
    print("load average", " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
