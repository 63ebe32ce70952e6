"""A stall's incident, across nodes: gather, decide the culprit, keep it out (or restore in place).

Every node's agent decides the stall on its own (agent/actions_embedded.py) and all of them meet in one
incident, in the run directory they share:

1. **Claim.** The incident of a stall is keyed by the run's last step and launcher attempt
   (``RUN/incidents/.claims/<key>``, created exclusively): the first agent names the incident, the others
   find its id there. The claimer decides the verdict.
2. **Evidence.** Each agent writes its node's evidence (agent/evidence.py) before anything is ended.
3. **Verdict.** The claimer waits for every node's evidence (or the policy's ``evidence_seconds``),
   decides (trainguard/decide/culprit.py: the culprit; ``eviction``: keep it out or restore), writes
   ``incident.json``, a ``culprit`` TLS event, and the culprit node's cordon when it is kept out.
4. **Act.** Every agent reads the verdict: with an eviction, the culprit's agent ends its launcher
   (proven, agent/evict.py) and the others end nothing (their ranks fail as their peers go, and their
   launchers re-form the job); otherwise the usual restore ends each node's ranks.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from trainguard import rundir
from trainguard import incidents
from trainguard import log as tglog
from trainguard.agent import evict, evidence, restore
from trainguard.agent.actions_embedded import last_step
from trainguard.decide import culprit as verdicts
from trainguard.decide.ledger import Notice
from trainguard.policy import RestorePolicy
from trainguard import tls

CLAIMS = ".claims"
FALLBACK_RESTORE_SECONDS = 60.0   # ranks of a healthy node still alive this long after an eviction: restore


class Investigator:
    """Called by the stall watchdog with the restore notice; returns the notice to submit, or None."""

    def __init__(self, run_dir: str | Path, host: str, policy: RestorePolicy, *, agent=None,
                 record: Callable[[list[dict]], object] | None = None,
                 submit: Callable[[list[Notice]], object] | None = None,
                 entry_points: tuple[str, ...] = (), launchers: tuple[str, ...] = (),
                 key_file: str | Path | None = None):
        self.run_dir, self.host, self.policy = Path(run_dir), host, policy
        self.key_file = key_file          # the run's checkpoint key: signs cordons (trainguard/cordon.py)
        self.entry_points, self.launchers = entry_points, launchers   # what the restore trusts, as the executor
        self.agent, self.record, self.submit = agent, record, submit
        self.log = tglog.get("agent.culprit", node=host)
        self.verdicts: dict[tuple[str, str], int] = {}    # (node, kind) -> count, for the metric

    def __call__(self, notice: Notice, live: list, fallback: Callable[[Notice], object] | None = None) -> Notice | None:
        """`fallback(notice)` restores this node's ranks if they outlive the culprit's eviction (default:
        submit the notice; the executor's own restore after evidence passes its verdict's)."""
        try:
            return self.investigate(notice, live, fallback)
        except Exception as exc:        # never let a failed investigation keep the run hung
            self.log.error("investigation failed; restoring in place", error=f"{type(exc).__name__}: {exc}")
            return notice

    def investigate(self, notice: Notice, live: list, fallback: Callable[[Notice], object] | None = None) -> Notice | None:
        incident_id, leader = claim(self.run_dir, stall_key(self.run_dir))
        self.log.warning("stall: gathering evidence", incident=incident_id, leader=leader)
        summary = evidence.gather(self.run_dir, incident_id, self.host, live, self.agent,
                                  wait_seconds=self.policy.evidence_seconds)
        self.log.info("evidence written", incident=incident_id, **summary)
        if leader:
            self.decide(incident_id, notice)
        decided = wait_for_verdict(self.run_dir, incident_id, 2 * self.policy.evidence_seconds + 15)
        if decided is None:
            self.log.error("no verdict in time; restoring in place", incident=incident_id)
            return notice
        return self.act(decided, notice, live, fallback)

    # ---------------------------------------------------------------------------------- deciding
    def decide(self, incident_id: str, notice: Notice) -> dict:
        hosts = job_hosts(self.run_dir, self.key_file)
        wait_for_nodes(self.run_dir, incident_id, hosts, self.policy.evidence_seconds + 5)
        ranks, nodes = evidence.load(self.run_dir, incident_id)
        verdict = verdicts.decide(ranks, nodes)
        action, why = verdicts.eviction(verdict, job(self.run_dir, hosts, self.key_file), self.policy.evict,
                                        self.policy.max_evictions_per_hour)
        incident = incidents.Incident(
            id=incident_id, kind="hang", detected_at=time.time(), detected_by=f"agent:{self.host}",
            culprit=verdict.culprit, confidence=verdict.confidence, reasons=verdict.reasons + [why],
            action=action, extra={"stall": notice.reason, "nodes": sorted(hosts)})
        incidents.write_incident(self.run_dir, incident)
        if action == verdicts.EVICT:
            try:
                evict.cordon(self.run_dir, verdict.node, incident=incident_id, reason=why, by=f"agent:{self.host}",
                             key_file=self.key_file)
            except evict.CannotCordon as exc:   # the launcher is still ended; it could join again if restarted
                self.log.error(str(exc), incident=incident_id)
        self._record_culprit(incident)
        self.log.warning("verdict", incident=incident_id, culprit=verdict.culprit, action=action,
                         confidence=verdict.confidence, reasons=incident.reasons)
        return incident.to_json()

    def _record_culprit(self, incident: incidents.Incident) -> None:
        culprit = incident.culprit or {}
        key = (str(culprit.get("node") or ""), incident.kind)
        self.verdicts[key] = self.verdicts.get(key, 0) + 1
        if self.record is None:
            return
        event = {"type": "culprit", "incident": incident.id, "rank": culprit.get("rank"),
                 "node": culprit.get("node"), "kind": incident.kind, "confidence": incident.confidence,
                 "reasons": incident.reasons, "action": incident.action}
        self.record([{**tls.make_record(timestamp=incident.detected_at, event=event), "node": self.host}])

    # ------------------------------------------------------------------------------------ acting
    def act(self, decided: dict, notice: Notice, live: list,
            fallback: Callable[[Notice], object] | None = None) -> Notice | None:
        if decided.get("action") != verdicts.EVICT:
            return notice
        node = (decided.get("culprit") or {}).get("node")
        if node == self.host:
            trust = restore.Trust.for_run(self.run_dir, self.entry_points, self.launchers)
            result = evict.end_launcher(self.run_dir, self.host, trust=trust)
            self.log.warning("this node is the culprit: launcher ended", incident=decided["id"], **result)
            if not result["launchers_ended"]:
                return notice       # no provable launcher: end the ranks at least (the node stays cordoned)
            return None
        self._fallback(notice, live, fallback)
        return None

    def _fallback(self, notice: Notice, live: list, restore_here: Callable[[Notice], object] | None = None) -> None:
        """The culprit's node is being kept out: our ranks should fail with it. If they are still alive
        after FALLBACK_RESTORE_SECONDS, restore them after all."""
        pids = {(info.rank, info.pid) for info in live}

        def check() -> None:
            alive = {(info.rank, info.pid) for info, _ in restore.local_ranks(restore.read_ranks(self.run_dir)[0],
                                                                              self.host)}
            act = restore_here or (None if self.submit is None else lambda n: self.submit([n]))
            if pids & alive and act is not None:
                self.log.warning("ranks outlived the culprit's eviction; restoring them", ranks=sorted(pids & alive))
                act(notice)
        timer = threading.Timer(FALLBACK_RESTORE_SECONDS, check)
        timer.daemon = True
        timer.start()

    # ----------------------------------------------------------------------------------- metrics
    def families(self) -> list:
        counts = CounterMetricFamily("trainguard_culprit_verdicts", "Culprit verdicts this agent decided, by "
                                     "the culprit's node (empty: no culprit) and kind.", labels=["node", "kind"])
        for (node, kind), count in sorted(self.verdicts.items()):
            counts.add_metric([node, kind], count)
        cordoned = GaugeMetricFamily("trainguard_node_cordoned", "1 for each node kept out of the job "
                                     "(RUN/control/cordon/<host>) until `trainguard uncordon`.", labels=["node"])
        refused = GaugeMetricFamily("trainguard_cordon_refused", "1 for each cordon file that is not honoured "
                                    "(not signed with the run's checkpoint key, changed, or copied from another "
                                    "host's): the node is NOT kept out (trainguard/cordon.py).",
                                    labels=["node", "reason"])
        for host, found in sorted(evict.cordons(self.run_dir, self.key_file).items()):
            if found.honoured:
                cordoned.add_metric([host], 1)
            else:
                refused.add_metric([host, str(found.refused)], 1)
        return [counts, cordoned, refused]


# ------------------------------------------------------------------------------- shared run directory

def stall_key(run_dir: Path) -> str:
    """The same on every node for one stall: the run's newest step and launcher attempt."""
    infos, _ = restore.read_ranks(run_dir)
    steps = [last_step(rundir.rank_log(run_dir, info.rank))[0] for info in infos]
    attempt = max((_restart_count(info) for info in infos), default=0)
    newest = max((s for s in steps if s is not None), default=0)
    return f"step{newest}-attempt{attempt}"


def _restart_count(info: restore.RankInfo) -> int:
    try:
        return int(json.loads(info.path.read_text()).get("restart_count") or 0)
    except (OSError, ValueError, TypeError):
        return 0


def claim(run_dir: Path, key: str) -> tuple[str, bool]:
    """(incident id, whether this agent made it) for the stall `key`."""
    directory = incidents.incidents_dir(run_dir) / CLAIMS
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / key
    incident_id = incidents.new_id("hang")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:      # the claimer writes the id right after creating the file
            text = path.read_text().strip()
            if text:
                return incidents.check_id(text), False
            time.sleep(0.05)
        raise incidents.IncidentError(f"{path}: claimed but empty") from None
    try:
        os.write(fd, incident_id.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return incident_id, True


def job_hosts(run_dir: Path, key_file: str | Path | None = None) -> set[str]:
    """The nodes of the job's current attempt (the hosts of the newest attempt's rank files), not cordoned."""
    infos, _ = restore.read_ranks(run_dir)
    if not infos:
        return set()
    attempt = max(_restart_count(i) for i in infos)
    hosts = {i.host for i in infos if _restart_count(i) == attempt}
    return hosts - set(evict.cordoned(run_dir, key_file))


def job(run_dir: Path, hosts: set[str], key_file: str | Path | None = None) -> verdicts.Job:
    launchers = evict.read_launchers(run_dir)
    bounds = [(int(launchers[h].get("min_nodes", 1)), int(launchers[h].get("max_nodes", 1)))
              for h in hosts if h in launchers]
    min_nodes = min((lo for lo, _ in bounds), default=len(hosts))
    max_nodes = max((hi for _, hi in bounds), default=len(hosts))
    return verdicts.Job(tuple(sorted(hosts)), min_nodes, max_nodes,
                        evict.evictions_since(run_dir, time.time() - 3600, key_file))


def wait_for_nodes(run_dir: Path, incident_id: str, hosts: set[str], seconds: float) -> set[str]:
    directory = incidents.incidents_dir(run_dir) / incident_id
    deadline = time.monotonic() + seconds
    while True:
        present = {h for h in hosts if (directory / f"node-{h}.json").exists()}
        if present == hosts or time.monotonic() >= deadline:
            return present
        time.sleep(0.2)


def wait_for_verdict(run_dir: Path, incident_id: str, seconds: float) -> dict | None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            return incidents.read(run_dir, incident_id)
        except incidents.IncidentError:
            if time.monotonic() >= deadline:
                return None
        time.sleep(0.2)
