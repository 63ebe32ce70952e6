"""training: the trainer's step telemetry (RUN/tls/rank-*.jsonl) as metrics, followed incrementally.

The collector does one job, following the files, and hands the rest to the pieces that own it:
- each update reads only what this node's ranks appended since the last one (agent/tail.py `Follower`,
  agent/node_files.py `NodeFiles`) and folds it into `TrainingState` (trainguard/metrics/training_state.py);
- the lead rank's steps go to the run's cost meter (agent/cost_feed.py `CostFeed`), whose tier decisions
  go to `ctx.on_decision` (the agent's decision handlers), and every rank's to the straggler board;
- the families are rendered by the pure `trainguard.metrics.training.families` (replay renders the same).

Offsets and state are saved together, atomically, in RUN/agent/offsets-<node>.json (at most every
`save_every_seconds`, and at shutdown): an agent killed at any moment and restarted resumes from the last
save, re-reading what it read since with the counters of that moment, so no step is lost or counted twice.
A malformed line is counted (`trainguard_tls_malformed_lines_total{file}`) and logged with file:line.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from trainguard import log as tglog
from trainguard import policy as tgpolicy
from trainguard import rundir, signed, tls
from trainguard.agent.collector import Collector, CollectorDisabled, Context, Sample, register
from trainguard.agent.collectors.options import options
from trainguard.agent.cost_feed import CostFeed
from trainguard.agent.node_files import NodeFiles
from trainguard.agent.tail import Follower, load_json, save_json_atomic
from trainguard.decide.cost import CostMeter
from trainguard.decide.straggler import StragglerBoard
from trainguard.metrics import training as training_families
from trainguard.metrics.training_state import TrainingState
from trainguard.runtime import cordon_key

RANK_FILE = re.compile(r"^rank-(\d+)\.jsonl$")
STATE_VERSION = 1
OFFSETS_PURPOSE = "agent-offsets/1"     # RUN/agent/offsets-<node>.json, signed with the run's checkpoint key
MAX_ERRORS_LOGGED = 20          # per update; the counter has them all
CHECKPOINT_RESCAN_SECONDS = 30.0   # RUN/checkpoints listed at least this often even when its mtime holds


@register
class TrainingCollector(Collector):
    name = "training"
    interval = 2.0
    timeout = 10.0
    wall_clock = staticmethod(time.time)   # the checkpoint's age is counted to it; the golden test fixes it

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        if ctx.run_dir is None:
            raise CollectorDisabled("no run directory given (--run-dir), nothing to follow")
        self.run_dir = Path(ctx.run_dir)
        self.log = tglog.get("agent.training", node=ctx.node)
        self.node_files = NodeFiles(self.run_dir, ctx.node)   # a shared run directory: this node's ranks only
        self.follower = Follower(rundir.tls_dir(self.run_dir), "rank-*.jsonl", select=self.node_files)
        self.offsets_path = rundir.offsets_path(self.run_dir, ctx.node)
        # The saved state holds the cost meter's: a forged one could make the agent issue every cost tier, so
        # it is signed with the run's checkpoint key and one that does not check is not resumed from.
        self.key = cordon_key.signing_key(ctx.checkpoint_key_file, create=True)[0]
        self.bound = {"node": ctx.node, "run": rundir.run_name(self.run_dir)}
        self.state = TrainingState()
        opts = options(ctx.options, self.name, policy=None, save_every_seconds=5.0,
                       checkpoint_rescan_seconds=CHECKPOINT_RESCAN_SECONDS, per_rank=True)
        self.save_every = opts["save_every_seconds"]
        self.per_rank = opts["per_rank"]    # False: the node's lead rank only (docs/scale.md, the series budget)
        self.checkpoints = CheckpointLister(rundir.checkpoints_dir(self.run_dir), opts["checkpoint_rescan_seconds"])
        self._unsaved = False
        self._saved_at: float | None = None   # monotonic time of the last save; None: never
        self.cost = CostFeed(self._cost_meter(opts["policy"] or ctx.policy), ctx.on_decision, self.log)
        self.stragglers = StragglerBoard()   # rebuilt from the next steps after an agent restart
        self.restored = self._restore()

    # ---------------------------------------------------------------------------------- persistence

    def _cost_meter(self, policy) -> CostMeter:
        """The collector's own ``policy`` option (a file), else the agent's policy (never RUN/policy.yaml
        unchecked: agent/runner.py `choose_policy`)."""
        if isinstance(policy, tgpolicy.Policy):
            return CostMeter(policy.cost)
        return CostMeter(tgpolicy.load(policy).cost)

    def _restore(self) -> bool:
        try:
            saved = load_json(self.offsets_path)
        except ValueError as exc:  # a damaged file: start over rather than refuse to run
            self.log.error("offsets file unreadable; following from the start", error=str(exc))
            return False
        if not saved or saved.get("version") != STATE_VERSION:
            return False
        refused = signed.check(self.key, OFFSETS_PURPOSE, saved, self.bound)
        if refused is not None:
            self.log.error(signed.refusal_message(refused, f"the offsets file {self.offsets_path}") +
                           "; following from the start", reason=refused)
            return False
        self.follower.restore(saved.get("files") or {})
        self.state = TrainingState.from_dict(saved.get("state") or {})
        self.cost.load_state_dict(saved)
        self.log.info("resumed from saved offsets", path=str(self.offsets_path),
                      files=len(self.follower.positions))
        return True

    def _save(self) -> None:
        payload = {"version": STATE_VERSION, "saved_at": time.time(), "files": self.follower.state(),
                   "state": self.state.to_dict(), **self.cost.state_dict(), **self.bound}
        if self.key is not None:
            payload = signed.sign(self.key, OFFSETS_PURPOSE, payload)
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
        now = self.wall_clock()
        families = training_families.families(self.state, now, meter=self.cost.metering,
                                              stragglers=self.stragglers, per_rank=self.per_rank)
        return Sample(families, tls=self.state.tls_fragment(now))

    # ---------------------------------------------------------------------------------------- ingest

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
        if isinstance(metrics, dict) and rank >= 0:
            self.stragglers.observe(rank, str(record.get("node") or self.ctx.node), record["step"], metrics)

    def _meter_step(self, record: dict, rank: int) -> None:
        gpus = self.state.ranks[rank].gpu_count
        self.cost.observe(record, rank, len(self.follower.positions) if gpus is None else gpus)

    def _refresh_checkpoint(self) -> None:
        """A checkpoint on disk newer than the last checkpoint_saved event (or saved without one) counts too."""
        state = self.state
        on_disk = self.checkpoints.newest()
        if on_disk is not None and (state.checkpoint_time is None or on_disk[0] > state.checkpoint_time):
            state.checkpoint_time, state.checkpoint_step = on_disk
            state.checkpoint_name = rundir.step_dir_name(on_disk[1])


def _base_name(name: str) -> str:
    """rank-3.jsonl.1 (a rotated file being drained) -> rank-3.jsonl."""
    return name.split(".jsonl", 1)[0] + ".jsonl" if ".jsonl" in name else name


class CheckpointLister:
    """The newest checkpoint on disk, listed again only when RUN/checkpoints changed (its mtime) or every
    `rescan_seconds`. The collector asks at every update, a run keeps hundreds of checkpoints, and on a
    network filesystem every stat is a metadata round trip. A save renames its finished step_<N> into
    place (runtime/checkpoint/store.py), which changes the folder's mtime; the rescan covers filesystems
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
    """(mtime of its manifest, step) of the newest step_<N> in RUN/checkpoints whose manifest parses with
    the fields every manifest has (rundir.checkpoint_manifest): a garbage step_12345/manifest.json, touched
    to silence CheckpointStale, is no checkpoint. Newest first, so one manifest is read when all is well."""
    try:
        entries = list(folder.iterdir())
    except OSError:
        return None
    steps = sorted(((step, entry) for entry in entries
                    if (step := rundir.step_of_dir(entry.name)) is not None), key=lambda pair: -pair[0])
    for step, entry in steps:
        try:
            rundir.checkpoint_manifest(entry)
            return os.stat(entry / rundir.CHECKPOINT_MANIFEST).st_mtime, step
        except (OSError, ValueError):
            continue
    return None

