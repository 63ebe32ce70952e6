"""A stand-in trainer rank for the restore tests, started by real torchrun: it registers exactly as the
bundled trainer does (runtime/control.py write_rank_file) and then waits, as a hung rank would.

    torchrun --standalone --nproc-per-node 2 tests/alerts/standin_rank.py --run-dir RUN [--ignore-term] [--hold-log]

The agent accepts it only when its path is registered (``webhook.restore_entry_points``), or, with
`--hold-log`, as it accepts any loop on trainguard.protect: it holds its TLS log RUN/tls/rank-<r>.jsonl open
for writing, as a Protector's telemetry does.
"""

import os
import signal
import sys
import time

from trainguard import rundir, tls
from trainguard.runtime.control import write_rank_file

if __name__ == "__main__":
    run_dir = sys.argv[sys.argv.index("--run-dir") + 1]
    if "--ignore-term" in sys.argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if "--hold-log" in sys.argv:
        log = tls.Writer(rundir.rank_log(run_dir, int(os.environ.get("RANK", "0"))))
    write_rank_file(run_dir, int(os.environ.get("RANK", "0")))
    time.sleep(300)
