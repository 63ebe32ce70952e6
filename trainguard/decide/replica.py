"""Replica checks: every data-parallel replica's fingerprints in, a verdict out. Pure: no torch, no I/O.

Replicas that train in lockstep hold bit-identical weights, and after the all-reduce bit-identical
gradients, so any difference between their fingerprints (trainer/fingerprint.py) is corruption. The
rule, in the order it is applied:

1. All replicas agree on gradients and weights: nothing to do.
2. What differed: **gradients** when the gradient fingerprints disagree (corruption in the reduction,
   on the wire, or in a rank's gradient memory after it; the weights then differ too, since the update
   applied them), else **weights** (corruption of the parameters or of what updates them on one rank).
3. Who is wrong, from the fingerprints that differed:
   - three or more replicas: the minority — every rank outside the one value a strict majority holds;
     no strict majority (e.g. 1-1-1, 2-2): nobody is named;
   - a rank whose own re-computation of its fingerprint differs from its first one: that rank (its
     memory or arithmetic is unstable right now), whatever the world size;
   - two replicas, stable re-computations, gradients differ: nobody yet. Every rank rolls back to the
     newest verified checkpoint and *replays* the same steps on the same data; when the same step is
     checked again and the replicas agree, the rank whose recorded gradient fingerprint differs from the
     replayed one is named (an `arbitration` verdict). If they disagree again the fault is not
     transient: a second mismatch at that step.
   - two replicas, stable re-computations, weights differ: nobody can be named. The corrupted weight
     took part in the forward and its gradient in the all-reduce, so the healthy replica's weights
     moved with it: a replay from the checkpoint reproduces neither (docs/sdc.md).
4. Action: `rollback` (every rank to the newest verified checkpoint) for every mismatch; `stop` for a
   mismatch at a step that already mismatched once: the replay reproduced it, so it is not transient and
   another rollback would only loop.
5. Cordon: a node named twice within `cordon_window_seconds` is cordoned.

A `ReplicaMonitor` holds the pending arbitration and the per-node history, so the live run and
`trainguard replay` (fed the recorded `replica_check` events) take the same decisions.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from typing import Any, Iterable, Iterator

from trainguard import event_types
from trainguard.actions import ROLLBACK, STOP
from trainguard.config import at_least, key

WEIGHTS, GRADIENTS = "weights", "gradients"
MISMATCH, ARBITRATION = event_types.REPLICA_MISMATCH, "arbitration"
MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class ReplicaCheck:
    """One check, as every rank saw it after the all-gather: index i of each tuple is rank i."""

    step: int
    timestamp: float
    weights: tuple[int, ...]
    gradients: tuple[int, ...] = ()          # empty: gradients not checked at this step
    recomputed: tuple[int, ...] = ()         # weights fingerprinted again after a mismatch; empty if not
    nodes: tuple[str, ...] = ()              # each rank's host, for the incident and the cordon

    def node_of(self, rank: int) -> str | None:
        return self.nodes[rank] if rank < len(self.nodes) else None


@dataclass(frozen=True)
class ReplicaVerdict:
    """A replica check's finding: which ranks hold wrong weights or gradients, how sure, what to do."""

    kind: str                     # "replica_mismatch" | "arbitration"
    step: int
    what: str                     # "weights" | "gradients"
    ranks: tuple[int, ...]        # the ranks named wrong; () when it cannot be told (yet)
    nodes: tuple[str, ...]        # their hosts
    confidence: float
    reasons: tuple[str, ...]
    action: str | None = ROLLBACK
    cordon: tuple[str, ...] = ()  # hosts to cordon now (a second mismatch within the window)
    values: dict[str, Any] = field(default_factory=dict)   # {"weights": [...], "gradients": [...]} per rank
    timestamp: float = 0.0        # of the check that mismatched (an arbitration: of the first one)


@dataclass(frozen=True)
class ReplicaCheckConfig:
    """The replica check's keys in the policy's `guard` section (the trainer runs the check; `ReplicaPolicy`
    is what `ReplicaMonitor` reads of them)."""

    replica_check_every: int = key(50, at_least(0, 10**7), "steps between two fingerprints of every replica's "
                                   "weights and gradients (0: never; bench/bench_sdc.py measures a check)")
    replica_cordon_window_seconds: float = key(86400.0, at_least(0, 10**9), "a node named in a replica mismatch "
                                               "twice within this many seconds is cordoned")


@dataclass(frozen=True)
class ReplicaPolicy:
    """How long a node named in one mismatch is remembered: a second one within it cordons the node."""

    cordon_window_seconds: float = 86400.0


def agree(values: tuple[int, ...]) -> bool:
    return len(set(values)) <= 1


def minority(values: tuple[int, ...]) -> tuple[int, ...] | None:
    """Ranks outside the value held by a strict majority of replicas; None when there is no such value."""
    if len(values) < 3:
        return None
    value, count = Counter(values).most_common(1)[0]
    if 2 * count <= len(values):
        return None
    return tuple(rank for rank, v in enumerate(values) if v != value)


def unstable(check: ReplicaCheck) -> tuple[int, ...]:
    """Ranks whose re-computed weights fingerprint differs from the first one."""
    return tuple(r for r, (a, b) in enumerate(zip(check.weights, check.recomputed)) if a != b)


def what_differed(check: ReplicaCheck) -> str | None:
    if check.gradients and not agree(check.gradients):
        return GRADIENTS
    if not agree(check.weights):
        return WEIGHTS
    return None


class ReplicaMonitor:
    """Fed every check in step order; returns a ReplicaVerdict when one is due, else None."""

    def __init__(self, policy: ReplicaPolicy | None = None):
        self.policy = policy or ReplicaPolicy()
        self.pending: dict[str, Any] | None = None          # {"step", "what", "weights", "gradients"} to arbitrate
        self.named: dict[str, list[float]] = {}   # host -> times it was named wrong
        self.mismatched: list[int] = []           # steps that mismatched (a replay reaching one again)

    def observe(self, check: ReplicaCheck) -> ReplicaVerdict | None:
        verdict = self._arbitrate(check) if self.pending and self.pending["step"] == check.step else None
        if verdict is not None:
            return verdict
        what = what_differed(check)
        if what is None:
            return None
        repeated = check.step in self.mismatched
        self.mismatched = self.mismatched[-63:] + [check.step]
        return self._mismatch(check, what, repeated)

    # --------------------------------------------------------------------------------- the rules
    def _mismatch(self, check: ReplicaCheck, what: str, repeated: bool) -> ReplicaVerdict:
        values = check.gradients if what == GRADIENTS else check.weights
        reasons = [f"{what} fingerprints differ at step {check.step}: " + _spell(values)]
        ranks: tuple[int, ...] = ()
        confidence = 0.0
        if check.recomputed and (flaky := unstable(check)):
            ranks, confidence = flaky, 0.9
            reasons.append(f"rank(s) {_ranks(flaky)} computed a different fingerprint when asked again")
        elif (odd := minority(values)) is not None:
            ranks, confidence = odd, 0.9
            reasons.append(f"rank(s) {_ranks(odd)} differ from the majority of {len(values)} replicas")
        elif len(values) == 2 and what == GRADIENTS and not repeated:
            reasons.append("two replicas, stable re-computations: cannot tell which is wrong yet; every "
                           "rank replays from the newest verified checkpoint and this step's gradients "
                           "are compared again")
            self.pending = {"step": check.step, "what": what, "weights": check.weights,
                            "gradients": check.gradients, "timestamp": check.timestamp,
                            "reasons": list(reasons)}
        elif len(values) == 2:
            reasons.append("two replicas: a corrupted weight cannot be attributed (it fed the all-reduce, so "
                           "the healthy replica's weights moved with it and a replay matches neither); both "
                           "roll back")
        else:
            reasons.append("no strict majority among the replicas: nobody can be named")
        if repeated:
            reasons.append(f"step {check.step} mismatched before and again after the replay: not transient, "
                           "stopping (a rollback would only repeat it)")
            return self._verdict(MISMATCH, check, what, ranks, confidence, reasons, values, action=STOP)
        return self._verdict(MISMATCH, check, what, ranks, confidence, reasons, values)

    def _arbitrate(self, check: ReplicaCheck) -> ReplicaVerdict | None:
        """The step of a two-replica mismatch, checked again after the replay."""
        pending, self.pending = self.pending, None
        assert pending is not None      # observe() calls this only with one pending
        what = pending["what"]
        replayed, recorded = (check.gradients, pending["gradients"]) if what == GRADIENTS else \
            (check.weights, pending["weights"])
        if not replayed or not agree(replayed) or what_differed(check) is not None:
            return None     # the replay disagrees again: observe() treats it as a new mismatch
        truth = replayed[0]
        ranks = tuple(r for r, v in enumerate(recorded) if v != truth)
        reasons = pending.get("reasons", []) + [
            f"replayed from the newest verified checkpoint, step {check.step} gives {hex64(truth)} on every rank",
            f"rank(s) {_ranks(ranks)} had recorded a different {what} fingerprint"]
        if len(ranks) == len(recorded):
            reasons.append("every rank differs from the replay: the steps are not bit-deterministic here")
            return self._verdict(ARBITRATION, check, what, (), 0.0, reasons, recorded, action=None,
                                 timestamp=pending["timestamp"])
        return self._verdict(ARBITRATION, check, what, ranks, 0.8, reasons, recorded, action=None,
                             timestamp=pending["timestamp"])

    def _verdict(self, kind: str, check: ReplicaCheck, what: str, ranks: tuple[int, ...], confidence: float,
                 reasons: list[str], values: tuple[int, ...], action: str | None = ROLLBACK,
                 timestamp: float | None = None) -> ReplicaVerdict:
        nodes = tuple(n for n in (check.node_of(r) for r in ranks) if n is not None)
        cordon = self._cordon(nodes, check.timestamp)
        if cordon:
            reasons.append(f"named again within {self.policy.cordon_window_seconds:g}s: cordon "
                           + ", ".join(cordon))
        return ReplicaVerdict(kind, check.step, what, ranks, nodes, confidence, tuple(reasons), action, cordon,
                       {"weights": list(check.weights), "gradients": list(check.gradients),
                        what + "_recorded": list(values)},
                       check.timestamp if timestamp is None else timestamp)

    def _cordon(self, nodes: tuple[str, ...], now: float) -> tuple[str, ...]:
        window, cordon = self.policy.cordon_window_seconds, []
        for node in dict.fromkeys(nodes):
            times = [t for t in self.named.get(node, []) if now - t <= window] + [now]
            self.named[node] = times
            if len(times) >= 2:
                cordon.append(node)
        return tuple(cordon)

    # ----------------------------------------------------------------------------- persistence
    def state_dict(self) -> dict[str, Any]:
        return {"pending": self.pending, "named": self.named, "mismatched": self.mismatched}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pending, self.named = state.get("pending"), dict(state.get("named") or {})
        self.mismatched = list(state.get("mismatched") or [])


# ------------------------------------------------------------------------------ the TLS record
def hex64(value: int) -> str:
    """An int64 fingerprint as 16 hex digits (unsigned): how logs and manifests spell it."""
    return f"{value & MASK64:016x}"


def from_hex(text: str) -> int:
    value = int(text, 16)
    return value - (1 << 64) if value >= 1 << 63 else value


def check_fields(check: ReplicaCheck) -> dict[str, Any]:
    """The `replica_check` event: one value when the replicas agree, every rank's when they do not."""
    fields: dict[str, Any] = {"replicas": len(check.weights), "clock": check.timestamp}
    for name, values in ((WEIGHTS, check.weights), (GRADIENTS, check.gradients)):
        if values:
            fields[name] = hex64(values[0]) if agree(values) else [hex64(v) for v in values]
    if check.recomputed:
        fields["recomputed"] = [hex64(v) for v in check.recomputed]
    if not agree(check.weights) or not agree(check.gradients):
        fields["nodes"] = list(check.nodes)
    return fields


def check_from_event(event: dict[str, Any], step: int, timestamp: float) -> ReplicaCheck:
    """The ReplicaCheck a `replica_check` event recorded (check_fields read back); `timestamp` stands in
    for the check's clock (rank 0's) when the event has none."""
    replicas = int(event["replicas"])

    def values(name: str) -> tuple[int, ...]:
        raw = event.get(name)
        if raw is None:
            return ()
        return tuple(from_hex(v) for v in ([raw] * replicas if isinstance(raw, str) else raw))

    return ReplicaCheck(step, float(event.get("clock", timestamp)), values(WEIGHTS), values(GRADIENTS),
                        values("recomputed"),
                        tuple(event.get("nodes") or ()))


def replay(records: Iterable[dict[str, Any]], policy: ReplicaPolicy | None = None) -> Iterator[ReplicaVerdict]:
    """The verdicts a run took, from its TLS records: the lead rank's `replica_check` events, in order,
    through a fresh monitor (every rank records the same gathered fingerprints; one rank's suffice).
    `records`: decoded TLS records (timestamps as Unix seconds), any mix of ranks, in file order."""
    monitor, lead = ReplicaMonitor(policy), None
    for record in records:
        event = record.get("event")
        if not isinstance(event, dict) or event.get("type") != event_types.REPLICA_CHECK:
            continue
        rank = record.get("rank", 0)
        lead = rank if lead is None else min(lead, rank)
        if rank != lead:
            continue
        verdict = monitor.observe(check_from_event(event, int(event.get("step", record.get("step", 0))),
                                                   float(record["timestamp"])))
        if verdict is not None:
            yield verdict


def _spell(values: tuple[int, ...]) -> str:
    return ", ".join(f"rank {r} {hex64(v)}" for r, v in enumerate(values))


def _ranks(ranks: tuple[int, ...]) -> str:
    return ", ".join(map(str, ranks))
