"""A stall's incident, across nodes: gather, decide the culprit, keep it out (or restore in place).

Every node's agent decides the stall on its own (agent/actions_embedded.py) and all of them meet in one
incident, in the run directory they share:

1. **Claim.** The incident of a stall is keyed by the run's last step and launcher attempt: the first
   agent claims ``incident-<key>`` as a job-level claim (agent/claims.py: ``RUN/control/claims/``, signed
   with the job's claim secret, naming its claimant: host, agent pid and start time) with the incident's
   id in it; the others find the id there. The claimant leads: it decides the verdict, and renews its
   claim while it gathers and decides (every ``lead_timeout / 4``).
2. **Evidence.** Each agent writes its node's evidence (agent/evidence.py) before anything is ended.
3. **Verdict.** The leader waits for every node's evidence (or the policy's ``evidence_seconds``),
   decides (trainguard/decide/culprit.py: the culprit; ``eviction``: keep it out or restore), writes
   ``incident.json``, a ``culprit`` TLS event, and the culprit node's cordon when it is kept out.
   **A leader that dies first does not leave the incident without a verdict:** restarted, its agent finds
   its own claim and leads again; otherwise, once the claim is neither renewed nor done for
   ``lead_timeout`` (the policy's ``evidence_seconds``) as a waiting agent sees it, exactly one waiting
   agent takes it over (the next generation's claim, trainguard/decide/leader.py) and decides from the
   evidence on disk. A forged or copied claim is no claim: it neither stops the verdict nor points the
   agents at another incident.
4. **Act.** Every agent reads the verdict: with an eviction, the culprit's agent ends its launcher
   (proven, agent/evict.py) and the others end nothing (their ranks fail as their peers go, and their
   launchers re-form the job); otherwise the usual restore ends each node's ranks.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from trainguard import actions, event_types, rundir, safe_read, spares
from trainguard import incidents
from trainguard import log as tglog
from trainguard.agent import claims, evict, evidence, restore
from trainguard.agent.actions_embedded import last_step
from trainguard.decide import culprit as verdicts
from trainguard.decide.ledger import Notice
from trainguard.policy import RestorePolicy
from trainguard.runtime import cordon_key
from trainguard.runtime.checkpoint import keys
from trainguard import signed, tls

CLAIMS = ".claims"    # without a claim secret: RUN/incidents/.claims/<key>, unsigned (nothing to prove it with)
MIN_LEAD_TIMEOUT = 1.0
FALLBACK_RESTORE_SECONDS = 60.0   # ranks of a healthy node still alive this long after an eviction: restore


class Investigator:
    """Called by the stall watchdog with the restore notice; returns the notice to submit, or None."""

    def __init__(self, run_dir: str | Path, host: str, policy: RestorePolicy, *, agent=None,
                 record: Callable[[list[dict]], object] | None = None,
                 entry_points: tuple[str, ...] = (), launchers: tuple[str, ...] = (),
                 key_file: str | Path | None = None, claim_secret: bytes | None = None,
                 lead_timeout: float | None = None):
        self.run_dir, self.host, self.policy = Path(run_dir), host, policy
        self.key_file = key_file          # the run's checkpoint key: signs cordons (trainguard/cordon/__init__.py)
        self.entry_points, self.launchers = entry_points, launchers   # what the restore trusts, as the executor
        self.agent, self.record = agent, record
        self.log = tglog.get("agent.culprit", node=host)
        # Who leads an incident: a signed job-level claim, taken over when its claimant stops renewing it
        # for as long as gathering evidence may take (the job's webhook token signs it, as the executor's).
        self.claims = claims.Claims(self.run_dir, host, claim_secret, log=self.log, timeout_seconds=max(
            MIN_LEAD_TIMEOUT, policy.evidence_seconds if lead_timeout is None else lead_timeout))
        self.verdicts: dict[tuple[str, str], int] = {}    # (node, kind) -> count, for the metric
        self.evidence_refused: dict[str, int] = {}         # evidence files ignored by the verdict, by reason
        self.verdicts_refused: dict[str, str] = {}         # incident -> why its incident.json was not acted on

    def __call__(self, notice: Notice, live: list, fallback: Callable[[Notice], object] | None = None) -> Notice | None:
        """`fallback(notice)` restores this node's ranks if they outlive the culprit's eviction (default:
        nothing: the agent gives its executor's submit; the executor's own restore after evidence passes its
        verdict's)."""
        try:
            return self.investigate(notice, live, fallback)
        except Exception as exc:        # never let a failed investigation keep the run hung
            self.log.error("investigation failed; restoring in place", error=f"{type(exc).__name__}: {exc}")
            return notice

    def investigate(self, notice: Notice, live: list, fallback: Callable[[Notice], object] | None = None) -> Notice | None:
        key = stall_key(self.run_dir)
        incident_id, hold = self.lead(key)
        self.log.warning("stall: gathering evidence", incident=incident_id, leader=hold is not None)
        summary = evidence.gather(self.run_dir, incident_id, self.host, live, self.agent,
                                  wait_seconds=self.policy.evidence_seconds, key_file=self.key_file)
        self.log.info("evidence written", incident=incident_id, **summary)
        decided = self.verdict(key, incident_id, hold, notice)
        if decided is None:
            self.log.error("no verdict in time; restoring in place", incident=incident_id)
            return notice
        return self.act(decided, notice, live, fallback)

    # ----------------------------------------------------------------------------------- leading
    def lead(self, key: str) -> tuple[str, claims.Hold | None]:
        """(the incident id of the stall `key`, this agent's renewed claim when it leads, else None)."""
        if self.claims.secret is None:
            incident_id, leader = claim(self.run_dir, key)
            return incident_id, (self.claims.hold(key, claims.Claim(self.host, 0, time.time(), False, True))
                                 if leader else None)
        found = self.claims.take(incident_claim(key), time.time(), {"incident": incidents.new_id("hang")})
        incident_id = incidents.check_id(str(found.fields.get("incident") or ""))   # signed: ours
        return incident_id, self.claims.hold(incident_claim(key), found) if found.mine else None

    def verdict(self, key: str, incident_id: str, hold: claims.Hold | None, notice: Notice) -> dict | None:
        """The incident's verdict: decided here while this agent leads, else the leader's, read once written.
        A waiting agent takes over a leader proven gone (agent/claims.py: not renewed for the timeout)."""
        deadline = time.monotonic() + 2 * self.policy.evidence_seconds + 15 + self.claims.timeout
        while hold is None:
            decided = self.read_verdict(incident_id)
            if decided is not None or time.monotonic() >= deadline:
                return decided
            hold = self._take_over(key, incident_id)
            if hold is None:
                time.sleep(0.2)
        try:
            decided = self.read_verdict(incident_id) or self.decide(incident_id, notice)
        except BaseException:
            hold.stop()          # not renewed from now on: another agent takes over after the timeout
            raise
        hold.done(time.time())
        return decided

    def _take_over(self, key: str, incident_id: str) -> claims.Hold | None:
        if self.claims.secret is None:
            return None          # an unsigned claim proves nothing, so neither does its silence
        found = self.claims.take(incident_claim(key), time.time(), {"incident": incident_id})
        if not found.mine or found.fields.get("incident") != incident_id:
            return None
        self.log.warning("leading an incident whose leader is gone", incident=incident_id,
                         generation=found.generation)
        return self.claims.hold(incident_claim(key), found)

    # ---------------------------------------------------------------------------------- deciding
    def decide(self, incident_id: str, notice: Notice) -> dict:
        hosts = job_hosts(self.run_dir, self.key_file)
        wait_for_nodes(self.run_dir, incident_id, hosts, self.policy.evidence_seconds + 5)
        loaded = evidence.load(self.run_dir, incident_id, cordon_key.signing_key(self.key_file)[0])
        for ignored in loaded.refused:      # a file that does not prove who gathered it decides nothing
            self.evidence_refused[ignored["reason"]] = self.evidence_refused.get(ignored["reason"], 0) + 1
            self.log.error("evidence ignored: " + ignored["why"], incident=incident_id, reason=ignored["reason"])
        verdict = verdicts.decide(loaded.ranks, loaded.nodes)
        action, why = verdicts.eviction(verdict, job(self.run_dir, hosts, self.key_file), self.policy.evict,
                                        self.policy.max_evictions_per_hour)
        incident = incidents.Incident(
            id=incident_id, kind="hang", detected_at=time.time(), detected_by=f"agent:{self.host}",
            culprit=verdict.culprit, confidence=verdict.confidence, reasons=verdict.reasons + [why],
            action=action, extra={"stall": notice.reason, "nodes": sorted(hosts),
                                   **({"evidence_ignored": loaded.refused} if loaded.refused else {})})
        key = cordon_key.signing_key(self.key_file, create=True)[0]
        incidents.write_incident(self.run_dir, incident, key, None if key is None else keys.key_id(key))
        if action == actions.EVICT:
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
        event = {"type": event_types.CULPRIT, "incident": incident.id, "rank": culprit.get("rank"),
                 "node": culprit.get("node"), "kind": incident.kind, "confidence": incident.confidence,
                 "reasons": incident.reasons, "action": incident.action}
        self.record([{**tls.make_record(timestamp=incident.detected_at, event=event), "node": self.host}])

    def read_verdict(self, incident_id: str) -> dict | None:
        """The incident's verdict when it is there and signed with the run's key (a leader's); None otherwise.
        A verdict that does not prove itself ends nobody's launcher: it is named once and counted, and the
        agent waits on (taking over, or restoring in place when no verdict comes)."""
        decided = read_verdict(self.run_dir, incident_id)
        if decided is None:
            return None
        reason = incidents.check_verdict(cordon_key.signing_key(self.key_file)[0], incident_id, decided)
        if reason is None:
            return decided
        if incident_id not in self.verdicts_refused:
            self.verdicts_refused[incident_id] = reason
            self.evidence_refused[reason] = self.evidence_refused.get(reason, 0) + 1
            self.log.error("verdict ignored: " + signed.refusal_message(reason, f"incident {incident_id}'s "
                           "incident.json"), incident=incident_id, reason=reason)
        return None

    # ------------------------------------------------------------------------------------ acting
    def act(self, decided: dict, notice: Notice, live: list,
            fallback: Callable[[Notice], object] | None = None) -> Notice | None:
        if decided.get("action") != actions.EVICT:
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
            alive = {(info.rank, info.pid) for info, _ in restore.local_ranks(restore.host_ranks(self.run_dir,
                                                                                                 self.host)[0],
                                                                              self.host)}   # a pod's, by namespace
            if pids & alive and restore_here is not None:
                self.log.warning("ranks outlived the culprit's eviction; restoring them", ranks=sorted(pids & alive))
                restore_here(notice)
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
                                    "host's): the node is NOT kept out (trainguard/cordon/__init__.py).",
                                    labels=["node", "reason"])
        for host, found in sorted(evict.cordons(self.run_dir, self.key_file).items()):
            if found.honoured:
                cordoned.add_metric([host], 1)
            else:
                refused.add_metric([host, str(found.refused)], 1)
        ignored = CounterMetricFamily("trainguard_evidence_refused", "Incident evidence files (and verdicts) "
                                      "this agent ignored because they do not prove which agent wrote them "
                                      "(unsigned, signed with another key, for another host or incident, or a "
                                      "rank file its node's signed evidence does not vouch for).",
                                      labels=["reason"])
        for reason, count in sorted(self.evidence_refused.items()):
            ignored.add_metric([reason], count)
        return [counts, cordoned, refused, ignored, *self._spare_families()]

    def _spare_families(self) -> list:
        """The hot spares' adverts as the eviction verdict reads them (trainguard/spares.py): one small file
        per spare, so a scrape costs what the spares number, not the job's nodes."""
        waiting = GaugeMetricFamily("trainguard_spares_waiting", "Hot spares waiting to take a kept-out node's "
                                    "place: adverts signed with the run's key, fresh, of a spare neither "
                                    "cordoned nor joining (the eviction verdict also leaves out the places "
                                    "already open).")
        refused = GaugeMetricFamily("trainguard_spare_advert_refused", "1 for each spare advert not counted, "
                                    "and why (unsigned, another key, stale, cordoned, claimed).",
                                    labels=["node", "reason"])
        adverts = spares.read_adverts(self.run_dir, cordon_key.checker(self.key_file), time.time())
        waiting.add_metric([], sum(advert.counted for advert in adverts))
        for advert in adverts:
            if not advert.counted:
                refused.add_metric([advert.host, str(advert.refused)], 1)
        return [waiting, refused]


# ------------------------------------------------------------------------------- shared run directory

def stall_key(run_dir: Path) -> str:
    """The same on every node for one stall: the run's newest step and launcher attempt."""
    infos, _ = restore.read_ranks(run_dir)
    steps = [last_step(rundir.rank_log(run_dir, info.rank))[0] for info in infos]
    attempt = max((restart_count(info) for info in infos), default=0)
    newest = max((s for s in steps if s is not None), default=0)
    return f"step{newest}-attempt{attempt}"


def restart_count(info: restore.RankInfo) -> int:
    try:
        return int(safe_read.read_json(info.path, safe_read.CONTROL_BYTES, "rank registration")
                   .get("restart_count") or 0)
    except (OSError, ValueError, TypeError):
        return 0


def incident_claim(key: str) -> str:
    """The job-level claim's request id of the stall `key`'s incident (agent/claims.py)."""
    return f"incident-{key}"


def claim(run_dir: Path, key: str) -> tuple[str, bool]:
    """(incident id, whether this agent made it) for the stall `key`, where there is no claim secret to
    sign with: an unsigned exclusive file, as before the claims were signed."""
    directory = incidents.incidents_dir(run_dir) / CLAIMS
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / key
    incident_id = incidents.new_id("hang")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:      # the claimer writes the id right after creating the file
            try:
                text = safe_read.read_text(path, safe_read.CONTROL_BYTES, "incident claim", "replace").strip()
            except OSError as exc:      # a FIFO or a device in its place: refused, never waited on
                raise incidents.IncidentError(str(exc)) from None
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
    attempt = max(restart_count(i) for i in infos)
    hosts = {i.host for i in infos if restart_count(i) == attempt}
    return hosts - set(evict.cordoned(run_dir, key_file))


def job(run_dir: Path, hosts: set[str], key_file: str | Path | None = None) -> verdicts.Job:
    """What the eviction verdict respects, with the hot spares that wait to take a kept-out node's place:
    only adverts signed with the run's key, fresh, of a spare neither cordoned nor joining, less the
    places already left to take (trainguard/spares.py). A refused advert is named in the log, never counted."""
    launchers = evict.read_launchers(run_dir)
    bounds = [(int(launchers[h].get("min_nodes", 1)), int(launchers[h].get("max_nodes", 1)))
              for h in hosts if h in launchers]
    min_nodes = min((lo for lo, _ in bounds), default=len(hosts))
    max_nodes = max((hi for _, hi in bounds), default=len(hosts))
    waiting, adverts = spares.available(run_dir, cordon_key.checker(key_file), hosts, time.time())
    for advert in adverts:
        if not advert.counted:
            tglog.get("agent.culprit").warning("hot spare not counted: " + advert.why_refused(),
                                               spare=advert.host, reason=advert.refused)
    return verdicts.Job(tuple(sorted(hosts)), min_nodes, max_nodes,
                        evict.evictions_since(run_dir, time.time() - 3600, key_file), spares=waiting)


def wait_for_nodes(run_dir: Path, incident_id: str, hosts: set[str], seconds: float) -> set[str]:
    directory = incidents.incidents_dir(run_dir) / incident_id
    deadline = time.monotonic() + seconds
    while True:
        present = {h for h in hosts if (directory / f"node-{h}.json").exists()}
        if present == hosts or time.monotonic() >= deadline:
            return present
        time.sleep(0.2)


def read_verdict(run_dir: Path, incident_id: str) -> dict | None:
    try:
        return incidents.read(run_dir, incident_id)
    except incidents.IncidentError:
        return None
