"""tests/servers.py itself: a missing binary skips (fails under CI=true); started processes never outlive a test."""

from __future__ import annotations

import os
import sys

import pytest

from tests import servers


def test_a_missing_binary_skips_but_fails_under_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no-such-server-binary is not installed"):
        servers.require_binary("no-such-server-binary")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true requires it"):
        servers.require_binary("no-such-server-binary")
    assert servers.require_binary("no-such-server-binary", "python3").endswith("python3")


def test_a_process_that_never_gets_ready_is_killed(tmp_path):
    port = servers.free_port()
    with pytest.raises(TimeoutError, match="was not ready within 1s"):
        servers.start([sys.executable, "-c", "import time; print('starting', flush=True); time.sleep(60)"],
                      url="", port=("127.0.0.1", port), log_path=tmp_path / "slow.log", timeout=1)
    leftovers = [s for s in servers._running if s.log_path == tmp_path / "slow.log"]
    assert leftovers == []
    assert "starting" in (tmp_path / "slow.log").read_text()


def test_a_process_that_exits_early_is_reported_with_its_log(tmp_path):
    with pytest.raises(RuntimeError, match="exited with 3 before it was ready:\nbroken config"):
        servers.start([sys.executable, "-c", "import sys; print('broken config'); sys.exit(3)"],
                      url="", port=("127.0.0.1", servers.free_port()), log_path=tmp_path / "x.log", timeout=30)


def test_running_kills_the_whole_process_group(tmp_path):
    port = servers.free_port()
    code = ("import http.server, subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(60)']); http.server.HTTPServer(('127.0.0.1', %d), http.server.SimpleHTTPRequestHandler)"
            ".serve_forever()" % port)
    with servers.running([sys.executable, "-c", code], port=port, ready_path="/", log_path=tmp_path / "s.log",
                         cwd=tmp_path) as server:
        assert servers.http_status(server + "/") == 200
        group = os.getpgid(server.process.pid)
    servers.wait_for(lambda: not _group_alive(group), 10, message="process group gone")


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
        return True
    except ProcessLookupError:
        return False
