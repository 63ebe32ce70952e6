"""`--nproc K`: K local ranks through torch's elastic launcher (the machinery behind torchrun).

Rendezvous is c10d on the loopback interface, as ``torchrun --standalone`` does; a worker that dies or
is killed (the agent's ``restore``) makes the launcher restart every worker, up to ``max_restarts``
times, and each resumes from the newest verified checkpoint. Workers are the very command a multi-node
torchrun would start: ``python -m trainguard.trainer.train --run-dir RUN --config RUN/config.yaml``.
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

from trainguard import log


def launch(run_dir: Path, resolved_config: Path, *, nproc: int, max_restarts: int) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # torch shares the rendezvous TCP store across restart attempts; restarted gloo workers then read stale
    # peer addresses ("connectFullMesh ... Connection refused") and may hang for good, so an agent's
    # `restore` would not resume. A fresh store per attempt avoids it (multi-node torchrun: set it too).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"   # as torchrun does: K ranks must not each take every core
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=max_restarts,
        monitor_interval=0.5, start_method="spawn",
        # Each rank's output is also kept under RUN/logs (as torchrun --log-dir --tee 3 does), where the
        # agent's nccl collector reads NCCL warnings and watchdog timeouts.
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "logs"), tee=Std.ALL))
    worker = ("-m", "trainguard.trainer.train", "--run-dir", str(run_dir), "--config", str(resolved_config))
    try:
        elastic_launch(config, entrypoint=sys.executable)(*worker)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        log.get("launch").error("training failed", restarts_allowed=max_restarts, rank=rank,
                                exitcode=failure.exitcode, error_file=failure.error_file or None)
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0
