"""`trainguard train`: the bundled trainer's command line.

    trainguard train --run-dir runs/a --steps 200 --checkpoint-every 50 --inject nan@40
    trainguard train --run-dir runs/b --nproc 2 --max-restarts 3      # two local ranks, torchrun-style

The configuration is resolved once here (preset or ``--config`` file, then ``--set``, then flags),
checked, and written to ``RUN/config.yaml``; every rank then reads that one file.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from pathlib import Path

from trainguard import rundir, safe_read
from trainguard.exits import int_at_least
from trainguard.trainer import config as cfg
from trainguard.trainer.faults import FaultError, parse as parse_fault

# flag -> (section, key): flags override the config file.
FLAG_KEYS = {
    "steps": ("run", "steps"), "seed": ("run", "seed"), "device": ("run", "device"),
    "checkpoint_every": ("run", "checkpoint_every"), "keep_last": ("run", "keep_last"),
    "checkpoint_every_seconds": ("run", "checkpoint_every_seconds"),
    "key_file": ("run", "key_file"), "eval_every": ("run", "eval_every"), "policy": ("run", "policy"),
    "peak_flops": ("run", "peak_flops"), "run_id": ("run", "run_id"), "log_every": ("run", "log_every"),
    "data": ("data", "path"), "batch_size": ("optim", "batch_size"),
    "micro_batch_size": ("optim", "micro_batch_size"), "lr": ("optim", "lr"),
    "schedule": ("optim", "schedule"), "schedule_preset": ("optim", "schedule_preset"),
    "clip_rule": ("optim", "clip_rule"),
    "parallel": ("run", "parallel"), "shadow": ("run", "shadow"),
}


AUTO = "auto"


def _steps_or_auto(text: str) -> int | str:
    """`--checkpoint-every`: a number of steps, or `auto` (the checkpoint autopilot)."""
    if text == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of steps or 'auto', got {text!r}") from None


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every rank understands (also `python -m trainguard.trainer.train` under torchrun)."""
    parser.add_argument("--run-dir", type=Path, required=True, help="run directory (TLS logs, checkpoints, control)")
    parser.add_argument("--config", metavar="FILE|PRESET",
                        help="YAML config file or preset name (tiny, small, gpt2); default tiny on CPU, small on GPU")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value, e.g. --set model.n_layer=4 (repeatable)")
    parser.add_argument("--steps", type=int, help="optimizer steps to train to")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--checkpoint-every", type=_steps_or_auto, metavar="N|auto",
                        help="save a verified checkpoint every N steps; auto: the checkpoint autopilot chooses the "
                             "interval from the run's measured failures, save and restart costs")
    parser.add_argument("--checkpoint-every-seconds", type=float, metavar="S",
                        help="also save when S seconds have passed since the last checkpoint "
                             "(default 300; 0: by steps only)")
    parser.add_argument("--keep-last", type=int, metavar="N", help="checkpoints to keep (plus the newest stable one)")
    parser.add_argument("--key-file", help="HMAC key file for checkpoint manifests")
    parser.add_argument("--async-checkpoint", action="store_true", default=None,
                        help="write checkpoints on a background thread")
    parser.add_argument("--inject", action="append", default=[], metavar="KIND@STEP[:RANK]",
                        help="inject a fault: nan, spike, gradexplode, hang, crash, slowio, corrupt-checkpoint, "
                             "bitflip, gradflip")
    parser.add_argument("--telemetry", choices=("on", "off"), help="per-step TLS records (default on)")
    parser.add_argument("--policy", metavar="FILE", help="policy YAML (guard thresholds)")
    parser.add_argument("--shadow", action="store_true", default=None,
                        help="shadow mode: every action (skip, rollback, stop, the agent's requests) is decided and "
                             "recorded as a shadow_action event, none is carried out (the policy's actions.mode)")
    parser.add_argument("--data", metavar="DIR|GLOB",
                        help="text directory or uint16 .bin shards (default: Python stdlib source)")
    parser.add_argument("--batch-size", type=int, help="sequences per rank per optimizer step")
    parser.add_argument("--micro-batch-size", type=int, help="sequences per forward pass (gradient accumulation)")
    parser.add_argument("--lr", type=float, help="peak learning rate")
    parser.add_argument("--schedule", choices=("cosine", "breathing", "phase"),
                        help="LR schedule (default cosine; docs/dynamics.md)")
    parser.add_argument("--schedule-preset", choices=("seed", "cpu"),
                        help="seed: the policy's long-run numbers (default); cpu: spans scaled to a CPU run")
    parser.add_argument("--clip-rule", choices=("fixed", "zscore", "percentile"),
                        help="gradient clipping: fixed optim.grad_clip (default), ZClip z-score, AutoClip percentile")
    parser.add_argument("--parallel", choices=("ddp", "fsdp2"),
                        help="ddp: every rank holds the whole model (default); fsdp2: fully_shard, each rank "
                             "holds and checkpoints a shard of every parameter (run.parallel)")
    parser.add_argument("--eval-every", type=int, metavar="N", help="validation loss every N steps")
    parser.add_argument("--peak-flops", type=float, metavar="FLOPS", help="peak FLOP/s per device for MFU")
    parser.add_argument("--run-id")
    parser.add_argument("--log-every", type=int, metavar="N")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--nproc", type=int_at_least(1), default=1, metavar="K",
                        help="local ranks, launched through torch's elastic launcher (gloo on CPU, nccl on GPU)")
    parser.add_argument("--max-restarts", type=int_at_least(0), default=None, metavar="R",
                        help="restarts of failed or killed workers by the elastic launcher (default with --nproc "
                             "over 1: the policy's alerts.max_restores_per_hour, room for the agent's restores; "
                             "else 0)")
    parser.add_argument("--start-over", action="store_true",
                        help="the run directory holds checkpoints signed with another key: set them aside "
                             "under checkpoints/invalid/ and train from scratch (without it, training refuses)")
    add_node_arguments(parser)


def _faults_outside_the_world(config: cfg.TrainConfig, nproc: int, nodes) -> str | None:
    """A fault aimed at a rank the job can never have would never fire: the run would pass as "recovered"
    from a fault that was not injected. The most ranks the job can have: nproc on each of its most nodes."""
    world = nproc * (nodes.max_nodes if nodes is not None else 1)
    for spec in config.run.inject:
        fault = parse_fault(spec)
        if fault.rank is not None and fault.rank >= world:
            return (f"--inject {spec!r}: rank {fault.rank} is outside the job's world of {world} rank(s) "
                    f"(--nproc {nproc}" + (f", --nnodes {nodes.min_nodes}:{nodes.max_nodes})" if nodes else ")"))
    return None


def add_node_arguments(parser: argparse.ArgumentParser) -> None:
    """Several nodes, as torchrun spells them: one `trainguard train` per node, meeting in a rendezvous."""
    parser.add_argument("--nnodes", metavar="N|MIN:MAX",
                        help="nodes of the job; MIN:MAX is elastic: the job re-forms on the nodes left")
    parser.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="the c10d rendezvous of a multi-node job")
    parser.add_argument("--rdzv-id", metavar="ID", help="the job's rendezvous id (the same on every node)")
    parser.add_argument("--rdzv-conf", action="append", default=[], metavar="KEY=VALUE",
                        help="rendezvous option, e.g. last_call_timeout=5 or is_host=false (repeatable)")
    parser.add_argument("--spare", action="store_true",
                        help="a hot spare: wait outside the rendezvous and join only in the place of a node of the "
                             "job that is cordoned (signed), so the world size stays (docs/recovery.md)")


def build_nodes(args: argparse.Namespace):
    """The multi-node flags as launch.Nodes; ConfigError naming the flag when they are wrong."""
    from trainguard.trainer.launch import Nodes, parse_nnodes

    if not getattr(args, "nnodes", None):
        if getattr(args, "rdzv_endpoint", None):
            raise cfg.ConfigError("--rdzv-endpoint needs --nnodes")
        if getattr(args, "spare", False):
            raise cfg.ConfigError("--spare needs --nnodes MIN:MAX and --rdzv-endpoint: a spare joins a multi-node job")
        return None
    try:
        low, high = parse_nnodes(args.nnodes)
    except ValueError as exc:
        raise cfg.ConfigError(str(exc)) from None
    if high > 1 and not args.rdzv_endpoint:
        raise cfg.ConfigError(f"--nnodes {args.nnodes}: several nodes need --rdzv-endpoint HOST:PORT")
    if getattr(args, "spare", False) and high < 2:
        raise cfg.ConfigError(f"--spare with --nnodes {args.nnodes}: a spare takes the place of another node, "
                              f"so the job has at least 2 nodes (MAX)")
    conf = {}
    for item in args.rdzv_conf:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise cfg.ConfigError(f"--rdzv-conf {item!r}: expected KEY=VALUE")
        conf[key] = value
    return Nodes(low, high, args.rdzv_endpoint or "", args.rdzv_id or "", conf)


def build_config(args: argparse.Namespace) -> cfg.TrainConfig:
    """Preset or --config, then --set, then flags; raises ConfigError naming the file (or flag) and key."""
    config = cfg.TrainConfig()
    if args.config:
        _regular_file(cfg.config_path(args.config), "config file")
    cfg.load_file(config, args.config or cfg.default_preset(_default_device(args.device)))
    for assignment in args.set:
        cfg.set_value(config, assignment)
    if args.checkpoint_every == AUTO:
        config.run.checkpoint_auto, args.checkpoint_every = True, None
    for flag, (section, key) in FLAG_KEYS.items():
        value = getattr(args, flag, None)
        if value is not None:
            cfg.apply_values(config, {section: {key: value}}, "", f"--{flag.replace('_', '-')}")
    if args.telemetry is not None:
        config.run.telemetry = args.telemetry == "on"
    if args.async_checkpoint:
        config.run.async_checkpoint = True
    config.run.inject = list(config.run.inject) + list(args.inject)
    for spec in config.run.inject:
        try:
            parse_fault(spec)
        except FaultError as exc:
            raise cfg.ConfigError(str(exc)) from None
    _absolute_paths(config)
    if config.data.path and not os.path.isdir(config.data.path) and not glob.glob(config.data.path):
        # looked at here, before any rank starts (each would fail alone, as a crash, after the launch)
        raise cfg.ConfigError(f"data.path: {config.data.path!r} matches no directory or .bin files")
    if config.run.key_file and Path(config.run.key_file).expanduser().exists():
        _regular_file(Path(config.run.key_file).expanduser(), "checkpoint key file")  # a missing one is created
    if config.run.policy:
        from trainguard import policy

        try:
            policy.load(config.run.policy)
        except policy.PolicyError as exc:
            raise cfg.ConfigError(str(exc)) from None
    if (conflict := _replica_check_conflict(config)) is not None:
        raise cfg.ConfigError(conflict)
    return cfg.validate(config, source=args.config or "config")


def _replica_check_conflict(config: cfg.TrainConfig) -> str | None:
    if config.run.parallel != "fsdp2":
        return None   # (no torch import for the common case: the CLI starts faster)
    from trainguard.trainer.parallel import replica_check_conflict

    return replica_check_conflict(config.run.parallel, config.run.policy)


def _regular_file(path: Path, what: str) -> None:
    """A FIFO would block the open and /dev/zero never end: look first (trainguard/paths.py)."""
    from trainguard import paths

    try:
        paths.regular_file(path, what)
    except FileNotFoundError as exc:
        raise cfg.ConfigError(str(exc)) from None


def _absolute_paths(config: cfg.TrainConfig) -> None:
    """Ranks may start elsewhere (another node's working directory): resolve relative paths once."""
    for section, key in (("run", "policy"), ("run", "key_file"), ("data", "path"), ("data", "cache_dir")):
        holder = getattr(config, section)
        value = getattr(holder, key)
        if value and not value.startswith(("/", "~")):
            setattr(holder, key, str(Path(value).absolute()))


def _check_checkpoint_key(config: cfg.TrainConfig, run_dir: Path, start_over: bool) -> str | None:
    """Before any rank starts: checkpoints signed with another key stop the run (a silent start from
    step 0 would let retention destroy them), unless --start-over sets them aside. The message, or None."""
    from trainguard.runtime.checkpoint import CheckpointError, CheckpointManager, archive
    from trainguard.runtime.checkpoint.manager import KeyMismatchError

    if not rundir.checkpoints_dir(run_dir).is_dir():
        return None   # nothing signed yet (and nothing is created here: the disk may be full)
    try:
        manager = CheckpointManager(run_dir, key_file=config.run.key_file or None, inspect_only=True)
        if start_over:
            for path in archive.set_aside_foreign(manager):
                print(f"trainguard train: --start-over: set aside {path}", file=sys.stderr)
        manager.check_key()
    except KeyMismatchError as exc:
        return str(exc)
    except CheckpointError as exc:   # a key with loose permissions, too short
        return str(exc)
    return None


def _default_device(requested: str | None) -> str:
    if requested in ("cpu", "cuda"):
        return requested
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def config_digest(config: cfg.TrainConfig) -> str:
    """The SHA-256 of the configuration as RUN/config.yaml holds it: what the workers must train with."""
    import hashlib

    return hashlib.sha256(config.dump().encode()).hexdigest()


def _current(path: Path) -> str | None:
    """RUN/config.yaml as it is, or None when it is not a readable config (rewritten then)."""
    try:
        return safe_read.read_text(path, safe_read.YAML_BYTES, "config file", errors="replace")
    except OSError:
        return None


def write_resolved(config: cfg.TrainConfig, run_dir: Path) -> Path:
    """``RUN/config.yaml``: the configuration every rank trains with (atomic; untouched when unchanged)."""
    path = rundir.config_path(run_dir)
    text = config.dump()
    if not path.exists() or _current(path) != text:
        tmp = path.with_name(f".config.yaml.{os.getpid()}.tmp")
        try:
            tmp.write_text(text)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)     # a full disk leaves no half-written file behind
            raise
    return path


def _check_key(config: cfg.TrainConfig) -> str | None:
    """The checkpoint key must be usable before any rank starts (a loose or short key: a message, not a
    traceback from every rank)."""
    from trainguard.runtime.checkpoint import keys
    from trainguard.runtime.checkpoint.manifest import CheckpointError

    try:
        keys.load_key(keys.resolve_key_path(config.run.key_file or None), create=True)
    except (CheckpointError, OSError) as exc:
        return str(exc)
    return None


def _prepare_run_dir(run_dir: Path) -> str | None:
    try:
        str(run_dir).encode("utf-8")
    except UnicodeEncodeError:
        # TLS records are UTF-8 and carry the run id (the directory's name) and checkpoint paths: a name
        # of bytes that are not UTF-8 would make every such record fail to write, so it is refused here.
        shown = os.fsencode(run_dir).decode("utf-8", "backslashreplace")
        return f"--run-dir {shown}: the path is not valid UTF-8 (TLS records name it); rename the directory"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"--run-dir {run_dir}: cannot create it: {exc.strerror or exc}"
    if not os.access(run_dir, os.W_OK):
        return f"--run-dir {run_dir}: not writable"
    return None


def default_max_restarts(config: cfg.TrainConfig, nproc: int) -> int:
    """Ranks under the launcher must survive the agent's restores: as many restarts as the ledger allows
    restores in an hour (``alerts.max_restores_per_hour``; past it the agent pages a human instead). One
    rank without the flag runs in this process, with no launcher to restart it."""
    if nproc <= 1:
        return 0
    from trainguard import policy

    return policy.load(config.run.policy or None).alerts.max_restores_per_hour


def run(args: argparse.Namespace) -> int:
    try:
        config = build_config(args)
        nodes = build_nodes(args)
    except cfg.ConfigError as exc:
        print(f"trainguard train: {exc}", file=sys.stderr)
        return 2
    if (outside := _faults_outside_the_world(config, args.nproc, nodes)) is not None:
        print(f"trainguard train: {outside}", file=sys.stderr)
        return 2
    run_dir = args.run_dir.resolve()
    problem = _check_key(config) or _prepare_run_dir(run_dir)
    if problem:
        print(f"trainguard train: {problem}", file=sys.stderr)
        return 2
    if not config.run.run_id:
        config.run.run_id = run_dir.name
    if (refusal := _check_checkpoint_key(config, run_dir, args.start_over)) is not None:
        print(f"trainguard train: {refusal}", file=sys.stderr)
        return 2
    try:
        resolved = write_resolved(config, run_dir)
    except OSError as exc:
        print(f"trainguard train: {rundir.config_path(run_dir)}: cannot write: {exc.strerror or exc} "
              f"({len(config.dump().encode())} bytes needed)", file=sys.stderr)
        return 2
    max_restarts = default_max_restarts(config, args.nproc) if args.max_restarts is None else args.max_restarts
    if nodes is not None and args.max_restarts is None:
        # a node of several restarts its ranks when the job re-forms (a peer node left), whatever --nproc
        max_restarts = max(max_restarts, default_max_restarts(config, 2))
    if args.nproc > 1 or max_restarts > 0 or nodes is not None:
        from trainguard.trainer.launch import launch

        return launch(run_dir, resolved, nproc=args.nproc, max_restarts=max_restarts, nodes=nodes,
                      key_file=config.run.key_file or None, config_sha256=config_digest(config),
                      spare=getattr(args, "spare", False))
    from trainguard.trainer.train import run_worker

    return run_worker(config, run_dir)
