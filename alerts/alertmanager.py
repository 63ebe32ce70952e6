"""The Alertmanager configuration: alerts that carry an `action` label go to the agents' webhooks.

`alerts render` writes trainguard's routes and receivers (`fragment`) to merge into the configuration a
cluster already has; `config` is a whole one (`--standalone`, the demo's stack) in which every alert but
those of severity info (the ones trainguard handles itself) reaches the human receiver. On top of that:

- run-wide actions (rollback, cost_*) go to the *primary* agent, the one beside rank 0, which owns the
  run's control channel. They are grouped per job so one notification carries every tier that fired,
  and the agent's ledger acts on them in tier order (warn, then throttle, then stop);
- `restore` goes to the agent of the node that raised it (matched on `instance`, the address Prometheus
  scrapes the agent at, which is also where its webhook listens), because only that agent can end the
  node's ranks;
- a job-level `restore` (no `instance`: the global tier's JobStalledEverywhere, docs/scale.md) goes to
  every agent through one receiver: whichever agents are up get it, and the first to claim it in the
  shared run directory acts (agent/executor.py), so it is carried out once, whatever node is down.

Alertmanager cannot template a webhook URL, so each agent is a receiver of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainguard import actions
from trainguard.alerts import rules

DEFAULT_AGENT = "127.0.0.1:9655"
DEFAULT_TOKEN_FILE = "/etc/trainguard/webhook.token"
WEBHOOK_PATH = "/api/v1/alerts"
HUMAN = "human"
NOBODY = "nobody"      # the root route's: an alert no route takes (severity info) reaches no one


@dataclass(frozen=True)
class Timing:
    """Notification timing. Defaults suit a real run; tests pass 1s everywhere."""

    group_wait: str = "5s"          # an action should not wait long for company
    group_interval: str = "15s"     # a new tier or alert in a group goes out this soon
    repeat_interval: str = "1h"     # repeats are harmless: the ledger de-duplicates them


def receiver_name(agent: str) -> str:
    return "trainguard-agent-" + agent.replace(":", "-").replace("[", "").replace("]", "")


def _agent_receiver(agent: str, token_file: str) -> dict:
    return {
        "name": receiver_name(agent),
        "webhook_configs": [{
            "url": f"http://{agent}{WEBHOOK_PATH}",
            "send_resolved": True,
            "max_alerts": 0,
            "http_config": {"authorization": {"type": "Bearer", "credentials_file": token_file}},
        }],
    }


JOB_RECEIVER = "trainguard-agents-job"


def _every_agent_receiver(agents: list[str], token_file: str) -> dict:
    """One receiver whose webhooks are every agent's: a job-level action reaches every node."""
    hooks = [hook for agent in dict.fromkeys(agents) for hook in _agent_receiver(agent, token_file)["webhook_configs"]]
    return {"name": JOB_RECEIVER, "webhook_configs": hooks}


def config(agents: list[str] | None = None, token_file: str = DEFAULT_TOKEN_FILE,
           human_webhook: str | None = None, timing: Timing | None = None) -> dict:
    """The Alertmanager configuration as a mapping (see module doc). `agents` are host:port; the first is primary."""
    agents = list(agents or [DEFAULT_AGENT])
    timing = timing or Timing()
    run_wide = "|".join(a for a in actions.REMOTE_ACTIONS if a != actions.RESTORE)
    routes = [{
        "receiver": receiver_name(agents[0]),
        "matchers": [f'action=~"{run_wide}"'],
        "group_by": ["job"],
        "continue": True,
    }]
    for agent in agents:
        routes.append({
            "receiver": receiver_name(agent),
            "matchers": [f'action="{actions.RESTORE}"', f'instance="{agent}"'],
            "group_by": ["alertname", "instance"],
            "continue": True,
        })
    routes.append({
        "receiver": JOB_RECEIVER,
        "matchers": [f'action="{actions.RESTORE}"', 'instance=""'],
        "group_by": ["alertname", "job", "run_id"],
        "continue": True,
    })
    # A route that matched stops the alert reaching the root receiver, so the human gets a route of its own;
    # severity info (LossNaN, LossSpike, GradNormExplosion: actions the guard and the agent take) pages nobody.
    routes.append({"receiver": HUMAN, "matchers": ['severity!="info"']})
    human: dict = {"name": HUMAN}
    if human_webhook:
        human["webhook_configs"] = [{"url": human_webhook, "send_resolved": True}]
    return {
        "route": {
            "receiver": NOBODY,
            "group_by": ["alertname", "job"],
            "group_wait": timing.group_wait,
            "group_interval": timing.group_interval,
            "repeat_interval": timing.repeat_interval,
            "routes": routes,
        },
        "receivers": [{"name": NOBODY}, human] + [_agent_receiver(agent, token_file) for agent in dict.fromkeys(agents)]
                     + [_every_agent_receiver(agents, token_file)],
    }


def fragment(agents: list[str] | None = None, token_file: str = DEFAULT_TOKEN_FILE,
             timing: Timing | None = None) -> dict:
    """trainguard's routes and receivers, to merge into an Alertmanager configuration that exists already:
    its routes go first under the existing `route.routes` (each has `continue: true`, so the routes after
    them still see every alert), its receivers beside the existing ones. No root route, no human receiver:
    who is paged for what stays the configuration's own."""
    whole = config(agents, token_file, None, timing)
    routes = [route for route in whole["route"]["routes"] if route["receiver"] != HUMAN]
    timing = timing or Timing()
    for route in routes:
        route.update(group_wait=timing.group_wait, group_interval=timing.group_interval,
                     repeat_interval=timing.repeat_interval)
    return {"route": {"routes": routes},
            "receivers": [r for r in whole["receivers"] if r["name"] not in (HUMAN, NOBODY)]}


def merge(existing: dict, part: dict) -> dict:
    """`existing` (a whole Alertmanager configuration) with `fragment`'s routes first and its receivers
    added; a receiver or route of trainguard's already there (a second merge) is replaced, not doubled."""
    ours = {r["name"] for r in part["receivers"]}
    merged = dict(existing)
    route = dict(existing.get("route") or {})
    kept = [r for r in route.get("routes") or [] if r.get("receiver") not in ours]
    route["routes"] = [*part["route"]["routes"], *kept]
    merged["route"] = route
    merged["receivers"] = [r for r in existing.get("receivers") or [] if r.get("name") not in ours] + part["receivers"]
    return merged


FRAGMENT_HEADER = """\
# Generated by `trainguard alerts render` from alerts/alertmanager.py: trainguard's routes and receivers, to
# MERGE into your Alertmanager configuration (not a whole file):
#   - put the routes below first under your `route: routes:` (each has `continue: true`: your routes after
#     them still see every alert, and keep deciding who is paged);
#   - add the receivers below to your `receivers:`.
# `trainguard alerts merge --into alertmanager.yml` does both. Alerts with an `action` label reach the agents'
# webhooks; LossNaN, LossSpike and GradNormExplosion are severity info (alerts/mixin.py): they page nobody.
"""


def render_fragment(agents: list[str] | None = None, token_file: str = DEFAULT_TOKEN_FILE,
                    timing: Timing | None = None) -> str:
    return FRAGMENT_HEADER + rules.dump(fragment(agents, token_file, timing))


HEADER = """\
# Generated by `trainguard alerts render` from alerts/alertmanager.py. Do not edit; render your own with
#   trainguard alerts render --agent HOST:PORT [--agent HOST:PORT ...] --token-file FILE [--human-webhook URL]
# The `human` receiver has no integration until you give one (--human-webhook, or add Slack/PagerDuty here).
"""


def render(agents: list[str] | None = None, token_file: str = DEFAULT_TOKEN_FILE,
           human_webhook: str | None = None, timing: Timing | None = None) -> str:
    return HEADER + rules.dump(config(agents, token_file, human_webhook, timing))
