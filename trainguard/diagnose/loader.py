"""A run directory's TLS logs as the columns the checks read: the only I/O of `trainguard diagnose`.

Step series come from the trainer's ``rank-<r>.jsonl`` files (one record per step per rank); hardware
and host series from the agent's ``node-<host>.jsonl`` files (rotated parts included, oldest first).
Values are kept in ``array('d')`` columns (NaN where a record lacks the field), so a run of millions of
steps fits in memory. A malformed line is kept as its `TLSError` (file, line, field) and reported; it
never stops the diagnosis and is never dropped silently.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from pathlib import Path

from trainguard import paths
from trainguard.formats import discover
from trainguard.progress import Progress
from trainguard.tls import TLSError, iter_lines

NAN = math.nan
ERRORS_KEPT = 50

# Rank columns: TLS field -> sections looked in, in order (the trainer puts memory under `hardware`).
RANK_FIELDS = {
    "step_time_seconds": ("metrics",),
    "data_wait_seconds": ("metrics",),
    "comm_seconds": ("metrics",),
    "forward_backward_seconds": ("metrics",),
    "optimizer_seconds": ("metrics",),
    "loss": ("metrics",),
    "grad_norm": ("metrics",),
    "tokens_trained": ("metrics",),
    "tokens_loaded": ("metrics",),
    "mfu": ("metrics",),            # only where the peak is documented (runtime/mfu.py): read, never estimated
    "mem_allocated_bytes": ("hardware", "metrics"),
    "mem_reserved_bytes": ("hardware", "metrics"),
}
_RANK_LOOKUP = [(name, sections[0] == "hardware") for name, sections in RANK_FIELDS.items()]
# Per-GPU columns of the agent's node records (`hardware.gpus[]`), named as the GPU collector's readings.
GPU_FIELDS = (
    "gpu_util", "gpu_temp_c", "sm_clock_mhz", "sm_clock_max_mhz", "throttle_reasons",
    "mem_used_bytes", "mem_total_bytes",
    "pcie_link_gen", "pcie_link_gen_max", "pcie_link_width", "pcie_link_width_max",
    "nvlink_links", "nvlink_links_active",
    "xid_errors", "ecc_dbe_volatile", "remapped_uncorrectable", "remap_pending",
)
NODE_FIELDS = ("disk_await_ms",)


class Columns:
    """Named float columns of equal length plus a step and a timestamp per row."""

    def __init__(self, names):
        self.names = tuple(names)
        self.steps = array("q")          # -1 where a row has no step
        self.timestamps = array("d")
        self.values = {name: array("d") for name in self.names}
        self._ordered = [self.values[name] for name in self.names]

    def append(self, step: int | None, timestamp: float, row) -> None:
        """`row`: the values in `names` order (NaN for a missing one)."""
        self.steps.append(-1 if step is None else step)
        self.timestamps.append(timestamp)
        for column, value in zip(self._ordered, row):
            column.append(value)

    def __len__(self) -> int:
        return len(self.timestamps)

    def has(self, name: str) -> bool:
        """True when at least one row holds a finite value of `name`."""
        return any(math.isfinite(v) for v in self.values.get(name, ()))


@dataclass
class RunData:
    """Everything the checks read: built by `load_run`, or by tests directly."""

    run_dir: str
    ranks: dict[int, Columns] = field(default_factory=dict)            # rank -> step rows
    rank_nodes: dict[int, str] = field(default_factory=dict)           # rank -> host it ran on
    gpus: dict[tuple[str, str], Columns] = field(default_factory=dict)  # (host, gpu id) -> samples
    nodes: dict[str, Columns] = field(default_factory=dict)            # host -> node-level samples
    events: list[dict] = field(default_factory=list)                   # every event record
    malformed: int = 0
    errors: list[str] = field(default_factory=list)                    # the first ERRORS_KEPT, with file:line
    files: list[str] = field(default_factory=list)
    records: int = 0


def _number(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return NAN
    return float(value)


def _columns(table: dict, key, names) -> Columns:
    found = table.get(key)
    if found is None:
        found = table[key] = Columns(names)
    return found


def add_rank_record(run: RunData, rank: int, record: dict) -> None:
    """One trainer record: a step row when it carries step metrics; an event either way."""
    if isinstance(record.get("event"), dict):
        run.events.append(record)
    metrics = record.get("metrics")
    if not isinstance(metrics, dict) or record.get("step") is None:
        return
    if isinstance(record.get("node"), str):
        run.rank_nodes.setdefault(rank, record["node"])
    # tls.normalise has made every one of these a number already (they are all TLS numeric fields)
    hardware = record.get("hardware") or {}
    row = []
    for name, in_hardware in _RANK_LOOKUP:
        value = hardware.get(name) if in_hardware and name in hardware else metrics.get(name)
        row.append(NAN if value is None else value)
    _columns(run.ranks, rank, RANK_FIELDS).append(record["step"], record["timestamp"], row)


def add_node_record(run: RunData, host: str, record: dict) -> None:
    """One joined agent record: per-GPU rows from `hardware.gpus`, node rows (disk await), events."""
    if isinstance(record.get("event"), dict):
        run.events.append(record)
    hardware = record.get("hardware")
    if not isinstance(hardware, dict):
        return
    ts = record["timestamp"]
    if any(name in hardware for name in NODE_FIELDS):
        row = [_number(hardware.get(name)) for name in NODE_FIELDS]
        _columns(run.nodes, host, NODE_FIELDS).append(None, ts, row)
    for position, gpu in enumerate(hardware.get("gpus") or ()):
        if not isinstance(gpu, dict):
            continue
        gpu_id = str(gpu.get("gpu", gpu.get("index", position)))
        row = [_number(gpu.get(name)) for name in GPU_FIELDS]
        _columns(run.gpus, (host, gpu_id), GPU_FIELDS).append(None, ts, row)


def _note_error(run: RunData, error: TLSError) -> None:
    run.malformed += 1
    if len(run.errors) < ERRORS_KEPT:
        run.errors.append(str(error))


def load_run(run_dir: str | Path) -> RunData:
    """Read the logs `run_dir` stands for (trainguard.formats.discover: RUN/tls/*.jsonl, a tls directory
    itself, or other tools' logs); FileNotFoundError when there is no such directory."""
    root = paths.run_dir(run_dir)
    run = RunData(run_dir=str(root))
    logs = discover.one_run_logs(root)      # TLS logs, else other tools' of one run (as rank 0's steps)
    with Progress("diagnose", unit="logs") as shown:
        for index, log in enumerate(logs):
            path, kind, name = log.path, log.kind, log.name
            shown.file(path, index, len(logs))
            run.files.append(str(path))
            for line in shown.counted(iter_lines(path)):
                if line.error:
                    _note_error(run, line.error)
                    continue
                run.records += 1
                record = line.record
                if kind == "node":
                    add_node_record(run, name, record)
                elif name.isdigit() or kind == discover.FILE:
                    add_rank_record(run, record.get("rank", int(name) if name.isdigit() else 0), record)
    return run
