"""The series budget of one node (docs/scale.md) held against a real agent: 8 GPUs on the fake NVML,
8 HCAs and the disk set of the fixture trees, 8 ranks of step records; and the per-rank switch."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from trainguard.metrics.training import WATCHED_EVENTS

from tests.fleet.agents import scrape, start_node_agent, write_node_ranks
from tests.servers import wait_for

pytestmark = pytest.mark.slow

DOC = Path(__file__).resolve().parents[2] / "docs" / "scale.md"


def budget() -> dict[str, int]:
    """family (or prefix*) -> series per node, from the table after the `budget` marker in docs/scale.md."""
    text = DOC.read_text().split("<!-- budget:", 1)[1]
    rows = re.findall(r"^\| (\S+) \| (\d+) \|", text, re.MULTILINE)
    assert rows, f"{DOC}: no budget table"
    return {name: int(count) for name, count in rows}


def allowance(family: str, rows: dict[str, int]) -> tuple[str, int] | None:
    if family in rows:
        return family, rows[family]
    prefixes = [name for name in rows if name.endswith("*") and family.startswith(name[:-1])]
    best = max(prefixes, key=len, default=None)
    return (best, rows[best]) if best else None


def series_per_family(text: str) -> tuple[Counter, set]:
    counts, labels = Counter(), set()
    for family in text_string_to_metric_families(text):
        counts[family.name] += len(family.samples)
        labels |= {name for sample in family.samples for name in sample.labels}
    return counts, labels


def node_exposition(tmp_path, **training) -> str:
    run = tmp_path / "run"
    write_node_ranks(run, 0)
    server, address = start_node_agent(tmp_path, run, 0, interval=0.3, training=training)
    with server:
        def complete():
            text = scrape(address)
            return text if all(name in text for name in ("DCGM_FI_DEV_GPU_UTIL", "trainguard_training_loss",
                                                         "node_infiniband_info", "node_disk_read_bytes")) else None
        wait_for(complete, timeout=90, interval=0.5, message="every collector's families")
        return scrape(address)


def test_a_node_of_8_gpus_8_ranks_8_hcas_fits_the_budget(tmp_path):
    rows = budget()
    counts, labels = series_per_family(node_exposition(tmp_path))
    over = []
    for family, count in sorted(counts.items()):
        row = allowance(family, rows)
        if row is None:
            over.append(f"{family}: {count} series, no budget row in {DOC.name}")
        elif count > row[1]:
            over.append(f"{family}: {count} series > {row[1]} ({row[0]})")
    assert not over, "\n".join(over)
    assert sum(counts.values()) <= rows["TOTAL"], sum(counts.values())
    assert counts["DCGM_FI_DEV_GPU_UTIL"] == 8 and counts["node_infiniband_info"] == 8
    assert counts["trainguard_training_loss"] == 8
    assert "layer" not in labels     # per-layer series would need their own switch and row


def test_per_rank_off_exports_the_lead_rank_only(tmp_path):
    counts, _ = series_per_family(node_exposition(tmp_path, per_rank=False))
    training = {name: n for name, n in counts.items() if name.startswith("trainguard_training_") and n}
    assert training and all(n == 1 for name, n in training.items() if name != "trainguard_training_events")
    assert counts["trainguard_training_events"] == len(WATCHED_EVENTS)     # the lead rank's watched types
