"""`--nproc K`: K local ranks through torch's elastic launcher (the machinery behind torchrun).

Rendezvous is c10d on the loopback interface, as ``torchrun --standalone`` does; a worker that dies or
is killed (the agent's ``restore``) makes the launcher restart every worker, up to ``max_restarts``
times, and each resumes from the newest verified checkpoint. Workers are the very command a multi-node
torchrun would start: ``python -m trainguard.trainer.train --run-dir RUN --config RUN/config.yaml``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from trainguard import log, rundir
from trainguard.node import node_name
from trainguard.runtime import flight_recorder

EXIT_CORDONED = 4       # this node is cordoned: it does not join the job


@dataclass(frozen=True)
class Nodes:
    """A multi-node job as torchrun's ``--nnodes MIN:MAX --rdzv-endpoint HOST:PORT --rdzv-id ID``: each
    node runs one launcher; they meet in torch's c10d rendezvous, which re-forms the job on the nodes left
    (at least MIN) when one leaves. The defaults are the single-node run."""
    min_nodes: int = 1
    max_nodes: int = 1
    rdzv_endpoint: str = ""
    rdzv_id: str = ""
    rdzv_configs: dict = field(default_factory=dict)


def parse_nnodes(text: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` (torchrun's spelling) -> (min, max); ValueError with the reason."""
    low, _, high = text.partition(":")
    try:
        bounds = (int(low), int(high or low))
    except ValueError:
        raise ValueError(f"--nnodes {text!r}: expected N or MIN:MAX") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise ValueError(f"--nnodes {text!r}: expected 1 <= MIN <= MAX")
    return bounds


def cordon_refusal(run_dir: Path, key_file: str | None = None) -> str | None:
    """Why this node must not join (an honoured cordon: RUN/control/cordon/<node>, signed with the run's
    checkpoint key, not revoked by `trainguard uncordon`, not expired), or None. A cordon that is not
    honoured (unsigned, forged, copied, revoked, expired) is ignored loudly:
    stderr, a ``cordon_ignored`` TLS event (trainguard/cordon/__init__.py), and the node joins."""
    from trainguard import cordon
    from trainguard.runtime.cordon_key import checker

    key = checker(key_file)
    key_path = key.where
    found = cordon.read_one(run_dir, node_name(), key)
    if found is None:
        return None
    if found.honoured:
        return (f"node {node_name()} is cordoned ({found.path}): it does not join the job until "
                f"`trainguard uncordon {run_dir} {node_name()}`")
    why = f"{found.why_refused()} (checked with the key {key_path})"
    try:
        count = cordon.record_ignored(run_dir, found, key_path)
    except OSError as exc:
        count, why = 0, f"{why}; the event could not be recorded: {exc}"
    hint = _ignored_hint(run_dir, found.refused)
    message = (f"trainguard train: WARNING: {why}: the cordon is NOT honoured and node {node_name()} joins the "
               f"job (ignored {count} time(s)); {hint}")
    print(message, file=sys.stderr, flush=True)
    log.get("launch").warning("cordon not honoured; joining", host=node_name(), reason=found.refused,
                              path=str(found.path), ignored_total=count)
    return None


def _ignored_hint(run_dir: Path, reason: str | None) -> str:
    """What a human does about a cordon that was not honoured, by why (trainguard/cordon/__init__.py)."""
    from trainguard import cordon

    uncordon = f"`trainguard uncordon {run_dir} {node_name()}`"
    if reason == cordon.REVOKED:
        return f"it was revoked: remove the copy with {uncordon}"
    if reason == cordon.EXPIRED:
        return f"if the node must stay out, cordon it again (`trainguard cordon`); remove the old one with {uncordon}"
    if reason == cordon.REVOCATIONS_UNREADABLE:
        return "no cordon is honoured until the revocation list proves itself (docs/incidents.md)"
    return f"if it is genuine, it was signed with another key (--key-file); remove it with {uncordon}"


def write_launcher_file(run_dir: Path, nodes: Nodes, replaces: str | None = None) -> Path:
    """``RUN/control/launchers/<node>.json``: this launcher, for the agent (the job's elastic bounds); a
    spare that joined says whose place it took (``spare``, ``replaces``)."""
    path = rundir.launcher_path(run_dir, node_name())
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{node_name()}.{os.getpid()}.tmp"
    spare = {"spare": True, "replaces": replaces} if replaces is not None else {}
    tmp.write_text(json.dumps({"host": node_name(), "pid": os.getpid(), "started_at": time.time(),
                               "min_nodes": nodes.min_nodes, "max_nodes": nodes.max_nodes, **spare}))
    os.replace(tmp, path)
    return path


def honoured_cordon(run_dir: Path, key_file: str | None = None) -> bool:
    """This node has a cordon that is honoured (signed, not revoked, not expired); quiet, for polling."""
    from trainguard import cordon
    from trainguard.runtime.cordon_key import checker

    found = cordon.read_one(run_dir, node_name(), checker(key_file))
    return found is not None and found.honoured


def wait_as_spare(run_dir: Path, key_file: str | None) -> "int | str":
    """A spare's wait outside the rendezvous (trainer/spare.py): the node it replaces, or the exit status."""
    from trainguard.runtime.cordon_key import checker
    from trainguard.trainer import spare

    log.get("launch").info("spare: waiting for a node of the job to be cordoned", host=node_name())
    outcome = spare.wait_for_vacancy(run_dir, node_name(), lambda: checker(key_file))
    if outcome.cordoned:
        log.get("launch").error(f"spare {node_name()} is cordoned: it does not join the job")
        return EXIT_CORDONED
    if outcome.completed or outcome.vacancy is None:
        log.get("launch").info("spare: the job completed; nothing to join", host=node_name())
        return 0
    spare.record_joined(run_dir, node_name(), outcome)
    return outcome.vacancy.node


def launch(run_dir: Path, resolved_config: Path, *, nproc: int, max_restarts: int,
           nodes: "Nodes | None" = None, key_file: str | None = None, config_sha256: str | None = None,
           spare: bool = False) -> int:
    """`config_sha256`: the digest of the configuration this launcher resolved, on every worker's command
    line (trainer/train.py checks it): anyone who can write RUN/config.yaml could otherwise change what the
    ranks train with at their next restart. `spare`: a hot spare (trainer/spare.py), which joins the job
    only in the place of a node the job's cordon keeps out."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    from trainguard.trainer import spare as spare_role

    # torch shares the rendezvous TCP store across restart attempts; restarted gloo workers then read stale
    # peer addresses ("connectFullMesh ... Connection refused") and may hang for good, so an agent's
    # `restore` would not resume. A fresh store per attempt avoids it (multi-node torchrun: set it too).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"   # as torchrun does: K ranks must not each take every core
    flight_recorder.enable()              # every rank records its collectives (agent/evidence.py asks)
    nodes = nodes or Nodes()
    if (refusal := cordon_refusal(run_dir, key_file)) is not None:
        log.get("launch").error(refusal)
        return EXIT_CORDONED
    replaces = None
    if spare:
        if not isinstance(waited := wait_as_spare(run_dir, key_file), str):
            return waited
        replaces = waited
    write_launcher_file(run_dir, nodes, replaces)
    # Several nodes: this node's cordon is looked at before each rendezvous round and while it trains
    # (trainer/spare.py): a cordoned node leaves and does not come back, whoever ends its launcher.
    guarded = nodes.max_nodes > 1

    def cordoned() -> bool:
        return honoured_cordon(run_dir, key_file)

    watch = spare_role.CordonWatch(cordoned, lambda: os.kill(os.getpid(), signal.SIGTERM)) if guarded else None
    config = LaunchConfig(
        min_nodes=nodes.min_nodes, max_nodes=nodes.max_nodes, nproc_per_node=nproc,
        run_id=nodes.rdzv_id or str(uuid.uuid4()),
        rdzv_backend=spare_role.guarded_rendezvous_backend(cordoned) if guarded else "c10d",
        rdzv_endpoint=nodes.rdzv_endpoint or "127.0.0.1:0", rdzv_configs=dict(nodes.rdzv_configs),
        max_restarts=max_restarts,
        monitor_interval=0.5, start_method="spawn",
        # Each rank's output is also kept under RUN/logs (as torchrun --log-dir --tee 3 does), where the
        # agent's nccl collector reads NCCL warnings and watchdog timeouts.
        logs_specs=DefaultLogsSpecs(log_dir=str(rundir.logs_dir(run_dir)), tee=Std.ALL))
    worker = ("-m", "trainguard.trainer.train", "--run-dir", str(run_dir), "--config", str(resolved_config),
              *(("--config-sha256", config_sha256) if config_sha256 else ()))
    try:
        if watch is not None:
            watch.start()
        elastic_launch(config, entrypoint=sys.executable)(*worker)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        log.get("launch").error("training failed", restarts_allowed=max_restarts, rank=rank,
                                exitcode=failure.exitcode, error_file=failure.error_file or None)
        return failure.exitcode if failure.exitcode > 0 else 1
    except spare_role.Cordoned:
        log.get("launch").error(f"node {node_name()} is cordoned: it left the job's rendezvous")
        return EXIT_CORDONED
    except SignalException:
        if not guarded or not cordoned():
            raise
        spare_role.leave_rendezvous()      # ended because cordoned (the agent, or the watch): out at once
        log.get("launch").error(f"node {node_name()} is cordoned: its launcher ended and left the rendezvous")
        return EXIT_CORDONED
    finally:
        if watch is not None:
            watch.stop()
    return 0
