"""Node risk: is this node likely to fail soon? A score from its hardware trends, debounced, with a fleet budget.

Pure (no I/O, no clock): the agent feeds it its node's readings, replay and bench/bench_node_risk.py feed it
recorded node logs; all three get the same verdicts. docs/node-risk.md has the why of every number.

Signals (each a contribution in [0, 1] times its weight; the score is their sum, capped at 1):

| signal | reads | contribution | weight | why |
|---|---|---|---|---|
| `remap_failure` | row remapping failed (state) | 1 | 1.0 | the GPU has no spare rows left: its next uncorrectable error cannot be fenced (NVIDIA: RMA) |
| `xid_drain` | XIDs of class node_drain (64, 79, 143) in the window | 1 | 1.0 | the catalogue's own verdict: drain |
| `uncorrectable_ecc` | uncorrectable ECC errors in the window | 1 per error | 0.7 | a DBE is the event every HBM failure ends in; one is rarely alone |
| `xid_reset` | XIDs of class gpu_reset (48, 74, 95, 140, 154) in the window | 1 per XID, at most 1 | 0.5 | the driver asks for a reset it cannot get during a run |
| `remapped_rows` | rows remapped in the window | rows / 2, at most 1 | 0.4 | a stack remapping rows is wearing out (rows are few: 8 per bank on H100) |
| `remap_pending` | a remap waiting for a reset (state) | 1 | 0.2 | the remapped row is not in use until a reset: the bad row still is |
| `correctable_ecc` | corrected ECC errors per hour in the window (rates over at least a quarter of it) | rate / limit, at most 1 | 0.3 | corrected errors climbing precede uncorrectable ones (the 2201.11853 features) |
| `pcie_link` | link narrower than its max (state, or a downgrade in the window) | 1 | 0.3 | a degraded link: slow all-reduce, then "fallen off the bus" |
| `pcie_replays` | PCIe replays per hour | rate / limit, at most 1 | 0.3 | a link retrying more and more is on its way down (with a narrow link: at risk) |
| `nvlink` | NVLink CRC and replay errors per hour | rate / limit, at most 1 | 0.2 | a flaky link retrains and stalls collectives |
| `infiniband` | IB symbol errors per hour, link downs in the window | rate / limit; a link down 1 | 0.2 | the node's fabric port degrading |
| `xid_driver` | XIDs of class driver_firmware in the window | 1 | 0.2 | GSP / firmware faults recur; a reset clears them |
| `diag_isolate` | a dcgmi diag result failed with severity ISOLATE in the window | 1 | 1.0 | DCGM's own verdict: take the GPU out of use |
| `diag_failed` | another failed dcgmi diag result in the window | 1 | 0.4 | a GPU failed a test (memory, PCIe, stress); with one more signal, at risk |
| `ras_not_responding` | NCCL RAS reported this node's ranks or processes not answering, in the window | 1 | 0.2 | the job saw the node go quiet: a hang or a stopped process more often than hardware, so it corroborates, never decides |
| `thermal` | share of the window held down by thermal slowdown | share / limit, at most 1 | 0.15 | a cooling fault ages the part and slows the whole job |

Application-error XIDs (13, 31, 43, 45, ...) weigh nothing: the job that hit them is at fault, not the node.
XID 63 (a row remapped or a page retired) is the event `remapped_rows` and `remap_pending` already count, so it
is not counted again as a reset-class XID: one remapped row on a healthy stack is routine, not a risk.

Debounce: a node is at risk only when its score has been at or above `threshold` for `consecutive` readings
in a row. Reboot transient: a counter that goes backwards (a reboot or a driver reload resets the volatile
counters), a reading after a gap longer than `gap_seconds`, or a GPU coming back from lost starts a settle
period of `settle_seconds` in which only the hard signals count (remap failure, drain-class XIDs,
uncorrectable ECC, a dcgmi diag ISOLATE verdict): link downs, narrow links and lost GPUs while a node boots are its boot, not its failure
(NVSentinel #1701: 214 of 288 nodes flagged after planned reboots). Circuit breaker: at most
`max_flags_per_hour` nodes flagged in any hour (fleet-wide: the caller passes the flags it knows of); a node
past the budget is reported `suppressed`, not flagged, so a fleet-wide event (a bad driver roll-out) cannot
drain the fleet.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

from trainguard import actions, xid_catalog
from trainguard.config import above, at_least, between, key as declare

# The GPU counters the rule reads (cumulative; a decrease is a restart) and the states (0/1 now).
COUNTERS = ("ecc_sbe_volatile", "ecc_dbe_volatile", "remapped_rows", "retired_pages", "pcie_replays",
            "pcie_downgrades", "nvlink_crc_errors", "nvlink_replay_errors", "thermal_violation_ns")
STATES = ("remap_pending", "remap_failure")
# node-level: the ib collector's, and the health findings the health_reports collector counts (cumulative, kept
# across agent restarts: agent/health_timeline.py)
NODE_COUNTERS = ("ib_symbol_errors", "ib_link_downed", "health_diag_isolate", "health_diag_failures",
                 "health_ras_not_responding")
FINDING_KEYS = frozenset(f"node:{k}" for k in NODE_COUNTERS if k.startswith("health_"))
HARD = ("remap_failure", "xid_drain", "uncorrectable_ecc", "diag_isolate")
COUNTED_AS_ROWS = frozenset({63})      # the remap event itself: remapped_rows / remap_pending weigh it

WEIGHTS: dict[str, float] = {
    "remap_failure": 1.0, "xid_drain": 1.0, "uncorrectable_ecc": 0.7, "xid_reset": 0.5, "remapped_rows": 0.4,
    "correctable_ecc": 0.3, "pcie_link": 0.3, "pcie_replays": 0.3, "remap_pending": 0.2, "nvlink": 0.2, "infiniband": 0.2,
    "xid_driver": 0.2, "thermal": 0.15, "diag_isolate": 1.0, "diag_failed": 0.4, "ras_not_responding": 0.2,
}
SIGNALS = tuple(WEIGHTS)

DRAIN_AT_CHECKPOINT = actions.DRAIN     # what a flag asks for (trainguard/actions.py's row)


@dataclass(frozen=True)
class NodeRiskPolicy:
    """The rule's thresholds (policy section `node_risk`); the module doc and docs/node-risk.md say why."""

    threshold: float = declare(0.6, between(0, 1, low_open=True),
                           "risk score at or above which a reading counts towards 'at risk'")
    consecutive: int = declare(3, at_least(1, 10**4), "readings in a row at or above the threshold before a node is "
                           "at risk (the debounce)")
    window_seconds: float = declare(3600.0, above(0, 10**7), "seconds of history the counters' increases and rates "
                                "are taken over")
    settle_seconds: float = declare(900.0, at_least(0, 10**6), "after a restart, a gap or a GPU back from lost, "
                                "seconds in which only the hard signals count (a reboot's transient)")
    gap_seconds: float = declare(600.0, above(0, 10**6), "readings further apart than this mean the node was away")
    max_flags_per_hour: int = declare(2, at_least(0, 10**4), "circuit breaker: nodes flagged in any hour, fleet-wide")
    correctable_ecc_per_hour: float = declare(100.0, above(0), "corrected ECC errors per hour that count fully")
    pcie_replays_per_hour: float = declare(1000.0, above(0), "PCIe replays per hour that count fully")
    nvlink_errors_per_hour: float = declare(100.0, above(0), "NVLink CRC + replay errors per hour that count fully")
    ib_symbol_errors_per_hour: float = declare(100.0, above(0), "InfiniBand symbol errors per hour that count fully")
    thermal_share: float = declare(0.05, between(0, 1, low_open=True), "share of the window in thermal slowdown "
                               "that counts fully")


@dataclass(frozen=True)
class GpuHealth:
    """One GPU in one reading: its cumulative counters, states, XIDs per code, and whether NVML lost it."""

    gpu: str
    counters: Mapping[str, float] = field(default_factory=dict)
    states: Mapping[str, float] = field(default_factory=dict)
    xids: Mapping[int, int] = field(default_factory=dict)
    lost: bool = False


@dataclass(frozen=True)
class NodeReading:
    node: str
    timestamp: float                      # seconds (Unix or any monotonic clock the caller keeps)
    gpus: tuple[GpuHealth, ...] = ()
    counters: Mapping[str, float] = field(default_factory=dict)    # node-level: ib_symbol_errors, ib_link_downed


@dataclass(frozen=True)
class RiskVerdict:
    node: str
    timestamp: float
    score: float
    signals: Mapping[str, float]          # signal -> weighted contribution, only those above 0
    streak: int                           # readings in a row at or above the threshold
    at_risk: bool                         # debounced: streak >= consecutive
    flagged: bool = False                 # newly at risk and within the fleet budget: act now
    suppressed: str = ""                  # why a node at risk was not flagged ("circuit_open")
    settling: bool = False                # in a settle period after a restart, gap or lost GPU
    action: str | None = None             # DRAIN_AT_CHECKPOINT when flagged

    def evidence(self) -> dict[str, Any]:
        """What a TLS event / shadow event / alert annotation carries."""
        return {"node": self.node, "score": round(self.score, 4), "streak": self.streak,
                "signals": {k: round(v, 4) for k, v in sorted(self.signals.items())},
                **({"suppressed": self.suppressed} if self.suppressed else {})}


@dataclass
class _NodeState:
    # (timestamp, {key: cumulative value}) within the window
    history: deque[tuple[float, dict[str, float]]] = field(default_factory=deque)
    last_timestamp: float | None = None
    previous: dict[str, float] = field(default_factory=dict)
    settle_until: float = float("-inf")
    streak: int = 0
    at_risk: bool = False
    lost: set[str] = field(default_factory=set)


class NodeRisk:
    """The rule over every node it is fed; `observe(reading)` -> RiskVerdict. `flags` holds the flag times the
    circuit breaker counts (seed it with flags made elsewhere in the fleet: `note_flag`)."""

    def __init__(self, policy: NodeRiskPolicy | None = None):
        self.policy = policy or NodeRiskPolicy()
        self.nodes: dict[str, _NodeState] = {}
        self.flags: deque[float] = deque()

    def note_flag(self, timestamp: float) -> None:
        """A node flagged elsewhere (another agent's cordon): it counts against this hour's budget."""
        self.flags.append(timestamp)

    def observe(self, reading: NodeReading) -> RiskVerdict:
        p = self.policy
        state = self.nodes.setdefault(reading.node, _NodeState())
        now = reading.timestamp
        values = flatten(reading)
        restarted = _went_backwards(state.previous, values)
        back_from_lost = bool(state.lost - {g.gpu for g in reading.gpus if g.lost})
        gap = state.last_timestamp is not None and now - state.last_timestamp > p.gap_seconds
        if restarted or gap or back_from_lost:
            state.settle_until = now + p.settle_seconds
            state.history.clear()            # rates across a restart mean nothing
            # ... but a finding counted while the node was away is news: the report counts survive reboots
            # (the agent keeps them), so their last values stay the baseline
            kept = {k: v for k, v in state.previous.items() if k in FINDING_KEYS and v <= values.get(k, -1.0)}
            if kept:
                state.history.append((now, kept))
        state.lost = {g.gpu for g in reading.gpus if g.lost}
        state.previous, state.last_timestamp = values, now
        state.history.append((now, values))
        while state.history and state.history[0][0] < now - p.window_seconds:
            state.history.popleft()
        settling = now < state.settle_until
        signals = self._signals(reading, state.history, values)
        if settling:
            signals = {name: value for name, value in signals.items() if name in HARD}
        score = min(1.0, sum(signals.values()))
        state.streak = state.streak + 1 if score >= p.threshold else 0
        was_at_risk, state.at_risk = state.at_risk, state.streak >= p.consecutive
        verdict = RiskVerdict(reading.node, now, score, signals, state.streak, state.at_risk, settling=settling)
        if state.at_risk and not was_at_risk:
            return self._flag(verdict, state)
        return verdict

    def _flag(self, verdict: RiskVerdict, state: _NodeState) -> RiskVerdict:
        now = verdict.timestamp
        while self.flags and self.flags[0] <= now - 3600.0:
            self.flags.popleft()
        if len(self.flags) >= self.policy.max_flags_per_hour:
            state.at_risk = False            # asked again at its next reading: the budget may have room then
            return _replace(verdict, suppressed="circuit_open")
        self.flags.append(now)
        return _replace(verdict, flagged=True, action=DRAIN_AT_CHECKPOINT)

    def _signals(self, reading: NodeReading, history: deque[tuple[float, dict[str, float]]],
                 values: dict[str, float]) -> dict[str, float]:
        p = self.policy
        first_time, first = history[0]
        # a rate is never extrapolated from less than a quarter of the window: one error in the first minute
        # is not 60 an hour
        hours = max(reading.timestamp - first_time, p.window_seconds / 4.0) / 3600.0

        def increase(suffix: str) -> float:
            return float(sum(max(0.0, v - first.get(k, v)) for k, v in values.items() if k.endswith(suffix)))

        def per_hour(suffix: str) -> float:
            return increase(suffix) / hours if len(history) > 1 else 0.0

        raw: dict[str, float] = {}
        raw["remap_failure"] = 1.0 if any(g.states.get("remap_failure") for g in reading.gpus) else 0.0
        raw["remap_pending"] = 1.0 if any(g.states.get("remap_pending") for g in reading.gpus) else 0.0
        by_class = {c: 0.0 for c in xid_catalog.CLASSES}
        for key, value in values.items():
            if ":xid:" in key:
                grown = max(0.0, value - first.get(key, 0.0))
                code = int(key.rsplit(":", 1)[1])
                if code in COUNTED_AS_ROWS:
                    continue
                by_class[xid_catalog.class_of(code)] = by_class.get(xid_catalog.class_of(code), 0.0) + grown
        raw["xid_drain"] = 1.0 if by_class[xid_catalog.DRAIN] else 0.0
        raw["xid_reset"] = min(1.0, by_class[xid_catalog.RESET])
        raw["xid_driver"] = 1.0 if by_class[xid_catalog.DRIVER] else 0.0
        raw["uncorrectable_ecc"] = min(1.0, increase(":ecc_dbe_volatile"))
        raw["remapped_rows"] = min(1.0, (increase(":remapped_rows") + increase(":retired_pages")) / 2.0)
        raw["correctable_ecc"] = min(1.0, per_hour(":ecc_sbe_volatile") / p.correctable_ecc_per_hour)
        narrow = increase(":pcie_downgrades") > 0 or any(
            g.counters.get("pcie_link_width", 0) and g.counters.get("pcie_link_width", 0)
            < g.counters.get("pcie_max_link_width", 0) for g in reading.gpus)
        raw["pcie_link"] = 1.0 if narrow else 0.0
        raw["pcie_replays"] = min(1.0, per_hour(":pcie_replays") / p.pcie_replays_per_hour)
        nvlink = per_hour(":nvlink_crc_errors") + per_hour(":nvlink_replay_errors")
        raw["nvlink"] = min(1.0, nvlink / p.nvlink_errors_per_hour)
        link_down = increase("node:ib_link_downed") > 0
        raw["infiniband"] = 1.0 if link_down else min(1.0, per_hour("node:ib_symbol_errors")
                                                      / p.ib_symbol_errors_per_hour)
        thermal_share = increase(":thermal_violation_ns") / 1e9 / (hours * 3600.0) / max(len(reading.gpus), 1)
        raw["thermal"] = min(1.0, thermal_share / p.thermal_share) if len(history) > 1 else 0.0
        raw["diag_isolate"] = 1.0 if increase("node:health_diag_isolate") > 0 else 0.0
        raw["diag_failed"] = 1.0 if increase("node:health_diag_failures") > 0 else 0.0
        raw["ras_not_responding"] = 1.0 if increase("node:health_ras_not_responding") > 0 else 0.0
        return {name: WEIGHTS[name] * value for name, value in raw.items() if value > 0}


def flatten(reading: NodeReading) -> dict[str, float]:
    """{"gpu<i>:<counter>": value, "gpu<i>:xid:<code>": count, "node:<counter>": value} of one reading."""
    out: dict[str, float] = {}
    for gpu in reading.gpus:
        if gpu.lost:
            continue          # a lost GPU answers nothing; its XIDs still arrive through the kernel log below
        for key in COUNTERS:
            if key in gpu.counters:
                out[f"gpu{gpu.gpu}:{key}"] = float(gpu.counters[key])
    for gpu in reading.gpus:
        for code, count in gpu.xids.items():
            out[f"gpu{gpu.gpu}:xid:{int(code)}"] = float(count)
    for key in NODE_COUNTERS:
        if key in reading.counters:
            out[f"node:{key}"] = float(reading.counters[key])
    return out


def _went_backwards(before: Mapping[str, float], now: Mapping[str, float]) -> bool:
    return any(key in before and value < before[key] for key, value in now.items())


def _replace(verdict: RiskVerdict, **changes: Any) -> RiskVerdict:
    return replace(verdict, **changes)


def _section(record: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = record.get(name)
    return value if isinstance(value, dict) else {}


def reading_from_tls(record: Mapping[str, Any]) -> NodeReading | None:
    """A node's reading from one of its TLS records (the agent's joined node log: hardware.gpus from the gpu
    collector, system.ib_* from the ib collector, system.health_* from the health_reports collector); None for a
    record that carries no GPU, IB or health-report counts."""
    hardware = _section(record, "hardware")
    system = _section(record, "system")
    gpus: list[GpuHealth] = []
    for entry in hardware.get("gpus") or ():
        if not isinstance(entry, dict):
            continue
        numbers = {k: float(v) for k, v in entry.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        xids = _section(entry, "xids")
        gpus.append(GpuHealth(
            gpu=str(entry.get("gpu", len(gpus))),
            counters={k: v for k, v in numbers.items() if k in COUNTERS or k.startswith("pcie_")},
            states={k: v for k, v in numbers.items() if k in STATES},
            xids={int(k): int(v) for k, v in xids.items() if str(k).isdigit() and isinstance(v, (int, float))},
            lost=entry.get("lost") is True))
    node_counters = {k: float(system[k]) for k in NODE_COUNTERS
                     if isinstance(system.get(k), (int, float)) and not isinstance(system.get(k), bool)}
    if not gpus and not node_counters:
        return None
    timestamp = record.get("timestamp")
    if not isinstance(timestamp, (int, float)):
        return None
    return NodeReading(str(record.get("node", "")), float(timestamp), tuple(gpus), node_counters)


def replay(readings: Iterable[NodeReading], policy: NodeRiskPolicy | None = None) -> list[RiskVerdict]:
    """Every verdict that matters (at risk, flagged, suppressed) over readings in time order."""
    rule = NodeRisk(policy)
    return [v for v in map(rule.observe, readings) if v.at_risk or v.flagged or v.suppressed]
