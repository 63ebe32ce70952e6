"""deploy/prometheus/{shard,global}.yml (docs/scale.md) pass `promtool check config` (rule files included)
and the shard's remote write keeps exactly what the global tier reads (alerts/rules.py GLOBAL_FEED)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from trainguard.alerts import rules

from tests.servers import require_binary

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


@pytest.mark.parametrize("name", ["shard.yml", "global.yml"])
def test_promtool_accepts_the_tier_config(name):
    result = subprocess.run([require_binary("promtool"), "check", "config", str(DEPLOY / name)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_shard_feeds_the_global_tier_what_its_rules_read():
    shard = yaml.safe_load((DEPLOY / "shard.yml").read_text())
    [keep] = shard["remote_write"][0]["write_relabel_configs"]
    assert keep["regex"] == "|".join(rules.GLOBAL_FEED) and keep["action"] == "keep"
