"""training: the trainer's step telemetry (RUN/tls/rank-*.jsonl) as metrics, followed incrementally.

Each update reads only what the ranks appended since the last one (agent/tail.py), folds it into
`TrainingState`, and saves offsets and state together, atomically, in RUN/agent/offsets-<node>.json (at
most every `save_every_seconds`, and at shutdown): an agent killed at any moment and restarted resumes from
the last save, re-reading what it read since with the counters of that moment, so no step is lost or
counted twice.
A malformed line is counted (`trainguard_tls_malformed_lines_total{file}`) and logged with file:line.

Labels are `run_id` and `rank` (bounded by the world size); never step or pid. The cost meter of the
run (trainguard.decide.cost) is fed the lead rank's steps; its tier decisions go to the agent's
decision handlers (the executor), its state to `trainguard_cost_*`.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from trainguard import rundir
from trainguard import actions
from trainguard import log as tglog
from trainguard import policy as tgpolicy
from trainguard import tls
from trainguard.agent.collector import Collector, CollectorDisabled, Context, Sample, register
from trainguard.agent.collectors.options import options
from trainguard.agent.families import LabelCache, Spec
from trainguard.agent.node_files import NodeFiles
from trainguard.agent.tail import Follower, load_json, save_json_atomic
from trainguard.agent.training_state import STEP_GAUGES, TrainingState
from trainguard.decide.cost import CostMeter, clock_of
from trainguard.decide.straggler import StragglerBoard


RANK_FILE = re.compile(r"^rank-(\d+)\.jsonl$")
STATE_VERSION = 1
MAX_ERRORS_LOGGED = 20          # per update; the counter has them all
CHECKPOINT_RESCAN_SECONDS = 30.0   # RUN/checkpoints listed at least this often even when its mtime holds
TIER_VALUES = {"ok": 0, "warn": 1, "throttle": 2, "stop": 3}


# Guard and recovery events exported at 0 until they happen (see _families).
WATCHED_EVENTS = (actions.SKIP_STEP, actions.ROLLBACK, actions.RESTORE, "action", "checkpoint_saved", "fault_injected",
                  actions.STOP)
WATCHED_EVENTS += ("replica_mismatch",)   # silent corruption (trainer/replica_check.py): the ReplicaMismatch alert

@register
class TrainingCollector(Collector):
    name = "training"
    interval = 2.0
    timeout = 10.0
    # Per-rank straggler scores (trainguard/decide/straggler.py); a class default so a collector made
    # without __init__ (replay's series) exports none rather than failing.
    stragglers: StragglerBoard | None = None

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        if ctx.run_dir is None:
            raise CollectorDisabled("no run directory given (--run-dir), nothing to follow")
        self.run_dir = Path(ctx.run_dir)
        self.log = tglog.get("agent.training", node=ctx.node)
        self.node_files = NodeFiles(self.run_dir, ctx.node)   # a shared run directory: this node's ranks only
        self.follower = Follower(rundir.tls_dir(self.run_dir), "rank-*.jsonl", select=self.node_files)
        self.offsets_path = self.run_dir / "agent" / f"offsets-{ctx.node}.json"
        self.state = TrainingState()
        opts = options(ctx.options, self.name, policy=None, save_every_seconds=5.0,
                       checkpoint_rescan_seconds=CHECKPOINT_RESCAN_SECONDS, per_rank=True)
        self.save_every = opts["save_every_seconds"]
        self.per_rank = opts["per_rank"]    # False: the node's lead rank only (docs/scale.md, the series budget)
        self.checkpoints = CheckpointLister(rundir.checkpoints_dir(self.run_dir), opts["checkpoint_rescan_seconds"])
        self._unsaved = False
        self._saved_at: float | None = None   # monotonic time of the last save; None: never
        self.meter = self._cost_meter(opts["policy"] or ctx.policy)
        self.on_decision = None          # set by the agent: callable(Decision)
        self._cost_rank: int | None = None   # the rank whose steps feed the cost meter
        self.stragglers = StragglerBoard()   # rebuilt from the next steps after an agent restart
        self.restored = self._restore()

    # ---------------------------------------------------------------------------------- persistence

    def _cost_meter(self, policy_path) -> CostMeter:
        path = policy_path or (self.run_dir / "policy.yaml" if (self.run_dir / "policy.yaml").exists() else None)
        return CostMeter(tgpolicy.load(path).cost)

    def _restore(self) -> bool:
        try:
            saved = load_json(self.offsets_path)
        except ValueError as exc:  # a damaged file: start over rather than refuse to run
            self.log.error("offsets file unreadable; following from the start", error=str(exc))
            return False
        if not saved or saved.get("version") != STATE_VERSION:
            return False
        self.follower.restore(saved.get("files") or {})
        self.state = TrainingState.from_dict(saved.get("state") or {})
        if saved.get("cost"):
            self.meter.load_state_dict(saved["cost"])
        self._cost_rank = saved.get("cost_rank")
        self.log.info("resumed from saved offsets", path=str(self.offsets_path),
                      files=len(self.follower.positions))
        return True

    def _save(self) -> None:
        payload = {"version": STATE_VERSION, "saved_at": time.time(), "files": self.follower.state(),
                   "state": self.state.to_dict(), "cost_rank": self._cost_rank,
                   "cost": self.meter.state_dict()}
        save_json_atomic(self.offsets_path, payload)
        self._unsaved, self._saved_at = False, time.monotonic()

    def close(self) -> None:
        if self._unsaved:
            self._save()

    # --------------------------------------------------------------------------------------- update

    def update(self) -> Sample:
        deadline = time.monotonic() + self.timeout / 2
        consumed = errors_logged = 0
        while True:   # catch up in bounded reads, within half the timeout
            chunks = list(self.follower.poll())
            for chunk in chunks:
                consumed += 1
                errors_logged += self._ingest(chunk, errors_logged < MAX_ERRORS_LOGGED)
            if not self.follower.more or time.monotonic() > deadline:
                break
        for message in self.follower.events:
            self.log.info(f"tls file {message}")
        self.follower.events.clear()
        self._unsaved = self._unsaved or consumed > 0
        if self._unsaved and (self._saved_at is None or time.monotonic() - self._saved_at >= self.save_every):
            self._save()
        self._refresh_checkpoint()
        now = time.time()
        return Sample(self._families(now), tls=self.state.tls_fragment(now))

    def _ingest(self, chunk, log_error: bool) -> int:
        """Fold one line in; returns 1 when it was malformed."""
        name = os.path.basename(chunk.source)
        try:
            if chunk.overlong:
                raise tls.TLSError(f"line longer than {self.follower.max_line_bytes} bytes", chunk.source,
                                   chunk.lineno)
            record = tls.decode(chunk.data, chunk.source, chunk.lineno)
        except tls.TLSError as exc:
            self.state.count(self.state.malformed, name)
            if log_error:
                self.log.warning("malformed TLS line", error=str(exc))
            return 1
        if not self.node_files.is_ours(record.get("node")):
            return 0   # written there before the rank moved to this node (an elastic restart elsewhere)
        self.state.count(self.state.records, name)
        rank = record.get("rank")
        if not isinstance(rank, int):
            match = RANK_FILE.match(_base_name(name))
            rank = int(match.group(1)) if match else -1
        if self.state.apply(record, rank):
            self._meter_step(record, rank)
            self._score_step(record, rank)
        return 0

    def _score_step(self, record: dict, rank: int) -> None:
        metrics = record.get("metrics")
        if self.stragglers is not None and isinstance(metrics, dict) and rank >= 0:
            self.stragglers.observe(rank, str(record.get("node") or self.ctx.node), record["step"], metrics)

    def _meter_step(self, record: dict, rank: int) -> None:
        if self._cost_rank is None or rank < self._cost_rank:
            self._cost_rank = rank
        if rank != self._cost_rank:
            return   # the run's cost is metered once, from one rank's steps
        gpus = self.state.ranks[rank].gpu_count
        if gpus is None:
            gpus = len(self.follower.positions)
        for decision in self.meter.observe(step=record["step"], timestamp=record["timestamp"], gpu_count=gpus,
                                           clock=clock_of(record)):
            self.log.warning("cost decision", action=decision.action, reason=decision.reason, step=decision.step)
            if self.on_decision is not None:
                self.on_decision(decision)

    # ------------------------------------------------------------------------------------- families

    def _families(self, now: float) -> list:
        samples: dict[str, list] = {key: [] for key in STEP_SPECS}
        step, last, steps, events = [], [], [], []
        ranks = sorted(self.state.ranks.items())
        for rank, rs in (ranks if self.per_rank else ranks[:1]):
            labels = _RUN_RANK.get(rs.run_id, str(rank))
            for key, value in rs.metrics.items():
                samples[key].append((labels, value))
            if rs.step is not None:
                step.append((labels, rs.step))
                last.append((labels, rs.last_step_time))
            steps.append((labels, rs.steps_total))
            # The event types alerts and annotations look for exist from the start at 0: Prometheus sees
            # no increase in a series' first sample, so a first rollback would otherwise go unseen.
            events += [(_RUN_RANK_TYPE.get(rs.run_id, str(rank), kind), count)
                       for kind, count in sorted({**_WATCHED_AT_ZERO, **rs.events}.items())]
        families = [spec.family(samples[key]) for key, spec in STEP_SPECS.items()]
        families += [STEP.family(step), LAST_STEP.family(last), STEPS.family(steps), EVENTS.family(events)]
        return (families + self._file_families() + self._checkpoint(now) + self._cost_families()
                + self._straggler_families())

    def _straggler_families(self) -> list:
        if self.stragglers is None:
            return []
        scores = self.stragglers.scores()
        run_id = self.state.run_id
        return [STRAGGLER_SCORE.family((_RUN_RANK_NODE.get(run_id, str(s.rank), s.node), s.relative) for s in scores),
                STRAGGLER_INDIVIDUAL.family((_RUN_RANK_NODE.get(run_id, str(s.rank), s.node), s.individual)
                                            for s in scores)]

    def _file_families(self) -> list:
        names = sorted(set(self.state.records) | set(self.state.malformed))
        return [RECORDS.family((_FILE.get(name), self.state.records.get(name, 0)) for name in names),
                MALFORMED.family((_FILE.get(name), self.state.malformed.get(name, 0)) for name in names)]

    def _refresh_checkpoint(self) -> None:
        """A checkpoint on disk newer than the last checkpoint_saved event (or saved without one) counts too."""
        state = self.state
        on_disk = self.checkpoints.newest()
        if on_disk is not None and (state.checkpoint_time is None or on_disk[0] > state.checkpoint_time):
            state.checkpoint_time, state.checkpoint_step = on_disk
            state.checkpoint_name = f"step_{on_disk[1]}"

    def _checkpoint(self, now: float) -> list:
        state = self.state
        if state.checkpoint_time is None:
            return []
        run = _RUN.get(state.run_id)
        families = [CHECKPOINT_AGE.family([(run, max(0.0, now - state.checkpoint_time))]),
                    CHECKPOINT_TIME.family([(run, state.checkpoint_time)])]
        if state.checkpoint_step is not None:
            families.append(CHECKPOINT_STEP.family([(run, state.checkpoint_step)]))
        return families

    def _cost_families(self) -> list:
        if self._cost_rank is None:
            return []
        cost, run = self.meter.state, _RUN.get(self.state.run_id)
        values = (cost.cost_usd, cost.cost_per_1k_steps, cost.overrun_ratio, TIER_VALUES.get(cost.tier, 0),
                  self.meter.policy.budget_per_1k_steps, self.meter.gpus(None))
        return [spec.family([(run, value)]) for spec, value in zip(COST_SPECS, values)]


# Families, their names checked once; label sets made once per run and rank (module-level: replay builds
# these families from a collector it never initialises, trainguard/replay/series.py).
_RUN_RANK = LabelCache(["run_id", "rank"])
_RUN_RANK_TYPE = LabelCache(["run_id", "rank", "type"])
_RUN = LabelCache(["run_id"])
_FILE = LabelCache(["file"])
_RUN_RANK_NODE = LabelCache(["run_id", "rank", "node"])
_WATCHED_AT_ZERO = dict.fromkeys(WATCHED_EVENTS, 0)
STEP_SPECS = {key: Spec("gauge", name, text, ["run_id", "rank"]) for key, (name, text) in STEP_GAUGES.items()}
STEP = Spec("gauge", "trainguard_training_step", "Latest step the rank finished.", ["run_id", "rank"])
LAST_STEP = Spec("gauge", "trainguard_training_last_step_timestamp_seconds",
                 "Unix time of the rank's latest step record.", ["run_id", "rank"])
STEPS = Spec("counter", "trainguard_training_steps", "Step records read from the rank's TLS log.", ["run_id", "rank"])
EVENTS = Spec("counter", "trainguard_training_events", "Events in the rank's TLS log, by type (guard decisions, "
              "checkpoints, actions ...).", ["run_id", "rank", "type"])
RECORDS = Spec("counter", "trainguard_tls_records", "TLS records read, by file.", ["file"])
MALFORMED = Spec("counter", "trainguard_tls_malformed_lines",
                 "TLS lines that could not be read (logged with file:line), by file.", ["file"])
CHECKPOINT_AGE = Spec("gauge", "trainguard_checkpoint_age_seconds", "Seconds since the latest checkpoint was saved.",
                      ["run_id"])
CHECKPOINT_TIME = Spec("gauge", "trainguard_checkpoint_last_timestamp_seconds",
                       "Unix time the latest checkpoint was saved.", ["run_id"])
CHECKPOINT_STEP = Spec("gauge", "trainguard_checkpoint_last_step", "Step of the latest checkpoint.", ["run_id"])
STRAGGLER_SCORE = Spec("gauge", "trainguard_rank_straggler_score",
                       "NVRx relative score of the rank's recent compute time: the fastest rank's median over this "
                       "rank's (1 = fastest, 0.5 = twice as slow).", ["run_id", "rank", "node"])
STRAGGLER_INDIVIDUAL = Spec("gauge", "trainguard_rank_straggler_individual_score",
                            "NVRx individual score: the rank's best median compute time in its history over its "
                            "recent one (0.5 = twice as slow as it was).", ["run_id", "rank", "node"])
COST_SPECS = [Spec("gauge", name, text, ["run_id"]) for name, text in (
    ("trainguard_cost_usd", "Cost of the run metered so far (GPU-hours x price)."),
    ("trainguard_cost_per_1k_steps_usd", "Cost per 1000 steps over the recent window."),
    ("trainguard_cost_overrun_ratio", "Cost per 1000 steps over budget, minus 1 (0.3 = 30% over)."),
    ("trainguard_cost_tier", "Budget tier reached: 0 ok, 1 warn, 2 throttle, 3 stop."),
    ("trainguard_cost_budget_per_1k_steps_usd", "Budget per 1000 steps from the policy."),
    ("trainguard_cost_billable_gpus", "GPUs the run is billed for (policy override, else the records)."))]


def _base_name(name: str) -> str:
    """rank-3.jsonl.1 (a rotated file being drained) -> rank-3.jsonl."""
    return name.split(".jsonl", 1)[0] + ".jsonl" if ".jsonl" in name else name


class CheckpointLister:
    """The newest checkpoint on disk, listed again only when RUN/checkpoints changed (its mtime) or every
    `rescan_seconds`. The collector asks at every update, a run keeps hundreds of checkpoints, and on a
    network filesystem every stat is a metadata round trip. A save renames its finished step_<N> into
    place (trainer/checkpoint/store.py), which changes the folder's mtime; the rescan covers filesystems
    with coarse mtimes and tools that write a manifest in place."""

    def __init__(self, folder: Path, rescan_seconds: float = CHECKPOINT_RESCAN_SECONDS, clock=time.monotonic):
        self.folder, self.rescan_seconds, self.clock = folder, rescan_seconds, clock
        self._seen: tuple | None = None          # (device, inode, mtime) of the folder when last listed
        self._listed_at: float | None = None
        self._newest: tuple[float, int] | None = None

    def newest(self) -> tuple[float, int] | None:
        try:
            info = os.stat(self.folder)
        except OSError:
            self._seen = None
            return None
        seen, now = (info.st_dev, info.st_ino, info.st_mtime_ns), self.clock()
        if seen != self._seen or self._listed_at is None or now - self._listed_at >= self.rescan_seconds:
            self._newest = _newest_checkpoint(self.folder)
            self._seen, self._listed_at = seen, now
        return self._newest


def _newest_checkpoint(folder: Path) -> tuple[float, int] | None:
    """(mtime of its manifest, step) of the newest step_<N>/manifest.json in RUN/checkpoints."""
    best = None
    try:
        entries = list(folder.iterdir())
    except OSError:
        return None
    for entry in entries:
        match = re.fullmatch(r"step_(\d+)", entry.name)
        if not match:
            continue
        try:
            mtime = (entry / "manifest.json").stat().st_mtime
        except OSError:
            continue
        if best is None or int(match.group(1)) > best[1]:
            best = (mtime, int(match.group(1)))
    return best

