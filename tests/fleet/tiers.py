"""Shard and global Prometheus servers as docs/scale.md deploys them: shards scrape the agents and record
fleet-shard.rules.yml, and remote-write their per-node records to a global Prometheus (its remote-write
receiver on) that evaluates fleet-global.rules.yml."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from trainguard.alerts import rules

from tests.servers import Server, start_prometheus
from trainguard.policy import Policy


def remote_write_to(global_url: str) -> dict:
    """A shard's remote_write section: only what the global tier reads (rules.GLOBAL_FEED)."""
    return {"url": f"{global_url}/api/v1/write",
            "write_relabel_configs": [{"source_labels": ["__name__"], "regex": "|".join(rules.GLOBAL_FEED),
                                       "action": "keep"}],
            "queue_config": {"batch_send_deadline": "1s", "min_backoff": "100ms", "max_backoff": "1s"}}


def start_global(tmp: Path, policy: Policy, alertmanager_url: str | None = None) -> Server:
    files = rules.write(tmp / "global-rules", policy, rules.FLEET_CONCERNS[1:])
    files += rules.write(tmp / "global-rules", policy, (rules.cost, rules.meta))
    return start_prometheus(tmp, {}, rule_files=files, alertmanager_url=alertmanager_url,
                            extra_args=["--web.enable-remote-write-receiver"])


def start_shard(tmp: Path, index: int, targets: Sequence[str], global_url: str, policy: Policy,
                node_rules: bool = False) -> Server:
    concerns = rules.FLEET_CONCERNS[:1] + (rules.CONCERNS if node_rules else ())
    files = rules.write(tmp / f"shard-{index}-rules", policy, concerns)
    return start_prometheus(tmp, list(targets), rule_files=files,
                            extra_config={"global": {"external_labels": {"shard": str(index)}},
                                          "remote_write": [remote_write_to(global_url)]})
