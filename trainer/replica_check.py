"""The replica check in a training loop: measure (trainer/fingerprint.py), gather, decide
(trainguard/decide/replica.py), and act — the TLS events, the incident, the cordon file, the rollback.

A loop calls four hooks, all on every rank at the same step (each may run a collective):

    checks.after_backward(step)           # gradients' fingerprint after their all-reduce (device, no sync)
    verdict = checks.after_step(step, now)     # at check steps: weights, one all-gather, the decision
    checks.respond(verdict, restore=..., stop=...)   # when there is a verdict
    meta = checks.before_checkpoint(step, now)       # the manifest's fingerprint; None if replicas differ

The check costs one pass over the parameters and one over the gradients on the device, and one
all-gather of two int64 per rank, every `guard.replica_check_every` steps (docs/sdc.md, bench/bench_sdc.py).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from trainguard import event_types, incidents, rundir, safe_read
from trainguard.actions import CORDON, ROLLBACK, SHADOW_ACTION, STOP, shadow_event
from trainguard.decide.replica import (ARBITRATION, MISMATCH, ReplicaCheck, ReplicaMonitor,
                                       ReplicaPolicy, ReplicaVerdict, agree, check_fields)
from trainguard.trainer import fingerprint as fp

META_KEY = "replica_fingerprint"
DETECTED_BY = "replica_check"


cordon_path = rundir.cordon_path


def incident_id(step: int, when: float) -> str:
    """The same on every rank (rank 0's clock and the step), so every rank's event names it."""
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(when))}-sdc-step{step}"


class ReplicaChecks:
    def __init__(self, params: list[torch.nn.Parameter], names: list[str], *, every: int, world_size: int,
                 rank: int, node: str, run_dir: str | os.PathLike, emit: Callable[..., Any], log: Any,
                 policy: ReplicaPolicy | None = None, key_file: str | os.PathLike | None = None,
                 shadow: bool = False, nodes: tuple[str, ...] | None = None):
        """`shadow`: a mismatch is recorded (its events, its incident) and its rollback, stop and cordons
        are `shadow_action` events, not carried out (the policy's actions.mode). `nodes`: every rank's node,
        known already (a standby in a killed rank's place cannot gather them: the others do not)."""
        self.params, self.names = params, names
        self.shadow = shadow
        self.every, self.world, self.rank = every, world_size, rank
        self.run_dir, self.emit, self.log = Path(run_dir), emit, log
        self.monitor = ReplicaMonitor(policy)
        self.fingerprints = fp.Fingerprinter()
        self.nodes = tuple(nodes) if nodes is not None else gather_nodes(node, world_size)
        # the run's checkpoint key signs the cordons (runtime/cordon_key.py)
        self.records = MismatchRecords(run_dir=self.run_dir, rank=rank, nodes=self.nodes, emit=emit, log=log,
                                       key_file=key_file, shadow=shadow)
        self.step = 0                                 # the step being trained (after_backward's)
        self._grads: tuple[int, torch.Tensor] | None = None   # (step, gradients' fingerprint) to check
        self.checked: int | None = None               # step of the last check, whatever it found
        self.last: tuple[int, int] | None = None      # (step, weights fingerprint) of the last agreed check
        self.refusal: ReplicaVerdict | None = None           # why before_checkpoint said no (acted on next)

    @property
    def enabled(self) -> bool:
        return self.world > 1 and self.every > 0

    def forget(self) -> None:
        """After an in-process restore: the steps to come are trained again, and checked again on every
        rank. A survivor that had checked step 3650 before the failure skipped its check when training 3650
        again while a standby, fresh, did not: one rank in the check's all_gather, the others in the next
        step's collectives (the 30-minute soak's second stop)."""
        self.checked, self._grads, self.refusal = None, None, None

    def due(self, step: int) -> bool:
        return self.enabled and step % self.every == 0

    # ------------------------------------------------------------------------------- measuring
    def after_backward(self, step: int) -> None:
        """Fingerprint the gradients now, after the all-reduce and before the optimizer consumes them."""
        self.step = step
        if self.due(step):
            self._grads = (step, self.fingerprints.fingerprint(fp.gradients(self.params)))

    def _weights(self) -> torch.Tensor:
        return self.fingerprints.fingerprint(self.params)

    def after_step(self, step: int) -> ReplicaVerdict | None:
        """After the optimizer step and the step's record: a verdict to act on, or None. At check steps
        (unless the checkpoint before this already checked it), and any refusal of a checkpoint."""
        if self.refusal is not None:
            verdict, self.refusal = self.refusal, None
            return verdict
        if not self.due(step) or self.checked == step:
            return None
        return self.check(step)

    def check(self, step: int) -> ReplicaVerdict | None:
        """One all-gather of every rank's (weights, gradients, clock) — recorded and decided. Rank 0's
        clock is the check's time on every rank, so their records and incident ids agree."""
        grads = self._grads[1] if self._grads is not None and self._grads[0] == step else None
        self._grads, self.checked = None, step
        weights_fp = self._weights()
        clock = torch.tensor(time.time_ns(), dtype=torch.int64, device=weights_fp.device)
        mine = torch.stack([weights_fp, grads if grads is not None else torch.zeros_like(weights_fp), clock])
        rows = fp.gather(mine, self.world).tolist()
        weights = tuple(row[0] for row in rows)
        gradients = tuple(row[1] for row in rows) if grads is not None else ()
        recomputed, tensors = (), None
        if not agree(weights) or not agree(gradients):
            # measured again (a rank whose answer changes is the unstable one), and per tensor (which
            # parameter differs): collectives every rank reaches, since every rank saw the same rows
            recomputed = tuple(fp.gather(self._weights().reshape(1), self.world).reshape(-1).tolist())
            tensors = fp.gather(self.fingerprints.many(self.params), self.world).tolist()
        check = ReplicaCheck(step, rows[0][2] / 1e9, weights, gradients, recomputed, self.nodes)
        self.emit(event_types.REPLICA_CHECK, step=step, **check_fields(check))
        verdict = self.monitor.observe(check)
        if agree(weights) and (verdict is None or verdict.action is None):
            self.last = (step, weights[0])
        if verdict is not None and tensors is not None:
            verdict.values["params"] = differing_params(tensors, self.names)
        return verdict

    def before_checkpoint(self) -> dict | None:
        """The manifest's meta for a checkpoint of the step just trained: the replicas' agreed weights
        fingerprint (a check of its own unless this step was just checked). None when they differ: the
        save is refused, and the verdict waits in `refusal` for the loop's next `after_step`."""
        step = self.step
        if not self.enabled:
            return {META_KEY: {"step": step, "weights": fp.hex64(int(self._weights())), "replicas": 1}}
        if self.last is None or self.last[0] != step:
            verdict = self.check(step)
            if verdict is not None:
                self.refusal = verdict           # acted on (or, an arbitration, recorded) by after_step
                if verdict.action is not None:
                    return None
        return {META_KEY: {"step": step, "weights": fp.hex64(self.last[1]), "replicas": self.world}}

    # ---------------------------------------------------------------------------------- acting
    def respond(self, verdict: ReplicaVerdict, *, restore: Callable[[], int | None],
                stop: Callable[[dict], Any]) -> Any:
        """Record the verdict everywhere it belongs, then roll back (or stop). Returns what `stop` returned,
        or None when training goes on."""
        ident = incident_id(verdict.step, verdict.timestamp)
        if verdict.kind == ARBITRATION:
            self.records.culprit(verdict, ident)
            return None
        event = {"ranks": list(verdict.ranks), "what": verdict.what, "nodes": list(verdict.nodes),
                 "confidence": verdict.confidence, "reasons": list(verdict.reasons), "incident": ident,
                 "action": verdict.action, "params": verdict.values.get("params", [])}
        self.emit(MISMATCH, step=verdict.step, **event)
        self.log.error("replica mismatch", step=verdict.step, what=verdict.what, ranks=list(verdict.ranks),
                       action=verdict.action, incident=ident)
        self.records.mismatch(verdict, ident)
        if self.shadow:
            self.records.shadow_action(verdict.action or ROLLBACK, verdict, ident)
            return None
        if verdict.action == STOP:
            return stop({"reason": MISMATCH, "incident": ident, **event})
        self.rollback(verdict, ident, restore)
        return None

    def rollback(self, verdict: ReplicaVerdict, ident: str, restore: Callable[[], int | None]) -> None:
        """Every rank to the newest verified checkpoint, then proof that the replicas are one again."""
        from_step = verdict.step
        restored = restore()
        self.last = None
        rows = fp.gather(self._weights().reshape(1), self.world).reshape(-1).tolist()
        expected = recorded_fingerprint(self.run_dir, restored) if restored is not None else None
        identical = agree(tuple(rows))
        matches = expected is not None and identical and fp.hex64(rows[0]) == expected
        self.emit(ROLLBACK, step=from_step, source=DETECTED_BY, reason=MISMATCH, incident=ident,
                  restored_step=restored, replicas_identical=identical, fingerprint=fp.hex64(rows[0]),
                  manifest_fingerprint=expected, fingerprint_matches_manifest=matches,
                  **({} if restored is not None else {"error": "no verified checkpoint to roll back to"}))
        if identical:
            self.last = (restored, rows[0]) if restored is not None else None


class MismatchRecords:
    """What a mismatch leaves behind on rank 0's side: the incident, its fingerprints, the signed cordons,
    and in shadow mode the `shadow_action` events in place of what was not done."""

    def __init__(self, *, run_dir: Path, rank: int, nodes: tuple[str, ...], emit: Callable[..., Any], log: Any,
                 key_file: str | os.PathLike | None, shadow: bool):
        self.run_dir, self.rank, self.nodes = run_dir, rank, nodes
        self.emit, self.log = emit, log
        self.key_file, self.shadow = key_file, shadow

    def mismatch(self, verdict: ReplicaVerdict, ident: str) -> None:
        """Rank 0 writes the incident and cordons the nodes the verdict names."""
        if self.rank == 0:
            self._write_incident(verdict, ident)
            for host in verdict.cordon:
                self._cordon(host, verdict, ident)

    @staticmethod
    def _incident(verdict: ReplicaVerdict, ident: str, when: float) -> incidents.Incident:
        culprit = None
        if len(verdict.ranks) == 1:
            culprit = {"rank": verdict.ranks[0], "node": verdict.nodes[0] if verdict.nodes else None}
        elif verdict.ranks:
            culprit = {"ranks": list(verdict.ranks), "rank": None,
                       "node": verdict.nodes[0] if len(set(verdict.nodes)) == 1 else None}
        return incidents.Incident(
            id=ident, kind="sdc", detected_at=when, detected_by=DETECTED_BY, culprit=culprit,
            confidence=verdict.confidence, reasons=list(verdict.reasons), action=verdict.action or ROLLBACK,
            extra={"step": verdict.step, "what": verdict.what, "ranks": list(verdict.ranks),
                   "cordon": list(verdict.cordon)})

    def _write_incident(self, verdict: ReplicaVerdict, ident: str) -> None:
        from trainguard.runtime import cordon_key
        from trainguard.runtime.checkpoint import keys

        key = cordon_key.signing_key(self.key_file, create=True)[0]   # signed as the agents' verdicts are
        try:
            incidents.write_incident(self.run_dir, self._incident(verdict, ident, time.time()), key,
                                     None if key is None else keys.key_id(key))
            incidents.write_json(self.run_dir, ident, "fingerprints.json",
                                 {"step": verdict.step, "nodes": list(self.nodes), **verdict.values})
        except (OSError, incidents.IncidentError) as exc:   # the rollback matters more than the record
            self.log.error("could not write the incident", incident=ident, error=str(exc))

    def culprit(self, verdict: ReplicaVerdict, ident: str) -> None:
        """A two-replica mismatch arbitrated by the replay: the incident of that mismatch names the rank."""
        for rank, node in zip(verdict.ranks, verdict.nodes):
            self.emit(event_types.CULPRIT, step=verdict.step, incident=ident, rank=rank, node=node, kind="sdc",
                      what=verdict.what, confidence=verdict.confidence, reasons=list(verdict.reasons))
        self.mismatch(verdict, ident)

    def shadow_action(self, action: str, verdict: ReplicaVerdict, ident: str, **evidence: Any) -> None:
        self.emit(SHADOW_ACTION, step=verdict.step, **shadow_event(
            action, MISMATCH, DETECTED_BY, incident=ident, ranks=list(verdict.ranks), what=verdict.what,
            **evidence))
        self.log.warning("shadow: would have acted", action=action, incident=ident, **evidence)

    def _cordon(self, host: str, verdict: ReplicaVerdict, ident: str) -> None:
        """RUN/control/cordon/<host>: kept out of the job until `trainguard uncordon` (the reason inside)."""
        from trainguard.runtime import cordon_key

        if self.shadow:
            self.shadow_action(CORDON, verdict, ident, host=host)
            return
        reason = {"reason": event_types.REPLICA_MISMATCH, "detected_by": DETECTED_BY, "incident": ident,
                  "step": verdict.step, "ranks": list(verdict.ranks), "what": verdict.what, "time": time.time(),
                  "why": list(verdict.reasons), "by": f"rank:{self.rank}"}
        key, where = cordon_key.signing_key(self.key_file, create=True)
        if key is None:
            self.log.error("could not sign the cordon file: no checkpoint key", host=host, error=where)
            return
        try:
            cordon_key.write_cordon(self.run_dir, host, key, self.key_file, **reason)
        except OSError as exc:
            self.log.error("could not write the cordon file", host=host, error=str(exc))
            return
        self.emit(CORDON, step=verdict.step, host=host, incident=ident, reason=event_types.REPLICA_MISMATCH)
        self.log.error("node cordoned: named in a second replica mismatch", host=host, incident=ident)


def gather_nodes(node: str, world: int) -> tuple[str, ...]:
    """Every rank's node, by rank (a collective every rank reaches when the checks are built)."""
    if world == 1:
        return (node,)
    nodes: list = [None] * world
    dist.all_gather_object(nodes, node)
    return tuple(nodes)


def differing_params(tensors: list[list[int]], names: list[str]) -> list[str]:
    """Names of the parameters whose fingerprint is not the same on every rank (first 16)."""
    columns = zip(*tensors)
    return [name for name, column in zip(names, columns) if len(set(column)) > 1][:16]


def recorded_fingerprint(run_dir: Path, step: int) -> str | None:
    """The weights fingerprint the manifest of checkpoint `step` carries (it verified as it loaded)."""
    from trainguard.runtime.checkpoint.manifest import MANIFEST_NAME

    try:
        manifest = safe_read.read_json(rundir.step_dir(run_dir, step) / MANIFEST_NAME,
                                       safe_read.MANIFEST_BYTES, "manifest")
        if not isinstance(manifest, dict):
            return None
    except (OSError, ValueError):
        return None
    return ((manifest.get("meta") or {}).get(META_KEY) or {}).get("weights")
