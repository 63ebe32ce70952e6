"""Agent configuration (file + flags) and the `trainguard agent` command: errors name file and key; clean stop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import free_port, http_get, wait_for
from trainguard.agent import config as agent_config
from trainguard.agent.config import ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "agent" / "configs" / "agent.yaml"
KNOWN = {"gpu", "io", "ib", "nccl", "host", "training"}


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "agent.yaml"
    path.write_text(text)
    return path


def test_the_example_config_loads():
    config = agent_config.load(EXAMPLE, KNOWN)
    assert config.listen == "127.0.0.1:9655"
    assert config.nodelog.max_bytes == 64 * 2**20
    assert config.collector("host").options == {"nccl_from_torch": True}


def test_file_values_and_collector_sections(tmp_path):
    path = write(tmp_path, """
listen: 0.0.0.0:9500
procfs: /host/proc
interval: 2
nodelog: {max_bytes: 1MiB, keep: 3}
collectors:
  gpu: {interval: 1, timeout: 3, kmsg: false}
  ib: {enabled: false}
""")
    config = agent_config.load(path, KNOWN)
    assert config.listen_address == ("0.0.0.0", 9500)
    assert config.procfs == Path("/host/proc")
    assert config.nodelog.max_bytes == 2**20 and config.nodelog.keep == 3
    assert config.interval_of("gpu", 5.0) == 1 and config.timeout_of("gpu", 10.0) == 3
    assert config.interval_of("io", 5.0) == 2 and config.timeout_of("io", 10.0) == 10.0
    assert config.collector("gpu").options == {"kmsg": False}
    assert not config.is_enabled("ib", True) and config.is_enabled("host", True)
    assert not config.is_enabled("gpu", False)   # on/off unset: the collector's own default


@pytest.mark.parametrize("text, message", [
    ("listen: 9655", "listen: expected HOST:PORT, got 9655"),
    ("listen: 'a:99999'", "listen: port must be 0..65535"),
    ("collectors: {gpu: {interval: fast}}", "collectors.gpu.interval: expected a number, got 'fast'"),
    ("collectors: {gpu: {interval: 0}}", "collectors.gpu.interval: must be > 0"),
    ("collectors: {gpu: {enabled: 'yes'}}", "collectors.gpu.enabled: expected true or false"),
    ("collectors: {gpuu: {}}", "collectors.gpuu: unknown collector"),
    ("nodelog: {max_bytes: lots}", "nodelog.max_bytes: expected a size"),
    ("nodelog: {keep: 0}", "nodelog.keep: expected an integer >= 1"),
    ("nodelog: {rotate: 1}", "nodelog.rotate: unknown key"),
    ("listn: 1", "listn: unknown key"),
    ("collectors: [gpu]", "collectors: expected a mapping, got list"),
    ("listen: [", "not valid YAML"),
])
def test_errors_name_the_file_and_the_key(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as error:
        agent_config.load(path, KNOWN)
    assert str(error.value).startswith(f"{path}: ")
    assert message in str(error.value)


def test_flags_override_the_file(tmp_path):
    config = agent_config.load(write(tmp_path, "listen: 127.0.0.1:1\nnode: a\n"), KNOWN)
    config = agent_config.with_flags(config, listen="127.0.0.1:2", node=None, only=("host",),
                                     nodelog_max_bytes="10KiB", run_dir="/r")
    assert config.listen == "127.0.0.1:2" and config.node == "a" and config.run_dir == Path("/r")
    assert config.nodelog.max_bytes == 10 * 1024
    assert config.is_enabled("host", False) and not config.is_enabled("gpu", True)
    with pytest.raises(ConfigError, match="--listen: expected HOST:PORT"):
        agent_config.with_flags(config, listen="nowhere")


def agent_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainguard.cli", "agent", *args]


def test_cli_reports_a_bad_config_and_exits_2(tmp_path):
    path = write(tmp_path, "collectors: {gpu: {interval: -1}}")
    result = subprocess.run(agent_command("--config", str(path)), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert f"{path}: collectors.gpu.interval: must be > 0" in result.stderr
    result = subprocess.run(agent_command("--collectors", "host,warp"), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--collectors: unknown collector(s) warp" in result.stderr


def test_cli_serves_then_stops_cleanly_on_sigterm(tmp_path):
    port = free_port()
    env = {**os.environ, "TRAINGUARD_LOG_JSON": "1"}
    process = subprocess.Popen(agent_command("--create", "--run-dir", str(tmp_path / "run"), "--listen", f"127.0.0.1:{port}",
                                             "--collectors", "host,training", "--interval", "0.2"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        health = wait_for(lambda: _health(url), 60, message="agent answering /healthz")
        assert set(health["collectors"]) == {"host", "training"}
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0
    events = [json.loads(line)["event"] for line in stderr.splitlines() if line.startswith("{")]
    assert events[-2:] == ["stopping", "stopped"]


def test_cli_says_when_the_port_is_taken(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(agent_command("--listen", f"127.0.0.1:{port}", "--collectors", "host"),
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in result.stderr


def _health(url: str):
    try:
        status, _, body = http_get(url + "/healthz", timeout=2)
    except OSError:
        return None
    health = json.loads(body) if status == 200 else None
    return health if health and all(c["updates"] for c in health["collectors"].values()) else None


def test_an_empty_listen_host_is_refused_rather_than_binding_every_interface():
    from trainguard.agent.config import ConfigError, parse_listen

    with pytest.raises(ConfigError, match="127.0.0.1:9655 for this node only"):
        parse_listen(":9655", "--listen")


def test_a_config_that_is_not_utf8_is_a_named_error_with_exit_2(tmp_path):
    path = tmp_path / "agent.yaml"
    path.write_bytes(b"interval: 5  # \xff\n")
    result = subprocess.run(agent_command("--config", str(path)), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and f"{path}: not UTF-8" in result.stderr + result.stdout
    assert "Traceback" not in result.stderr


def test_a_mistyped_run_dir_is_refused_unless_create_is_given(tmp_path):
    missing = tmp_path / "runz" / "gpt"
    result = subprocess.run(agent_command("--run-dir", str(missing)), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "no such run directory (a typo? pass --create to make it)" in result.stderr
    assert not missing.exists() and "Traceback" not in result.stderr
    (tmp_path / "file").write_text("x")
    result = subprocess.run(agent_command("--run-dir", str(tmp_path / "file")), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "not a directory" in result.stderr
