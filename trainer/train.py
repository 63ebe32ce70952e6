"""One rank of the bundled trainer: ``python -m trainguard.trainer.train --run-dir RUN [flags]``.

This is what torch's elastic launcher starts on every rank, locally (``trainguard train --nproc K``) or
across nodes with torchrun directly (see docs/trainer.md). It joins the process group torchrun set up in
the environment (gloo on CPU, NCCL on GPU), builds the `Trainer` and runs it; the exit code tells the
launcher what happened (0 done or cost-stopped, 3 stopped by the guard).
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from trainguard import log
from trainguard.runtime import flight_recorder
from trainguard.trainer import cli
from trainguard.trainer.config import ConfigError, TrainConfig
from trainguard.trainer.loop import DistInfo, Trainer
from trainguard.runtime.resilience.inprocess import ProcessGroups
from trainguard.runtime.resilience.standby import Supervisor

# A rank that hangs is found by the agent's TrainingStalled alert and restarted; the collective timeout
# is the backstop when no agent runs.
COLLECTIVE_TIMEOUT = timedelta(minutes=30)


def run_worker(config: TrainConfig, run_dir: Path, *, replacing: bool = False) -> int:
    """`replacing`: a standby promoted in a killed rank's place (runtime/resilience/standby.py)."""
    info = DistInfo.from_env()
    joined = False
    groups = None
    if info.world_size > 1 and not dist.is_initialized():
        cuda = config.run.device == "cuda" or config.run.device == "auto" and torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(info.local_rank)
        flight_recorder.enable()          # before the process group exists: it reads the buffer size then
        groups = in_process_groups(config, info, "nccl" if cuda else "gloo")
        if groups is not None and replacing:   # it forms the group when it meets the survivors (take_over)
            groups.replacing = True
        elif groups is not None:          # docs/recovery.md: the group is re-formed in-process on a failure
            groups.form()
            groups.watch()
        else:
            dist.init_process_group("nccl" if cuda else "gloo", timeout=COLLECTIVE_TIMEOUT)
        joined = True
        flight_recorder.start(run_dir, info.rank, log.get("trainer.flight_recorder", rank=info.rank))
    try:
        code = Trainer(config, run_dir, info, groups=groups).run()
        if joined:
            # Leave together: rank 0 may still be writing the final checkpoint, and gloo aborts (SIGABRT)
            # a rank whose peer tears the connection down under it.
            dist.barrier()
        return code
    finally:
        if joined:
            dist.destroy_process_group()


def in_process_groups(config: TrainConfig, info: DistInfo, backend: str) -> ProcessGroups | None:
    """The job's process groups, re-formable in-process, when the policy's `recovery.mode` is in_process;
    None for `restart` (today's path) and for FSDP2 (its device mesh is not rebuilt in-process yet)."""
    from trainguard import policy as policy_mod
    from trainguard.trainer import parallel

    settings = policy_mod.load(config.run.policy or None).recovery
    if settings.mode != "in_process" or config.run.parallel == parallel.FSDP2:
        return None
    return ProcessGroups.from_env(backend, info.rank, info.world_size, timeout=COLLECTIVE_TIMEOUT,
                                  barrier_seconds=settings.barrier_seconds,
                                  log=log.get("trainer.recovery", rank=info.rank))


def standby_supervisor(config: TrainConfig, run_dir: Path) -> Supervisor | None:
    """This process as the supervisor of its rank and a warm standby (runtime/resilience/standby.py), when
    the policy keeps standbys and a killed rank can be replaced: under torch's elastic launcher, a world of
    several, in-process recovery, and the job's store not served by this very process (torchrun's
    agent serves it, or another rank does). None: the rank runs in this process, as before."""
    from trainguard import policy as policy_mod
    from trainguard.trainer import parallel

    info = DistInfo.from_env()
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if "TORCHELASTIC_RUN_ID" not in os.environ or info.world_size < 2 or info.rank == 0 and not agent_store:
        return None
    settings = policy_mod.load(config.run.policy or None).recovery
    if settings.mode != "in_process" or settings.standbys < 1 or config.run.parallel == parallel.FSDP2:
        return None
    return Supervisor(run_rank=lambda: run_worker(config, run_dir),
                      replace_rank=lambda identity: run_worker(config, run_dir, replacing=True),
                      max_promotions=settings.max_in_process_restarts, standbys=settings.standbys,
                      log=log.get("trainer.standby", rank=info.rank))


def die_with_launcher() -> None:
    """Ask Linux to SIGKILL this rank when its launcher dies: a rank without its elastic agent can never
    rendezvous again, and a hung one would otherwise hold its memory and GPU forever."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() == 1:       # the launcher died before prctl took effect
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    die_with_launcher()
    parser = argparse.ArgumentParser(prog="python -m trainguard.trainer.train",
                                     description="one rank of the bundled trainer (started by torchrun)")
    cli.add_config_arguments(parser)
    parser.add_argument("--config-sha256", metavar="HEX", default=None,
                        help="the launcher's digest of the configuration: train only on exactly that one")
    args = parser.parse_args(argv)
    log.configure()
    try:
        config = cli.build_config(args)
    except ConfigError as exc:
        print(f"trainguard train: {exc}", file=sys.stderr)
        return 2
    if args.config_sha256 is not None and cli.config_digest(config) != args.config_sha256:
        # The launcher resolved one configuration and wrote it to RUN/config.yaml; this worker (a restart,
        # later) read another: someone changed the file. Training on it would let them choose the steps,
        # the LR or the policy.
        print(f"trainguard train: {args.config}: not the configuration the launcher resolved (SHA-256 "
              f"{args.config_sha256[:16]}…): it was changed after the launcher wrote it; refusing to train on it",
              file=sys.stderr)
        return 2
    run_dir = args.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    if DistInfo.from_env().rank == 0:   # started by torchrun directly: record what the ranks train with
        cli.write_resolved(config, run_dir)
    supervisor = standby_supervisor(config, run_dir)
    if supervisor is not None:        # the rank and its standby are its children; it reports the rank's exit
        return supervisor.run()
    return run_worker(config, run_dir)


def leave(code: int) -> None:
    """End a rank of several without the interpreter's teardown: the process group is destroyed and every
    record is on disk (one os.write each), but C++ destructors of gloo's threads at exit can still abort
    a finished rank ("terminate called without an active exception", SIGABRT), which the launcher then
    reports as a failed run."""
    if DistInfo.from_env().world_size > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    leave(main())
