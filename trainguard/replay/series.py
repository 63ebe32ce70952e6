"""The series the agent would have exported for a recorded log, as Prometheus would have scraped them.

Replay does not know metric names: it renders the families the agent renders, with the same pure
functions of trainguard/metrics/. Training records are folded into a `TrainingState` and rendered by
`metrics.training.families`; disk await by `metrics.node.disk_families`; GPU readings by `metrics.gpu_metrics`. What
comes out is sampled on a scrape grid (every `interval` seconds from the first record), each sample
being the latest value exported at that instant, with the `job` and `instance` labels a scrape adds.

A node log's per-GPU readings (``hardware.gpus``) are turned back into the gpu collector's readings and
rendered by the pure `gpu_metrics.families`. One exporter per node (the records' ``node``), as there is one agent per node. Which records feed the
training state mirrors the agent: the ranks' own records (a ``rank`` field, or a ``rank-<r>.jsonl``
file); a node log's joined copy of the lead rank's metrics is used only when no input has ranks.

Prometheus test time starts at zero, so a value that is a Unix time (``*_timestamp_seconds``, the
Prometheus naming convention) is shifted by the grid's origin, as `time()` in a rule is.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Iterable

from trainguard import event_types
from trainguard.decide.straggler import StragglerBoard
from trainguard.metrics import gpu_metrics, training, training_state
from trainguard.metrics import node as node_families

JOB = "trainguard"                  # the agent's scrape job (alerts/rules.py AGENT_JOB)
DEFAULT_INSTANCE = "replay"         # records without a `node`
REPLAY_DISK = "replay"              # the one disk a node log's worst-disk await stands for
GPU_LABELS = gpu_metrics.LABEL_STYLES["trainguard"]    # the gpu collector's default label style
# TLS per-GPU keys that differ from the gpu collector's reading keys (the inverse of GPUCollector._tls;
# every other DCGM gauge reading has the same name in TLS). See docs/replay.md, "Integration".
_TLS_TO_READING = {"gpu_power_w": "power_w"}
_READING_KEYS = {key for _, key, _ in gpu_metrics.DCGM_GAUGES}
_RANK_FILE = re.compile(r"^rank-(\d+)\.jsonl")

SeriesKey = tuple   # (metric name, ((label, value), ...)) with labels sorted


def _samples(families) -> Iterable[tuple[str, dict, float]]:
    for family in families:
        for sample in family.samples:
            yield sample.name, sample.labels, sample.value


class NodeExporter:
    """What one node's agent would export, fed the node's records in time order."""

    def __init__(self, node: str, meter, cost_rank: int | None, stragglers: StragglerBoard | None = None):
        self.node = node
        # Every agent of a run reads all the ranks' logs of the shared run directory: one board for all nodes.
        self.stragglers = stragglers if stragglers is not None else StragglerBoard()
        self.training = training_state.TrainingState()
        self.meter, self.cost_rank = meter, cost_rank
        self.disk_ops = 0           # synthetic diskstats: one completed read per await reading
        self.disk_wait_ms = 0.0
        self.gpus: list[dict] = []  # the latest per-GPU entries
        self.ranks_up: dict[int, bool] = {}

    def observe_training(self, raw: dict, rank: int) -> None:
        self.training.apply(raw, rank)
        if isinstance(raw.get("metrics"), dict) and isinstance(raw.get("step"), int):
            self.stragglers.observe(rank, str(raw.get("node") or self.node), raw["step"], raw["metrics"])
        # The host collector checks the rank's pid; a log shows the process from its first record to its
        # `run_end` event (a rank that crashed without one reads as up: a log cannot tell).
        event = raw.get("event")
        self.ranks_up[rank] = not (isinstance(event, dict) and event.get("type") == event_types.RUN_END)

    def observe_hardware(self, hardware: dict) -> None:
        await_ms = hardware.get("disk_await_ms")
        if isinstance(await_ms, (int, float)) and math.isfinite(await_ms):
            # rate(read_time) / rate(reads) over a window is then the mean await the node log recorded there.
            self.disk_ops += 1
            self.disk_wait_ms += await_ms
        gpus = hardware.get("gpus")
        if isinstance(gpus, list) and gpus:
            self.gpus = [gpu for gpu in gpus if isinstance(gpu, dict)]
        elif any(key in hardware for key in ("gpu_temp_c", "gpu_util", "gpu_power_w")):
            self.gpus = [{"gpu": 0, **hardware}]     # a node-level reading (the seed form): one GPU

    def families(self, now: float) -> list:
        families = list(self._training_families(now)) if self.training.ranks else []
        if self.ranks_up:
            families += self._rank_up_families()
        if self.disk_ops:
            disk = node_families.DiskStats(0, 0, REPLAY_DISK, {"reads_completed": self.disk_ops, "read_ms": self.disk_wait_ms,
                                                 "writes_completed": 0, "write_ms": 0})
            families += node_families.disk_families([disk])
        if self.gpus:
            families += self._gpu_families()
        return families

    def _rank_up_families(self) -> list:
        # Only the liveness family of the host collector's rank families: CPU, memory and threads of the
        # process are not in a log, and are not made up here.
        alive = {rank: {"up": up, "user": 0.0, "system": 0.0, "rss": 0, "threads": 0}
                 for rank, up in self.ranks_up.items()}
        return [family for family in node_families.rank_families(alive)
                if family.name == "trainguard_rank_process_up"]

    def _gpu_families(self) -> list:
        """The per-GPU entries as readings, rendered by the gpu collector's own pure `families`."""
        gpus, readings = [], {}
        for position, entry in enumerate(self.gpus):
            index = entry.get("gpu") if isinstance(entry.get("gpu"), int) else position
            gpu = gpu_metrics.GPU(index, str(entry.get("uuid", "")), str(entry.get("name", "")), "", "",
                                  lost=bool(entry.get("lost")))
            gpus.append(gpu)
            reading = {_TLS_TO_READING.get(key, key): value for key, value in entry.items()
                       if isinstance(value, (int, float)) and not isinstance(value, bool)}
            readings[index] = {key: value for key, value in reading.items() if key in _READING_KEYS}
        return gpu_metrics.families(gpus, readings, {}, {}, self.node, GPU_LABELS, {})

    def _training_families(self, now: float) -> list:
        # As an agent with the default options: every rank scored (per_rank), the run's cost metered.
        return training.families(self.training, now, meter=self.meter, stragglers=self.stragglers)


@dataclass
class Grid:
    origin: float
    interval: float

    def tick(self, index: int) -> float:
        return self.origin + index * self.interval


class SeriesTable:
    """Samples exported series on the scrape grid: values[key][tick] (None: not exported then)."""

    def __init__(self, grid: Grid):
        self.grid = grid
        self.ticks = 0
        self.values: dict[SeriesKey, list[float | None]] = {}

    def scrape_until(self, when: float, families_at: Callable[[float], Iterable[tuple[str, dict, float]]],
                     inclusive: bool = False) -> None:
        """Every scrape before `when` (and at it, if inclusive), each seeing what was exported then."""
        while True:
            at = self.grid.tick(self.ticks)
            if at > when or (at == when and not inclusive):
                return
            self._scrape(families_at(at))

    def _scrape(self, samples: Iterable[tuple[str, dict, float]]) -> None:
        index = self.ticks
        for name, labels, value in samples:
            if name.endswith("_timestamp_seconds"):
                value -= self.grid.origin
            column = self.values.get((name, labels))
            if column is None:
                column = self.values[(name, labels)] = [None] * index
            column.append(float(value))
        for column in self.values.values():
            if len(column) == index:
                column.append(None)
        self.ticks += 1


class Exporters:
    """Routes stream entries to per-node exporters and scrapes them on the grid (the engine's observer).

    `stream` is the source.Stream being replayed: its files name the ranks, its lead rank (known once
    it is opened) is the rank the cost series follow."""

    def __init__(self, stream, meter, interval: float, restart_silence: float = math.inf):
        self.stream, self.meter, self.interval = stream, meter, interval
        self.nodes: dict[str, NodeExporter] = {}
        self.table: SeriesTable | None = None
        self.stragglers = StragglerBoard()
        # A rank whose own step goes back after more than `restart_silence` seconds without a record of
        # its own was restarted (a crash, a requeue) and appended to the log: its process was down in the
        # silence, as the host collector would have exported (so no stall alert there: nothing was hung).
        self.restart_silence = restart_silence
        self.last_step: dict[tuple[str, int], tuple[float, int]] = {}

    def __call__(self, entry) -> None:
        when, file_index, _, record, raw = entry
        if self.table is None:
            self.table = SeriesTable(Grid(when, self.interval))
        node = str(raw.get("node") or DEFAULT_INSTANCE)
        exporter = self.nodes.get(node)
        rank = self._rank(raw, file_index)
        stepped = rank is not None and record.step is not None and isinstance(raw.get("metrics"), dict)
        if stepped:
            before = self.last_step.get((node, rank))
            if (exporter is not None and before is not None and record.step <= before[1]
                    and when - before[0] > self.restart_silence):
                exporter.ranks_up[rank] = False             # down since its last record, up again below
        self.table.scrape_until(when, self._samples)
        if stepped:
            self.last_step[(node, rank)] = (when, record.step)
        if exporter is None:
            lead = self.stream.lead_rank
            exporter = self.nodes[node] = NodeExporter(node, self.meter, 0 if lead is None else lead, self.stragglers)
        if rank is not None:
            if record.step is not None and raw.get("step") is None:
                raw = {**raw, "step": record.step}     # the step replay gave a step-less record
            exporter.observe_training(raw, rank)
        hardware = raw.get("hardware")
        if isinstance(hardware, dict):
            exporter.observe_hardware(hardware)

    def _rank(self, raw: dict, file_index: int) -> int | None:
        rank = raw.get("rank")
        if isinstance(rank, int):
            return rank
        match = _RANK_FILE.match(self.stream.files[file_index].name)
        if match:
            return int(match.group(1))
        return 0 if self.stream.lead_rank is None else None     # logs without ranks: rank 0, as the engine

    def _samples(self, now: float) -> Iterable[tuple[str, tuple, float]]:
        for node, exporter in self.nodes.items():
            scrape = {"instance": node, "job": JOB}    # target labels win, as with honor_labels: false
            for name, labels, value in _samples(exporter.families(now)):
                yield name, tuple(sorted({**labels, **scrape}.items())), value

    def finish(self, last: float, hold: float = 0.0) -> SeriesTable | None:
        """Scrape up to the last record (and `hold` seconds past it, as if the agent kept exporting)."""
        if self.table is not None:
            self.table.scrape_until(last + hold, self._samples, inclusive=True)
        return self.table
