"""The gpu, io, ib and nccl collectors inside a real `trainguard agent` process: 8 fake H100s (the fake NVML
named by the agent's config, as a GPU-less CI machine would), the fixture procfs/sysfs trees, and a run
directory; the whole /metrics must pass `promtool check metrics` and every collector must report success."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.agent.exposition import series, values
from tests.servers import free_port, http_get, promtool_check_metrics, wait_for
from trainguard.runtime.control import write_rank_file

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"


def test_agent_serves_gpu_io_ib_nccl(tmp_path):
    run = tmp_path / "run"
    for rank in range(2):
        write_rank_file(run, rank, pid=4242 + rank)          # this host, as the trainer writes it
    config = {
        "run_dir": str(run), "procfs": str(FIXTURES / "proc"), "sysfs": str(FIXTURES / "sys"),
        "devfs": str(tmp_path), "node": "node-a", "nodelog": {"enabled": False},
        "collectors": {
            "gpu": {"interval": 0.2, "nvml_module": "tests.fakes.fake_nvml"},
            "io": {"interval": 0.2}, "ib": {"interval": 0.2}, "nccl": {"interval": 0.2},
            "host": {"enabled": False}, "training": {"enabled": False},
        },
    }
    (tmp_path / "agent.yaml").write_text(yaml.safe_dump(config))
    port = free_port()
    env = {**os.environ, "TRAINGUARD_FAKE_NVML": "h100x8", "PYTHONPATH": str(ROOT)}
    agent = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "agent", "--config", str(tmp_path / "agent.yaml"),
                              "--listen", f"127.0.0.1:{port}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def all_up():
            assert agent.poll() is None, agent.communicate()[0].decode(errors="replace")[-4000:]
            try:
                status, _, body = http_get(f"http://127.0.0.1:{port}/metrics", timeout=2)
            except OSError:            # not listening yet
                return None
            if status != 200:
                return None
            v = values(body.decode())
            ok = all(v.get(series("trainguard_scrape_collector_success", collector=c)) == 1
                     for c in ("gpu", "io", "ib", "nccl"))
            return body.decode() if ok and any(n == "DCGM_FI_DEV_GPU_UTIL" for n, _ in v) else None

        text = wait_for(all_up, timeout=60, message="gpu, io, ib and nccl collectors succeeding")
        v = values(text)
        gpus = {dict(labels)["gpu"] for name, labels in v if name == "DCGM_FI_DEV_GPU_UTIL"}
        assert gpus == {str(i) for i in range(8)}
        assert v[series("node_infiniband_state_id", device="mlx5_0", port="1")] == 4
        assert v[series("node_disk_read_bytes_total", device="nvme0n1")] == 48201837312 * 512
        ranks = {dict(labels)["rank"] for name, labels in v if name == "trainguard_nccl_env_info"}
        assert ranks == {"0", "1"}
        result = promtool_check_metrics(text)
        assert result.returncode == 0, (result.stdout + result.stderr).decode()
    finally:
        agent.terminate()
        try:
            output = agent.communicate(timeout=10)[0].decode(errors="replace")
        except subprocess.TimeoutExpired:
            agent.kill()
            output = agent.communicate()[0].decode(errors="replace")
    assert "Traceback" not in output, output[-4000:]
