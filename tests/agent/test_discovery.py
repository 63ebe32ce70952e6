"""`trainguard agent --runs-root`: the agent follows this node's run as runs appear and end under one root."""

import json
import socket
import subprocess
import time
from dataclasses import replace

import psutil
import pytest

from trainguard import rundir
from trainguard.agent import app as agent_app
from trainguard.agent import cli
from trainguard.agent.config import AgentConfig, ConfigError, from_mapping, with_flags
from trainguard.agent.discovery import Discovery

HOST = socket.gethostname()


@pytest.fixture
def processes():
    started = []

    def start():
        started.append(subprocess.Popen(["sleep", "300"]))
        return started[-1]
    yield start
    for process in started:
        process.kill()
        process.wait()


def register(run, pid, rank=0, host=HOST):
    created = psutil.Process(pid).create_time() if psutil.pid_exists(pid) else time.time()
    rundir.ranks_dir(run).mkdir(parents=True, exist_ok=True)
    rundir.rank_file(run, rank).write_text(json.dumps(
        {"rank": rank, "pid": pid, "host": host, "started_at": created + 0.1, "create_time": created}))


def test_the_run_with_a_live_rank_here_is_followed_and_dropped_when_it_ends(tmp_path, processes):
    root = tmp_path / "runs"
    (root / "empty").mkdir(parents=True)
    elsewhere = processes()
    register(root / "other-node", elsewhere.pid, host="gpu-node-99")     # another node's rank
    mine = processes()
    register(root / "job-1", mine.pid)
    discovery = Discovery(root, HOST, end_grace_seconds=0)
    assert discovery.poll() == root / "job-1"
    assert discovery.status()["following"] == str(root / "job-1")

    mine.kill()
    mine.wait()
    assert discovery.poll(time.time() + 1) is None        # its ranks here are gone: dropped

    time.sleep(0.05)
    later = processes()
    register(root / "job-2", later.pid)
    assert discovery.poll(time.time() + 2) == root / "job-2"


def test_a_second_run_on_the_same_node_is_reported_not_followed(tmp_path, processes):
    root = tmp_path / "runs"
    register(root / "job-1", processes().pid)
    discovery = Discovery(root, HOST)
    assert discovery.poll() == root / "job-1"
    register(root / "job-2", processes().pid)
    assert discovery.poll(time.time() + 1) == root / "job-1"
    assert discovery.status()["not_followed"] == [str(root / "job-2")]


def test_runs_root_and_run_dir_are_one_or_the_other(tmp_path):
    with pytest.raises(ConfigError, match="give one"):
        from_mapping({"run_dir": "/a", "runs_root": "/b"})
    config = from_mapping({"runs_root": str(tmp_path), "discovery": {"interval": 5, "end_grace_seconds": 30}})
    assert config.discovery.end_grace_seconds == 30
    assert with_flags(config, run_dir="/x").runs_root is None          # the flag wins over the file
    with pytest.raises(ConfigError, match="discovery.interval"):
        from_mapping({"discovery": {"interval": 0}})
    assert cli.check_runs_root(tmp_path / "missing").endswith("no such directory")


def test_the_app_rebuilds_the_run_parts_and_keeps_its_port(tmp_path, processes):
    root = tmp_path / "runs"
    root.mkdir()
    config = replace(AgentConfig(), listen="127.0.0.1:0", runs_root=root, node=HOST, only=())
    built = agent_app.build(config)
    try:
        assert built.config.run_dir is None and built.actions is None
        port = built.server.address[1]
        register(root / "job-1", processes().pid)
        built.follow(built.discovery.poll())
        assert built.config.run_dir == root / "job-1" and built.server.agent is built.agent
        assert built.actions is not None and ("POST", "/api/v1/alerts") in built.server._routes
        assert built.agent.health()["discovery"]["following"] == str(root / "job-1")
        built.follow(None)
        assert built.actions is None and ("POST", "/api/v1/alerts") not in built.server._routes
        assert built.server.address[1] == port
    finally:
        built.server.stop()
        built._stop_run_parts()


def test_the_cli_takes_runs_root(tmp_path):
    import argparse
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    config = cli.build_config(parser.parse_args(["--runs-root", str(tmp_path)]), {"training"})
    assert config.runs_root == tmp_path and config.run_dir is None
