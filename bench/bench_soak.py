"""The recovery soak (issue 31): a fault every few minutes for N minutes, effective training time of today's
path (`recovery.mode: restart`) against the in-process one, measured against a fault-free run in the same
wall time.

    .venv/bin/python bench/bench_soak.py --minutes 30 --fault-every 300 --out /tmp/soak.json
    .venv/bin/python bench/bench_soak.py --minutes 3 --fault-every 60        # a quick check of the bench

What runs: for each path, 2 simulated nodes x 2 ranks on loopback through `trainguard train` (two
`--nnodes 2 --nproc 2` launchers and a rendezvous store of their own, tests/culprit/cluster.py, as
bench/bench_recovery.py runs them), the tiny model on CPU, and beside them the same job with no fault and
`recovery.mode: restart` (no snapshots): the reference. All of them are launched together and stopped
together after `--warmup` + `--minutes`, so they share the machine's load over the same wall time (a machine that other
work slows slows the reference too); the paths are never compared across different moments.

The faults are `--inject KIND@tUNIXTIME:RANK` (trainer/faults.py's wall-clock form): the k-th fault fires at
the first step its rank begins `k x --fault-every` seconds after the window opens, the same instants in every path,
kinds taken in turn from `--faults` (default `error,crash`: an exception in a rank's step, a rank that
SIGKILLs itself) and ranks in turn from 3, 1, 2 (never rank 0, whose log the bench reads; both nodes). A
kind is any the two paths recover without an agent; the other engineers' standby processes (a SIGKILLed
rank) and in-process hangs take effect here through the policy (`--set recovery.KEY=VALUE`) once merged.

Measured from the runs' own TLS logs:

  effective training time   steps done in the window (rank 0's furthest step at its end less the one at
                            its start; steps trained again count once) / the reference's in the same
                            window. The window opens `--warmup` seconds after the launch (every run is
                            training by then) and the faults come `--fault-every` apart from its start. The
                            reference takes no snapshot, so the snapshots' cost is counted.
  fault -> next step        the fault's `fault_injected` event to rank 0's first step record after its
                            recovery (the `in_process_restart` event, or the restarted worker's `run_start`)
  work lost                 steps rank 0 had done at the fault that were trained again (its furthest step
                            then - the step restored), and those steps in seconds at the reference's rate
  healthy ranks ended       ranks other than the faulted one that started again (a `run_start`) between
                            this fault and the next

Goal (issue 31): at least 95% effective training time at one fault every 5 minutes.
The in-process path's `recovery.max_in_process_restarts` (3 by default, a bound against an exception that
repeats at the same step) is raised to the number of faults: exceptions no longer add up against it once
the run gets past the step that failed, but a standby's promotions are counted per worker process, so
that every planned kill is taken by a standby; the bench says so in its output.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainguard import actions, event_types, tls  # noqa: E402

PATHS = ("restart", "in_process")
REFERENCE = "fault-free"
# Kinds the two paths recover without an agent: an exception (in-process or torchrun restart) and a killed
# process (torchrun restart; a standby once it lands). A hang needs the agent's verdict: not run here yet.
SUPPORTED_FAULTS = ("error", "crash")
FAULT_RANKS = (3, 1, 2)
WORLD = 4
GOAL = 0.95
STEPS = 1_000_000        # never reached: a run is stopped at the end of its window


@dataclass(frozen=True)
class PlannedFault:
    kind: str
    at: float            # wall-clock time (seconds since the epoch)
    rank: int

    @property
    def spec(self) -> str:
        return f"{self.kind}@t{self.at!r}:{self.rank}"


def fault_plan(start: float, minutes: float, every: float, kinds: list[str]) -> list[PlannedFault]:
    """One fault every `every` seconds after `start`, strictly inside the window, kinds and ranks in turn;
    none for `every` 0 (the paths' steady cost)."""
    if every <= 0:
        return []
    count = int(minutes * 60 // every)
    if count * every >= minutes * 60:
        count -= 1                  # a fault at the window's very end would measure nothing
    return [PlannedFault(kinds[k % len(kinds)], round(start + (k + 1) * every, 3), FAULT_RANKS[k % len(FAULT_RANKS)])
            for k in range(count)]


def _event(record: dict) -> dict:
    return record.get("event") or {}


def _is_step(record: dict) -> bool:
    return not record.get("event") and "metrics" in record and "step" in record


def furthest_step(records: list[dict], until: float) -> int:
    """Rank 0's furthest step done by `until` (steps trained again after a restore count once)."""
    return max((r["step"] for r in records if _is_step(r) and r["timestamp"] <= until), default=0)


def last_step(records: list[dict], until: float) -> int:
    """Rank 0's step at `until`: its latest step record by then (not its furthest: a guard rollback
    before it is not this fault's loss)."""
    return next((r["step"] for r in reversed(records) if _is_step(r) and r["timestamp"] <= until), 0)


def rollbacks(records: list[dict], start: float, end: float) -> list[dict]:
    """The guard's rollbacks in the window (rank 0's): work thrown away that no fault caused."""
    return [{"step": r["event"].get("step"), "restored_step": r["event"].get("restored_step"),
             "steps_lost": r["event"].get("steps_lost", 0), "reason": r["event"].get("reason")}
            for r in records if _event(r).get("type") == actions.ROLLBACK and start <= r["timestamp"] <= end]


def per_fault(rank0: list[dict], by_rank: dict[int, list[dict]], fired: dict, until: float) -> dict:
    """The measures of one fault that fired at `fired["time"]` on `fired["rank"]`, up to `until` (the next
    fault or the window's end)."""
    at, failed = fired["time"], fired["rank"]
    done = last_step(rank0, at)
    recovered = restored = next_step = None
    parts: dict = {}
    for record in rank0:
        if record["timestamp"] <= at or record["timestamp"] > until:
            continue
        kind = _event(record).get("type")
        if recovered is None and kind == event_types.IN_PROCESS_RESTART:
            recovered, restored = record["timestamp"], _event(record)["restored_step"]
            parts = {k: _event(record)[k] for k in ("teardown_seconds", "reform_seconds", "restore_seconds",
                                                   "recovery_seconds", "source") if k in _event(record)}
        elif recovered is None and kind == event_types.RUN_START:
            recovered, restored = record["timestamp"], _event(record).get("resumed_from") or 0
            parts = {"source": "checkpoint"}
        elif recovered is not None and kind == event_types.SNAPSHOT_RESTORED:
            restored, parts["source"] = _event(record)["restored_step"], "snapshot"
        elif recovered is not None and _is_step(record):
            next_step = record["timestamp"]
            break
    ended = sorted(rank for rank, records in by_rank.items() if rank != failed and any(
        _event(r).get("type") == event_types.RUN_START and at < r["timestamp"] <= until for r in records))
    return {"kind": fired["kind"], "rank": failed, "step": fired["step"], "done_at_fault": done,
            "restored_step": restored, "work_lost_steps": None if restored is None else max(0, done - restored),
            "to_next_step_seconds": None if next_step is None else round(next_step - at, 3),
            "healthy_ranks_ended": ended, **parts}


def fired_faults(by_rank: dict[int, list[dict]]) -> list[dict]:
    """Every `fault_injected` event of the run, in time order."""
    found = [{"time": r["timestamp"], "rank": rank, "kind": _event(r)["kind"], "step": _event(r)["step"]}
             for rank, records in by_rank.items() for r in records
             if _event(r).get("type") == event_types.FAULT_INJECTED]
    return sorted(found, key=lambda f: f["time"])


def measure(by_rank: dict[int, list[dict]], start: float, end: float) -> dict:
    """One run's steps done in the window [start, end] (its furthest step at the end less the one at the
    start) and the measures of each fault that fired in it."""
    rank0 = by_rank.get(0, [])
    faults = [f for f in fired_faults(by_rank) if start <= f["time"] <= end]
    measured = [per_fault(rank0, by_rank, fault, faults[k + 1]["time"] if k + 1 < len(faults) else end)
                for k, fault in enumerate(faults)]
    return {"steps_done": furthest_step(rank0, end) - furthest_step(rank0, start), "faults": measured,
            "rollbacks": rollbacks(rank0, start, end), "window_seconds": round(end - start, 3)}


def summarise(path: str, run: dict, reference_steps: int, window_seconds: float) -> dict:
    """Effective training time and the per-fault means of one path, against the reference's steps."""
    rate = reference_steps / window_seconds if window_seconds > 0 else 0.0
    faults = run["faults"]
    lost = [f["work_lost_steps"] for f in faults if f["work_lost_steps"] is not None]
    to_next = [f["to_next_step_seconds"] for f in faults if f["to_next_step_seconds"] is not None]
    effective = run["steps_done"] / reference_steps if reference_steps else 0.0
    missing = reference_steps - run["steps_done"]
    return {
        "path": path, "steps_done": run["steps_done"], "reference_steps": reference_steps,
        "effective": round(effective, 4), "goal_met": effective >= GOAL, "faults": len(faults),
        "seconds_lost_per_fault": round(missing / rate / len(faults), 2) if faults and rate else None,
        "mean_to_next_step_seconds": round(sum(to_next) / len(to_next), 2) if to_next else None,
        "mean_work_lost_steps": round(sum(lost) / len(lost), 2) if lost else None,
        "mean_work_lost_seconds": round(sum(lost) / len(lost) / rate, 2) if lost and rate else None,
        "healthy_ranks_ended": sum(len(f["healthy_ranks_ended"]) for f in faults),
        "unrecovered": sum(f["to_next_step_seconds"] is None for f in faults),
        "rollback_steps": sum(r["steps_lost"] or 0 for r in run.get("rollbacks", [])),
    }


def _shown(value: object, absent: str = "-") -> str:
    return absent if value is None else str(value)


def render(result: dict) -> str:
    """The markdown for docs/benchmarks.md."""
    a = result["args"]
    lines = [f"`{result['command']}`: 2 simulated nodes x 2 ranks on loopback, the tiny model on CPU, "
             f"{a['minutes']:g} minutes after a {a['warmup']:g} s warm-up, "
             + (f"one fault every {a['fault_every']:g} s ({', '.join(a['faults'])} in turn, on ranks "
                f"{', '.join(map(str, FAULT_RANKS))} in turn)" if a["fault_every"] else "no fault (the steady cost)")
             + ", checkpoint "
             + (f"every {a['checkpoint_every']} steps" if a["checkpoint_every"] else
                f"every {a['checkpoint_every_seconds']:g} s") + "; the paths and the fault-free reference ran "
             f"together; load average {result['load_average'][0]:.1f} at the start, "
             f"{result['load_average'][1]:.1f} at the end. The fault-free reference did "
             f"{result['reference_steps']} steps ({result['reference_steps'] / result['window_seconds']:.2f} "
             f"steps/s).", ""]
    lines += ["| recovery.mode | steps done | effective training time | faults | time lost per fault (s) | "
              "fault -> next step (s, mean) | work lost per fault (steps / s) | healthy ranks ended | "
              "steps lost to guard rollbacks |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in result["paths"]:
        lost = ("-" if row["mean_work_lost_steps"] is None else
                f"{row['mean_work_lost_steps']:g} / {row['mean_work_lost_seconds']:g}")
        unrecovered = f" ({row['unrecovered']} not recovered in the window)" if row["unrecovered"] else ""
        lines.append(f"| {row['path']} | {row['steps_done']} | **{row['effective'] * 100:.1f}%**"
                     f"{'' if row['goal_met'] else ' (goal 95%: not met)'} | {row['faults']}{unrecovered} | "
                     f"{_shown(row['seconds_lost_per_fault'])} | {_shown(row['mean_to_next_step_seconds'])} | {lost} | "
                     f"{row['healthy_ranks_ended']} | {row.get('rollback_steps', 0)} |")
    lines += ["", "Each fault:", "", "| recovery.mode | kind | rank | at step | fault -> next step (s) | "
              "work lost (steps) | source | healthy ranks ended |", "|---|---|---:|---:|---:|---:|---|---|"]
    for path, run in result["runs"].items():
        if path == REFERENCE:
            continue
        for f in run["faults"]:
            lines.append(f"| {path} | {f['kind']} | {f['rank']} | {f['step']} | "
                         f"{_shown(f['to_next_step_seconds'], 'no step in the window')} | "
                         f"{_shown(f['work_lost_steps'])} | {f.get('source', '-')} | {f['healthy_ranks_ended'] or 'none'} |")
    notes = list(result.get("notes") or [])
    notes += [f"{path}: the guard rolled back from step {r['step']} to {r['restored_step']} ({r['steps_lost']} "
              f"steps, {r['reason']}): counted in its steps done, in no fault's work lost"
              for path, run in result["runs"].items() for r in run.get("rollbacks", [])]
    if notes:
        lines += [""] + [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------- running
def _policy(path: str, extra: list[str], variants: dict[str, list[str]]) -> dict:
    """The path's policy: restart or in_process on the defaults, with `--set` and a variant's values on top
    (the in-process paths only)."""
    in_process = path not in ("restart", REFERENCE)
    policy: dict = {"recovery": {"mode": "in_process" if in_process else "restart"}}
    for item in [*extra, *variants.get(path, [])] if in_process else ():
        dotted, _, value = item.partition("=")
        section, _, key = dotted.partition(".")
        policy.setdefault(section, {})[key] = json.loads(value) if value[:1] in "0123456789-[{tf\"" else value
    return policy


def _cluster(folder: Path, path: str):
    """The path's rendezvous store, started (its policy is written once the fault plan is known)."""
    from tests.culprit.cluster import Cluster

    place = folder / path
    run_dir = place / "run"
    (run_dir / "tls").mkdir(parents=True)
    cluster = Cluster(place, run_dir, place / "policy.yaml")
    cluster.start_store()
    cluster.wait_store()
    return cluster


def _train_args(path: str, plan: list[PlannedFault], args: argparse.Namespace) -> list[str]:
    every = (["--checkpoint-every", str(args.checkpoint_every)] if args.checkpoint_every else
             ["--checkpoint-every-seconds", f"{args.checkpoint_every_seconds:g}"])
    train = ["--steps", str(STEPS), *every, "--device", "cpu", "--max-restarts", str(4 * len(plan) + 3)]
    if path != REFERENCE:
        train += [arg for fault in plan for arg in ("--inject", fault.spec)]
    return train


def run_soak(args: argparse.Namespace) -> dict:
    import yaml

    paths = [REFERENCE, *args.paths, *args.variant]
    keep = args.workdir is not None
    if keep:
        args.workdir.mkdir(parents=True, exist_ok=False)
    with contextlib.nullcontext(str(args.workdir)) if keep else tempfile.TemporaryDirectory(prefix="bench-soak-") as folder:
        clusters = {}
        try:
            for path in paths:
                clusters[path] = _cluster(Path(folder), path)
            # The window opens after the warm-up (interpreters, torch, the rendezvous, the first steps), so it
            # measures training, and its first fault finds snapshots and a checkpoint to recover from.
            start = time.time() + args.warmup
            plan = fault_plan(start, args.minutes, args.fault_every, args.faults)
            load_start = os.getloadavg()[0]
            launchers = {}
            for path, cluster in clusters.items():
                cluster.policy_path.write_text(yaml.safe_dump(_policy(path, args.set, args.variant)))
                launchers[path] = [cluster.launch(node, *_train_args(path, plan, args), nnodes="2", nproc=2)
                                   for node in ("n1", "n2")]
            end = start + args.minutes * 60
            ended_early: dict[str, list] = {}
            while time.time() < end:       # the warm-up, then the window
                time.sleep(min(5.0, max(0.0, end - time.time())))
                for path, procs in launchers.items():
                    codes = [p.poll() for p in procs]
                    if path not in ended_early and any(code is not None for code in codes):
                        ended_early[path] = [codes, round(time.time() - start, 1)]
                        print(f"soak: {path} launchers ended early {codes} at {time.time() - start:.0f} s",
                              file=sys.stderr, flush=True)
            load_end = os.getloadavg()[0]
        finally:
            for cluster in clusters.values():
                cluster.stop()
                _clear_snapshots(cluster.run_dir, args.set)
        runs = {}
        for path, cluster in clusters.items():
            runs[path] = measure(_logs(cluster.run_dir), start, end)
            if path in ended_early:
                runs[path]["ended_early"] = ended_early[path]
                runs[path]["diagnostics"] = cluster.diagnostics()[-4000:]
    reference = runs[REFERENCE]["steps_done"]
    window = args.minutes * 60
    notes = [f"{path}: launchers ended before the window's end ({codes}, at {at} s)"
              for path, (codes, at) in ended_early.items()]
    if args.set:
        notes.append("in_process policy: " + ", ".join(args.set))
    notes += [f"{name}: in_process with {', '.join(values)}" for name, values in args.variant.items()]
    return {
        "command": "python bench/bench_soak.py " + " ".join(args.argv),
        "args": {"minutes": args.minutes, "warmup": args.warmup, "fault_every": args.fault_every, "faults": args.faults,
                 "checkpoint_every": args.checkpoint_every, "checkpoint_every_seconds": args.checkpoint_every_seconds,
                 "set": args.set, "variant": args.variant},
        "plan": [asdict(f) | {"spec": f.spec} for f in plan], "window_seconds": window,
        "start": start, "end": end, "workdir": str(args.workdir) if args.workdir else None,
        "load_average": [load_start, load_end], "reference_steps": reference,
        "paths": [summarise(path, runs[path], reference, window) for path in [*args.paths, *args.variant]],
        "runs": runs, "notes": notes,
    }


def _clear_snapshots(run_dir: Path, policy: list[str]) -> None:
    """The in-memory snapshots a stopped run leaves on the tmpfs (a run that does not complete keeps them
    for its restart): this run's only, found by the run directory its manifests name. Other runs add and
    delete their own meanwhile: a folder gone while it is listed is skipped."""
    root = next((Path(v.partition("=")[2]) for v in policy if v.startswith("recovery.snapshot_dir=")), Path("/dev/shm"))
    for tag in _entries(root / f"trainguard-{os.getuid()}"):
        manifests = [m for rank in _entries(tag) for m in _entries(rank) if m.suffix == ".json"]
        for manifest in manifests[:1]:
            with contextlib.suppress(OSError, ValueError):
                if json.loads(manifest.read_text()).get("run") == str(run_dir):
                    shutil.rmtree(tag, ignore_errors=True)


def _entries(folder: Path) -> list[Path]:
    try:
        return sorted(folder.iterdir())
    except OSError:
        return []


def _logs(run_dir: Path) -> dict[int, list[dict]]:
    return {rank: tls.read_records(run_dir / "tls" / f"rank-{rank}.jsonl") for rank in range(WORLD)
            if (run_dir / "tls" / f"rank-{rank}.jsonl").exists()}


def remeasure(saved: dict, workdir: Path) -> dict:
    """A result measured again from the logs its run kept (`--workdir`), as this version of the bench
    measures: the same window, plan and paths."""
    a = saved["args"]
    start = saved.get("start") or saved["plan"][0]["at"] - a["fault_every"]
    end = saved.get("end") or start + a["minutes"] * 60
    runs = {path: {**old, **measure(_logs(workdir / path / "run"), start, end)} for path, old in saved["runs"].items()}
    reference = runs[REFERENCE]["steps_done"]
    return {**saved, "start": start, "end": end, "workdir": str(workdir), "runs": runs, "reference_steps": reference,
            "paths": [summarise(row["path"], runs[row["path"]], reference, saved["window_seconds"])
                      for row in saved["paths"]]}


def _variant(text: str) -> tuple[str, list[str]]:
    name, _, values = text.partition(":")
    items = [item for item in values.split(",") if item]
    if not name.isidentifier() or not items or any("." not in item.partition("=")[0] or "=" not in item
                                                    for item in items):
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME:SECTION.KEY=VALUE[,SECTION.KEY=VALUE]")
    return name, items


def _faults(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in SUPPORTED_FAULTS]
    if not kinds or unknown:
        raise argparse.ArgumentTypeError(f"--faults: {', '.join(unknown) or 'none given'}: each must be one of "
                                         f"{', '.join(SUPPORTED_FAULTS)} (a hang needs the agent's verdict)")
    return kinds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="the window each path runs (default 30)")
    parser.add_argument("--warmup", type=float, default=180.0, help="seconds from the launch to the window's "
                        "start (default 180: every run is training by then, and has saved a checkpoint by the "
                        "first fault)")
    parser.add_argument("--fault-every", type=float, default=300.0, help="seconds between faults (default 300; 0: no fault, "
                        "the paths' steady cost)")
    parser.add_argument("--faults", type=_faults, default=["error", "crash"],
                        help=f"the fault mix, taken in turn (default error,crash; of {', '.join(SUPPORTED_FAULTS)})")
    parser.add_argument("--paths", type=lambda s: s.split(","), default=list(PATHS),
                        help="recovery modes to soak (default restart,in_process)")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="durable checkpoint every N steps "
                        "(default 0: by time, --checkpoint-every-seconds)")
    parser.add_argument("--checkpoint-every-seconds", type=float, default=300.0,
                        help="durable checkpoint every S seconds (the trainer's default, 300)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a policy value for the in-process path (e.g. recovery.snapshot_every=10)")
    parser.add_argument("--variant", type=_variant, action="append", default=[],
                        metavar="NAME:SECTION.KEY=VALUE[,SECTION.KEY=VALUE]", help="one more in-process path beside "
                        "the others, with these policy values (e.g. snap25:recovery.snapshot_every=25): settings "
                        "compared in one run, under the same load")
    parser.add_argument("--workdir", type=Path, help="a new directory to run in and keep (the runs' logs, "
                        "checkpoints); default: a temporary one, removed at the end")
    parser.add_argument("--remeasure", type=Path, metavar="RESULT.json", help="no run: measure a kept run "
                        "(its --workdir, or --workdir) again, and print it as the run would have")
    parser.add_argument("--out", type=Path, help="write the JSON result here (and the markdown beside it, .md)")
    args = parser.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    args.variant = dict(args.variant)
    if clash := [name for name in args.variant if name in (*PATHS, REFERENCE)]:
        parser.error(f"--variant: {', '.join(clash)}: a variant needs a name of its own")
    if args.remeasure:
        saved = json.loads(args.remeasure.read_text())
        result = remeasure(saved, args.workdir or Path(saved.get("workdir") or saved["command"].split("--workdir ")[1].split()[0]))
        print(render(result))
        if args.out:
            args.out.write_text(json.dumps(result, indent=1) + "\n")
            args.out.with_suffix(".md").write_text(render(result))
        return 0
    if unknown := [p for p in args.paths if p not in PATHS]:
        parser.error(f"--paths: {', '.join(unknown)}: each must be one of {', '.join(PATHS)}")
    if args.fault_every and args.minutes * 60 <= args.fault_every:
        parser.error("--minutes must be longer than --fault-every: no fault would fire in the window")
    result = run_soak(args)
    markdown = render(result)
    print(markdown)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
