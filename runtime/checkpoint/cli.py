"""`trainguard checkpoint list|verify|restore|export RUN_DIR`: inspect and check a run's checkpoints.

`verify`, `restore` and the trainer share one verification (signature, every hash, a weights_only load
of the content). `export` writes a verified checkpoint into another run directory, compressed
(`--compress fp16-zlib`: lossy, its largest error recorded; an export is never resumed from).

Exit codes, for scripts:
  0  list: listed; verify: every checkpoint checked verifies; restore: a checkpoint was chosen;
     export: written and verified
  1  verify: at least one fails; restore/export: the requested one fails, or none verifies
  2  usage error, no checkpoints (or no step_<N> for --step), no key to verify with
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from trainguard import event_types, paths, rundir
from trainguard.progress import Progress
from trainguard.tls import parse_timestamp
from trainguard.runtime.checkpoint import Checkpoint, CheckpointError, CheckpointInfo, CheckpointManager
from trainguard.runtime.checkpoint import archive
from trainguard.runtime.checkpoint.restore import GONE

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = "exit codes: 0 ok, 1 verification failed / nothing to restore, 2 usage or nothing to check"
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = actions.add_parser("list", help="table of checkpoints: step, stable, size, age, status")
    listing.add_argument("--fast", action="store_true", help="check signatures and sizes only, not hashes")
    check = actions.add_parser("verify", help="verify signatures and every hash; exit 1 if any fails")
    check.add_argument("--step", type=int, help="only this step")
    restore = actions.add_parser(
        "restore", help="choose the checkpoint a resumed run will use (newest verified, or --step)")
    restore.add_argument("--step", type=int, help="this step instead of the newest verified one")
    restore.add_argument("--stable-only", action="store_true", help="only checkpoints marked stable")
    restore.add_argument("--to", metavar="DIR", type=Path,
                         help="copy it into the run directory DIR (DIR/checkpoints/step_N) instead of "
                              "setting newer checkpoints aside in RUN_DIR")
    export = actions.add_parser(
        "export", help="write a verified checkpoint, compressed, into DIR/checkpoints (never resumed from)")
    export.add_argument("--step", type=int, help="this step instead of the newest verified one")
    export.add_argument("--to", metavar="DIR", type=Path, required=True, help="run directory to write into")
    export.add_argument("--compress", choices=("fp16-zlib", "lossless", "none"), default="fp16-zlib",
                        help="fp16-zlib (lossy: float16 + zlib, largest error recorded; default), lossless, none")
    for sub in (listing, check, restore, export):
        sub.add_argument("run_dir", metavar="RUN_DIR", type=Path)
        sub.add_argument("--key-file", type=Path, help="HMAC key (default: $TRAINGUARD_CHECKPOINT_KEY, "
                                                       "else ~/.config/trainguard/checkpoint.key)")
        sub.add_argument("--json", action="store_true", help="machine-readable output")


class _Exit(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def run(args: argparse.Namespace) -> int:
    skipped: list[dict] = []

    def collect(kind: str, **fields: object) -> None:
        if kind == event_types.CHECKPOINT_INVALID:
            skipped.append({"path": fields["path"], "code": fields["code"], "reason": fields["reason"]})

    command = {"list": _list, "verify": _verify, "restore": _restore, "export": _export}[args.action]
    try:
        manager = _open(args, collect)
        return command(manager, args, skipped)
    except _Exit as exc:
        print(f"trainguard checkpoint: {exc}", file=sys.stderr)
        return exc.code
    except CheckpointError as exc:
        print(f"trainguard checkpoint: {exc}", file=sys.stderr)
        return EXIT_FAILED


def _open(args: argparse.Namespace, collect) -> CheckpointManager:
    try:
        paths.run_dir(args.run_dir)
    except FileNotFoundError as exc:  # a typo, a device or a FIFO, named as such
        raise _Exit(EXIT_USAGE, str(exc)) from None
    to = getattr(args, "to", None)
    if to is not None and (to.exists() or to.is_symlink()) and not to.is_dir():
        # a file there would fail half-way into the copy (a traceback, and a crash's exit status)
        raise _Exit(EXIT_USAGE, f"--to {to}: {paths.what_is(to)}, not a run directory")
    try:
        manager = CheckpointManager(args.run_dir, key_file=args.key_file, on_event=collect,
                                    log=_quiet_log(), inspect_only=True)
    except CheckpointError as exc:  # no key, or one with loose permissions
        raise _Exit(EXIT_USAGE, str(exc)) from None
    if not manager.steps():
        raise _Exit(EXIT_USAGE, f"{manager.root}: no checkpoints")
    return manager


def _quiet_log():
    import logging

    import structlog

    # The commands print their own findings; the manager's log would only repeat them.
    return structlog.make_filtering_bound_logger(logging.CRITICAL)(structlog.PrintLogger(sys.stderr), [], {})


def _row(info: CheckpointInfo) -> dict:
    return {"step": info.step, "path": str(info.path), "stable": info.stable, "bytes": info.bytes,
            "created_at": info.created_at, "ok": info.ok, "code": info.code, "reason": info.reason}


def _list(manager: CheckpointManager, args: argparse.Namespace, skipped: list) -> int:
    rows = manager.list(deep=not args.fast)
    if args.json:
        print(json.dumps({"run_dir": str(args.run_dir), "key_file": str(manager.key_path), "key_id": manager.key_id,
                          "checkpoints": [_row(r) for r in rows]}, indent=2))
        return EXIT_OK
    print(f"key in use: {manager.key_path} (id {manager.key_id})")
    print(f"{'STEP':>10}  {'STABLE':6}  {'SIZE':>9}  {'AGE':>8}  STATUS")
    for info in rows:
        stable = {True: "yes", False: "no", None: "?"}[info.stable]
        print(f"{info.step:>10}  {stable:6}  {_size(info.bytes):>9}  {_age(info):>8}  {info.reason}")
    return EXIT_OK


def _verify(manager: CheckpointManager, args: argparse.Namespace, skipped: list) -> int:
    if args.step is not None and args.step not in manager.steps():
        raise _Exit(EXIT_USAGE, f"{manager.root}: no {rundir.step_dir_name(args.step)}")
    with Progress("checkpoint verify", unit="checkpoints") as shown:
        rows = [r for r in manager.list(deep=True, progress=shown) if args.step is None or r.step == args.step]
    ok = all(r.ok or r.code == GONE for r in rows)      # one retention removed meanwhile failed nothing
    if args.json:
        print(json.dumps({"ok": ok, "checkpoints": [_row(r) for r in rows]}, indent=2))
    else:
        for info in rows:
            status = "ok" if info.ok else f"gone: {info.reason}" if info.code == GONE else f"FAILED: {info.reason}"
            print(f"{info.path.name}: {status}")
    return EXIT_OK if ok else EXIT_FAILED


def _restore(manager: CheckpointManager, args: argparse.Namespace, skipped: list) -> int:
    if args.step is None:
        chosen = manager.latest_verified(stable_only=args.stable_only)
    else:
        chosen = _requested(manager, args.step, args.stable_only)
    report: dict = {"step": None, "path": None, "skipped": skipped, "superseded": [], "exported_to": None}
    if chosen is not None:
        if args.to:
            target = CheckpointManager(args.to, key_file=args.key_file, log=_quiet_log())
            chosen = archive.import_checkpoint(target, chosen)
            report["exported_to"] = str(chosen.path)
        else:
            report["superseded"] = [str(p) for p in manager.supersede_after(chosen.step, pinned=True)]
        report.update(step=chosen.step, path=str(chosen.path))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_restore(report, args.to or args.run_dir)
    return EXIT_OK if chosen is not None else EXIT_FAILED


def _export(manager: CheckpointManager, args: argparse.Namespace, skipped: list) -> int:
    chosen = manager.latest_verified() if args.step is None else _requested(manager, args.step, False)
    if chosen is None:
        raise _Exit(EXIT_FAILED, f"{manager.root}: no checkpoint verifies; nothing to export")
    exported = archive.export_checkpoint(manager, chosen, args.to, compress=args.compress)
    layout = exported.manifest["layout"]
    report = {"step": exported.step, "path": str(exported.path), "compress": args.compress,
              "bytes": sum(e["bytes"] for e in exported.manifest["files"].values()),
              "max_abs_error": layout.get("max_abs_error", 0.0), "max_rel_error": layout.get("max_rel_error", 0.0)}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"exported {rundir.step_dir_name(report['step'])} to {report['path']} ({args.compress}, {_size(report['bytes'])}, "
              f"max abs error {report['max_abs_error']:.3g}, max rel error {report['max_rel_error']:.3g}); "
              "an export is never resumed from")
    return EXIT_OK


def _requested(manager: CheckpointManager, step: int, stable_only: bool) -> Checkpoint:
    if step not in manager.steps():
        raise _Exit(EXIT_USAGE, f"{manager.root}: no {rundir.step_dir_name(step)}")
    result = manager.verify_step(step, deep=True)
    if not result.ok:
        raise _Exit(EXIT_FAILED, f"{result.path}: {result.reason}")
    if stable_only and not result.manifest["stable"]:
        raise _Exit(EXIT_FAILED, f"{result.path}: not marked stable")
    return Checkpoint.of(result)


def _print_restore(report: dict, run_dir: Path) -> None:
    for item in report["skipped"]:
        print(f"skipped {Path(item['path']).name}: {item['reason']}")
    for path in report["superseded"]:
        print(f"set aside {path}")
    if report["step"] is None:
        print("no checkpoint verifies; a resumed run would start from scratch")
        return
    if report["exported_to"]:
        print(f"copied {rundir.step_dir_name(report['step'])} to {report['exported_to']} (verified)")
    print(f"a run resumed on {run_dir} starts from {rundir.step_dir_name(report['step'])}")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n}"


def _age(info: CheckpointInfo) -> str:
    try:
        created = parse_timestamp(info.created_at) if info.created_at else info.path.stat().st_mtime
    except (ValueError, OSError):
        return "?"
    seconds = max(0, int(time.time() - created))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"

