"""Real `trainguard agent` processes standing in for the nodes of a cluster on one machine.

Each is a node of the H100x8 shape: 8 GPUs through the fake NVML (the only fake, tests/fakes), 8 HCAs
(the fixture sysfs tree, its two mlx5 devices copied to eight), the fixture procfs (its disk set), and
8 ranks of synthetic step records in a shared run directory (tests/fleet/synthetic.py), registered on
this node. Used by the cardinality budget, the many-agents action test and the Prometheus simulation.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import yaml

from tests.fleet.synthetic import node_name, register_rank, step_line
from tests.servers import Server, free_port, http_get, start

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
GPUS = RANKS = HCAS = 8


def eight_hca_sysfs(tmp: Path) -> Path:
    """The fixture sysfs with mlx5_0..mlx5_7 (copies of the two fixture HCAs)."""
    sysfs = tmp / "sys"
    if not sysfs.exists():
        shutil.copytree(FIXTURES / "sys", sysfs, symlinks=True)
        hcas = sysfs / "class" / "infiniband"
        for index in range(2, HCAS):
            shutil.copytree(hcas / f"mlx5_{index % 2}", hcas / f"mlx5_{index}", symlinks=True)
    return sysfs


def write_node_ranks(run_dir: Path, node_index: int, steps: int = 3, step_time: float = 1.0) -> range:
    ranks = range(node_index * RANKS, (node_index + 1) * RANKS)
    (run_dir / "tls").mkdir(parents=True, exist_ok=True)
    for rank in ranks:
        register_rank(run_dir, rank, node_name(node_index))
        with open(run_dir / "tls" / f"rank-{rank}.jsonl", "ab") as handle:
            handle.write(b"".join(step_line(s, rank, node_name(node_index), step_time=step_time) for s in range(1, steps + 1)))
    return ranks


def start_node_agent(tmp: Path, run_dir: Path, node_index: int, *, interval: float = 1.0,
                     webhook: dict | None = None, training: dict | None = None,
                     collectors: str | None = None) -> tuple[Server, str]:
    """One node's agent (all collectors, light intervals); returns (server, "127.0.0.1:port")."""
    node = node_name(node_index)
    config = {
        "run_dir": str(run_dir), "procfs": str(FIXTURES / "proc"), "sysfs": str(eight_hca_sysfs(tmp)),
        "devfs": str(tmp), "node": node, "nodelog": {"enabled": False},
        "collectors": {"gpu": {"interval": interval, "nvml_module": "tests.fakes.fake_nvml"},
                       "io": {"interval": interval}, "ib": {"interval": interval},
                       "nccl": {"interval": interval}, "host": {"interval": interval},
                       "training": {"interval": interval, **(training or {})}},
    }
    if webhook:
        config["webhook"] = webhook
    path = tmp / f"agent-{node}.yaml"
    path.write_text(yaml.safe_dump(config))
    address = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "TRAINGUARD_FAKE_NVML": "h100x8", "PYTHONPATH": str(ROOT), "TRAINGUARD_LOG_JSON": "1"}
    only = ["--collectors", collectors] if collectors else []
    server = start([sys.executable, "-m", "trainguard.cli", "agent", "--config", str(path), "--listen", address, *only],
                   url=f"http://{address}", ready_url=f"http://{address}/healthz",
                   log_path=tmp / f"agent-{node}.log", env=env)
    return server, address


def scrape(address: str) -> str:
    status, _, body = http_get(f"http://{address}/metrics", timeout=10)
    assert status == 200, status
    return body.decode()
