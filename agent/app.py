"""The agent's composition root: every part of `trainguard agent` built from its config, in one place.

    config ─► Agent          the collector runners, each collector's Context, the /metrics registry
          ─► AgentServer    /metrics, /healthz (and the webhook's route, below)
          ─► NodeLog        RUN/tls/node-<node>.jsonl, from the collectors' TLS fragments
          ─► NodeRiskWatch  the same fragments through decide/node_risk.py: /metrics, and a flag drains the
                              node at the next checkpoint (with a run directory)
          ─► Actions        with a run directory: the policy, the ledger and the executor
                              (RUN/control, the action records), the webhook POST /api/v1/alerts, and
                              with `webhook.embedded` the embedded path: the training collector's cost
                              decisions into the executor, the stall watchdog and its investigator

agent/cli.py parses the flags and the config file and calls `build` then `App.run`. Nothing is optional
by import: every part named here is part of the agent; a part without what it needs (no run directory)
is left out with one log line. Collectors reach the rest only through their `Context`
(agent/collector.py): `on_decision` is how the training collector's cost tiers reach the handlers added here.
"""

from __future__ import annotations

import functools
import signal
import threading
import time
from dataclasses import dataclass, field, replace

from trainguard import log as tglog
from trainguard import policy as policy_mod
from trainguard.agent import actions_embedded, procfs
from trainguard.agent import executor as executor_mod
from trainguard.agent.action_log import ActionLog
from trainguard.agent import coexist as coexist_mod
from trainguard.agent.coexist import Coexistence
from trainguard.agent.config import AgentConfig, ConfigError
from trainguard.agent.culprit import Investigator
from trainguard.agent.discovery import Discovery
from trainguard.agent.executor import Executor, WebhookSettings
from trainguard.agent import evict
from trainguard.agent.action_log import request_id
from trainguard.agent.node_risk import Drain, NodeRiskWatch
from trainguard.agent.nodelog import NodeLog
from trainguard.agent.runner import Agent
from trainguard.agent.server import AgentServer
from trainguard.agent.webhook import PATH, Webhook, load_token
from trainguard.metrics.families import Spec
from trainguard.node import node_name


class CannotListen(Exception):
    """The listen address cannot be bound (taken, or not this host's)."""


@dataclass
class Actions:
    """What acts on the run: the executor behind the webhook and, when embedded, the watchdog."""

    executor: Executor
    webhook: Webhook
    watchdog: actions_embedded.StallWatchdog | None = None


@dataclass
class App:
    config: AgentConfig
    agent: Agent
    server: AgentServer
    nodelog: NodeLog | None = None
    actions: Actions | None = None
    log: object = field(default=None, repr=False)
    discovery: Discovery | None = None       # --runs-root: the run followed changes as runs come and go
    coexist: Coexistence | None = None       # peer exporters whose families /metrics leaves out
    node_risk: NodeRiskWatch | None = None   # this node's hardware risk (decide/node_risk.py)

    def run(self, stop: threading.Event | None = None) -> int:
        """Serve until SIGTERM/SIGINT (or `stop` is set); returns the exit status."""
        stop = stop or threading.Event()
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, lambda *_: stop.set())
        self.agent.start()
        self.server.start()
        if self.nodelog:
            self.nodelog.start()
        if self.node_risk:
            self.node_risk.start()
        next_look = time.monotonic()
        while not stop.wait(self.agent.check_interval):
            self.agent.check()   # logs a collector that has just hung
            if self.coexist is not None:
                self.coexist.refresh()
            if self.discovery is not None and time.monotonic() >= next_look:
                next_look = time.monotonic() + self.config.discovery.interval
                self.follow(self.discovery.poll())
        self.log.info("stopping")
        self.server.stop()
        self._stop_run_parts()
        self.log.info("stopped")
        return 0

    def follow(self, run_dir) -> None:
        """Rebuild what belongs to a run (the collectors' contexts, the node log, the executor and its
        webhook route) for `run_dir` (None: none); the HTTP server, its port and its scrapers stay."""
        if run_dir == self.config.run_dir:
            return
        self.log.info("run followed changes", run_dir=str(run_dir) if run_dir else None,
                      was=str(self.config.run_dir) if self.config.run_dir else None)
        self._stop_run_parts()
        self.server.remove_route("POST", PATH)
        self.config = replace(self.config, run_dir=run_dir)
        self.agent = build_agent(self.config, self.discovery, self.coexist)
        self.server.agent = self.agent
        self.nodelog = build_nodelog(self.config, self.agent)
        try:
            self.actions = build_actions(self.config, self.agent, self.server)
        except SystemExit:       # a bad policy in this run: it is logged; the run is watched, not acted on
            self.actions = None
        self.node_risk = build_node_risk(self.config, self.agent, self.actions)
        self.agent.start()
        if self.nodelog:
            self.nodelog.start()
        if self.node_risk:
            self.node_risk.start()

    def _stop_run_parts(self) -> None:
        if self.actions and self.actions.watchdog:
            self.actions.watchdog.stop()
        if self.nodelog:
            self.nodelog.stop()
        if self.node_risk:
            self.node_risk.stop()
        self.agent.stop()


def build(config: AgentConfig) -> App:
    """Every part, wired. `CannotListen` when the address is taken; SystemExit(2) on a bad webhook setting."""
    discovery = None
    if config.runs_root is not None:
        discovery = Discovery(config.runs_root, config.node, end_grace_seconds=config.discovery.end_grace_seconds)
        config = replace(config, run_dir=discovery.poll())
    coexist = Coexistence(config.coexist, coexist_mod.peers(dict(config.coexist_addresses)))
    coexist.refresh()          # before the first scrape: a peer found now is never exported twice
    try:
        agent = build_agent(config, discovery, coexist)   # chooses the policy: its own, or the run's signed one
    except policy_mod.PolicyError as exc:
        tglog.get("agent", node=config.node).error(f"bad configuration: {exc}")
        raise SystemExit(2) from None
    host, port = config.listen_address
    try:
        server = AgentServer(agent, host, port, max_body_bytes=config.http.max_body_bytes,
                             max_connections=config.http.max_connections,
                             request_timeout=config.http.request_timeout)
    except OSError as exc:
        raise CannotListen(f"cannot listen on {config.listen}: {exc.strerror or exc}") from None
    try:
        actions = build_actions(config, agent, server)
        return App(config, agent, server, nodelog=build_nodelog(config, agent), actions=actions,
                   log=tglog.get("agent", node=config.node), discovery=discovery, coexist=coexist,
                   node_risk=build_node_risk(config, agent, actions))
    except BaseException:
        server.stop()
        raise


def build_agent(config: AgentConfig, discovery: Discovery | None = None,
                coexist: Coexistence | None = None) -> Agent:
    """The collectors of `config`'s run, and what /metrics and /healthz say about its ranks and discovery."""
    agent = Agent(config, coexist=coexist)
    if coexist is not None:
        agent.add_metrics_source(coexist.families)
        agent.add_health_source("coexist", coexist.status)
    if config.run_dir is not None:
        build_pod_ranks(config, agent)
    if discovery is not None:
        agent.add_health_source("discovery", discovery.status)
        agent.add_metrics_source(lambda: [FOLLOWING.value(1 if discovery.current else 0)])
    return agent


FOLLOWING = Spec("gauge", "trainguard_discovery_following_run",
                 "1 when the agent follows a run found under its runs root (--runs-root), 0 when none runs here.", [])


def build_pod_ranks(config: AgentConfig, agent: Agent) -> None:
    """Ranks in pods matched to this node (agent/procfs.py PidNamespaces), and the ranks of no known node,
    on /metrics and /healthz ("ranks"); the collectors and restore share the same matcher."""
    matcher = procfs.pid_namespaces(config.run_dir, config.node)
    agent.add_metrics_source(matcher.families)
    agent.add_health_source("ranks", matcher.status)


def build_nodelog(config: AgentConfig, agent: Agent) -> NodeLog | None:
    if config.run_dir is None or not config.nodelog.enabled:
        return None
    nodelog = NodeLog(agent.tls_fragments, config.run_dir, config.node, interval=config.nodelog.interval,
                      max_bytes=config.nodelog.max_bytes, keep=config.nodelog.keep)
    agent.add_metrics_source(nodelog.families)
    return nodelog


def build_node_risk(config: AgentConfig, agent: Agent, actions: Actions | None) -> NodeRiskWatch:
    """This node's risk rule at the node log's pace, on /metrics. With a run directory to act on, a flag
    drains the node at the next checkpoint through the executor (its ledger, its shadow gate), and the
    circuit breaker counts the node-risk cordons other agents signed in the last hour."""
    on_flag = known_flags = None
    if actions is not None:
        executor = actions.executor
        on_flag = Drain(config.run_dir, node_name(), executor.submit, request_id,
                        key_file=executor.node_actions.checkpoint_key_file)

        def known_flags() -> list[float]:
            found = evict.cordoned(config.run_dir, executor.node_actions.checkpoint_key_file)
            return [float(r.get("cordoned_at", 0.0)) for r in found.values() if r.get("reason") == "node_risk"]
    watch = NodeRiskWatch(agent.tls_fragments, config.node, agent.policy_choice.policy.node_risk,
                          interval=config.nodelog.interval, on_flag=on_flag, known_flags=known_flags)
    agent.add_metrics_source(watch.families)
    return watch


def build_actions(config: AgentConfig, agent: Agent, server: AgentServer) -> Actions | None:
    """The executor, the webhook's route and (with `webhook.embedded`) the embedded path."""
    log = tglog.get("agent.webhook", node=config.node)
    if config.run_dir is None:
        log.warning("no run directory (--run-dir): nothing to act on; /api/v1/alerts not served")
        return None
    try:
        settings = WebhookSettings.from_config(config)
        policy = agent.policy_choice.policy     # its own config, or the run's signed policy (agent/runner.py)
        if settings.shadow:      # --shadow (or webhook.shadow) over the policy's actions.mode
            policy = policy_mod.in_shadow(policy)
    except ConfigError as exc:
        log.error(f"bad configuration: {exc}")
        raise SystemExit(2) from None
    try:
        token = load_token(settings.token_file, create=settings.token_file == settings.default_token_file)
    except (OSError, ValueError) as exc:
        log.error(f"bad configuration: webhook.token_file: {exc}")
        raise SystemExit(2) from None
    # In order, each part given what it needs: the actions log, the Investigator that records into it, then
    # the executor, which recovers from the log at once (a restore decided before a restart gathers its
    # evidence again through the Investigator), then the routes that submit to it.
    records = executor_mod.actions_log(config.run_dir, config.node, settings.checkpoint_key_file)
    investigator = build_investigator(config, agent, policy, settings, records, token)
    executor = Executor.for_agent(config, policy, settings, claim_secret=token,   # the token signs job-level claims
                                  investigator=investigator, records=records)
    webhook = Webhook(token, executor, min(settings.max_body_bytes, server.max_body_bytes))
    server.add_route("POST", PATH, webhook.route)
    agent.add_metrics_source(lambda: [*webhook.families(), *executor.families()])
    log.info("webhook ready", path=PATH, token_file=str(settings.token_file), shadow=policy.shadow,
             embedded=settings.embedded)
    actions = Actions(executor, webhook)
    if settings.embedded:
        actions.watchdog = build_embedded(config, agent, executor, investigator, policy)
    return actions


def build_investigator(config: AgentConfig, agent: Agent, policy: policy_mod.Policy, settings: WebhookSettings,
                       records: ActionLog, token: bytes) -> Investigator:
    """The agent's one Investigator (agent/culprit.py): the watchdog's stalls and the executor's
    Alertmanager restores both gather an incident's evidence through it before anything is ended."""
    investigator = Investigator(config.run_dir, node_name(), policy.restore, agent=agent,
                                record=records.append, entry_points=settings.restore_entry_points,
                                launchers=settings.restore_launchers, key_file=settings.checkpoint_key_file,
                                claim_secret=token)   # signs who leads an incident
    agent.add_metrics_source(investigator.families)
    return investigator


def build_embedded(config: AgentConfig, agent: Agent, executor: Executor, investigator: Investigator,
                   policy: policy_mod.Policy) -> actions_embedded.StallWatchdog:
    """The embedded path: cost tiers into the executor, the stall watchdog (started) and its investigator
    (not in shadow: naming a culprit may keep its node out and end its launcher; the restore the watchdog
    decides is recorded as a `shadow_action` by the executor). Ranks that outlive their culprit's eviction
    are restored through the executor (the Investigator's fallback)."""
    agent.add_decision_handler(actions_embedded.DecisionHandler(executor.submit))
    investigate = functools.partial(investigator, fallback=lambda notice: executor.submit([notice]))
    watchdog = actions_embedded.StallWatchdog(config.run_dir, policy.alerts.stall_seconds, executor.submit,
                                              startup_grace_seconds=policy.alerts.startup_grace_seconds,
                                              investigate=None if policy.shadow else investigate).start()
    tglog.get("agent.embedded", node=config.node).info(
        "embedded actions on", cost="training collector's meter", stall_seconds=policy.alerts.stall_seconds,
        evict=policy.restore.evict)
    return watchdog


