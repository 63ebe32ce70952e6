"""Real servers for tests: find a binary, pick a free port, start a process and wait until it serves.

Every process started here is killed when its test is done, whatever happens: use the context
managers (``with start_prometheus(...) as url:``), or call the starters plainly and let the process
live until :func:`stop_all` (``servers_cleanup`` fixture) or interpreter exit.

A missing binary skips the test, but fails it under ``CI=true``, where the servers must be installed::

    from tests.servers import require_binary, start_prometheus, start_alertmanager

    def test_rules(tmp_path):
        with start_prometheus(tmp_path, ["127.0.0.1:9655"], rule_files=[rules]) as url:
            ...
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

import pytest
import yaml

STOP_GRACE_SECONDS = 5.0
_running: list["Server"] = []


# ------------------------------------------------------------------------------------------- binaries

def require_binary(name: str, *alternatives: str) -> str:
    """The path of `name` (or the first alternative found): skip the test if none is installed, fail under CI=true."""
    for candidate in (name, *alternatives):
        path = shutil.which(candidate)
        if path:
            return path
    message = f"{' or '.join((name, *alternatives))} is not installed (scripts/setup --servers installs it)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{message}; CI=true requires it", pytrace=False)
    pytest.skip(message)


# -------------------------------------------------------------------------------------------- network

def mount_or_skip(args: Sequence[str], target: Path) -> None:
    """`mount ARGS TARGET` (a real tmpfs, a read-only bind). Skipped where mounting is not permitted,
    but a failure under CI=true as root, where it must work."""
    try:
        result = subprocess.run(["mount", *args, str(target)], capture_output=True, text=True, timeout=30)
        problem = result.stderr.strip() if result.returncode else None
    except FileNotFoundError:
        problem = "no mount command"
    if problem:
        message = f"cannot mount here ({problem})"
        if os.environ.get("CI", "").lower() == "true" and os.geteuid() == 0:
            pytest.fail(f"{message}; CI=true as root requires it", pytrace=False)
        pytest.skip(message)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (the OS picks it; a race with another process is possible but rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """The HTTP status of a GET, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError):
        return None


def http_get(url: str, timeout: float = 10.0, headers: Mapping[str, str] | None = None) -> tuple[int, dict, bytes]:
    """(status, headers, body) of a GET; HTTP errors are returned, not raised."""
    request = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


# ------------------------------------------------------------------------------------------ processes

class Server(str):
    """A started server: the string is its base URL; `.process`, `.log_path` and `.stop()` come with it."""

    process: subprocess.Popen
    log_path: Path
    ready_url: str | None = None             # what `wait_ready` waits for: this URL answering 200,
    ready_port: tuple[str, int] | None = None    # else this port accepting

    def __new__(cls, url: str, process: subprocess.Popen, log_path: Path) -> "Server":
        server = super().__new__(cls, url)
        server.process, server.log_path = process, log_path
        return server

    def log_tail(self, chars: int = 4000) -> str:
        return _tail(self.log_path, chars)

    def wait_ready(self, timeout: float = 30.0) -> "Server":
        """Wait until its `ready_url` answers 200 (else `ready_port` accepts); stop the process if it never does."""
        try:
            wait_until_ready(self.process, port=self.ready_port, url=self.ready_url, timeout=timeout,
                             log_path=self.log_path)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        _kill(self.process)
        if self in _running:
            _running.remove(self)

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _tail(path: Path, chars: int) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _kill(process: subprocess.Popen) -> None:
    """SIGTERM the process group, SIGKILL it after a grace period, and reap it."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    else:  # the leader is gone; children it left in its group must not outlive the test
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)


def stop_all() -> None:
    """Stop every server started through this module that is still running."""
    for server in list(_running):
        server.stop()


atexit.register(stop_all)


@pytest.fixture
def servers_cleanup() -> Iterator[None]:
    """A fixture that stops, at teardown, every server the test started with a plain call."""
    yield
    stop_all()


def wait_until_ready(process: subprocess.Popen, *, port: tuple[str, int] | None = None, url: str | None = None,
                     timeout: float = 30.0, log_path: Path | None = None) -> None:
    """Wait until `url` answers 200 (or `port` accepts); raise naming the command and its log if it never does."""
    if url is None and port is None:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited with {process.returncode} before it was ready:\n"
                               + (_tail(log_path, 4000) if log_path else ""))
        if url is not None and http_status(url, timeout=1.0) == 200:
            return
        if url is None and port is not None and port_open(*port):
            return
        time.sleep(0.05)
    raise TimeoutError(f"{process.args[0]} was not ready within {timeout:.0f}s "
                       f"({url or port}):\n" + (_tail(log_path, 4000) if log_path else ""))


def start(cmd: Sequence[str], *, url: str, ready_url: str | None = None, port: tuple[str, int] | None = None,
          log_path: Path, timeout: float = 30.0, cwd: str | os.PathLike | None = None,
          env: Mapping[str, str] | None = None) -> Server:
    """Start `cmd` in its own process group, wait for readiness, return it as a :class:`Server` named by `url`.

    Readiness is `ready_url` answering 200, else `port` accepting connections. The process is killed if it
    never gets ready; otherwise it runs until `.stop()`, the end of a ``with`` block, or :func:`stop_all`.
    """
    return spawn(cmd, url=url, ready_url=ready_url, port=port, log_path=log_path, cwd=cwd,
                 env=env).wait_ready(timeout)


def spawn(cmd: Sequence[str], *, url: str, log_path: Path, ready_url: str | None = None,
          port: tuple[str, int] | None = None, cwd: str | os.PathLike | None = None,
          env: Mapping[str, str] | None = None) -> Server:
    """Start `cmd` as :func:`start` does, without waiting: start several, then `.wait_ready()` on each, so
    their start-ups (an interpreter importing trainguard, a Prometheus opening its TSDB) overlap."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   cwd=cwd, env=None if env is None else dict(env), start_new_session=True)
    server = Server(url, process, log_path)
    server.ready_url, server.ready_port = ready_url, port
    _running.append(server)
    return server


@contextlib.contextmanager
def running(cmd: Sequence[str], *, port: int | None = None, ready_path: str | None = None,
            host: str = "127.0.0.1", timeout: float = 30.0, log_path: Path | None = None,
            cwd: str | os.PathLike | None = None, env: Mapping[str, str] | None = None) -> Iterator[Server]:
    """Run `cmd` for the ``with`` block: ready when `host:port` accepts (or `ready_path` answers 200); always killed."""
    url = f"http://{host}:{port}" if port is not None else ""
    log_path = log_path or Path(os.environ.get("TMPDIR", "/tmp")) / f"{Path(cmd[0]).name}-{os.getpid()}-{port}.log"
    server = start(cmd, url=url, ready_url=url + ready_path if ready_path else None,
                   port=(host, port) if port is not None else None, log_path=log_path, timeout=timeout,
                   cwd=cwd, env=env)
    try:
        yield server
    finally:
        server.stop()


def _fresh_dir(tmp_path: Path, name: str) -> Path:
    """tmp_path/name, or name-2, name-3 ... when a test starts several of the same server."""
    for index in range(1, 1000):
        candidate = tmp_path / (name if index == 1 else f"{name}-{index}")
        try:
            candidate.mkdir(parents=True)
            return candidate
        except FileExistsError:
            continue
    raise RuntimeError(f"too many {name} directories under {tmp_path}")


# -------------------------------------------------------------------------------------------- Prometheus

def _scrape_configs(scrape_targets: Sequence[str] | Mapping[str, Sequence[str] | Mapping]) -> list[dict]:
    """["h:p", ...] is one job "trainguard"; {"job": ["h:p"], ...} or {"job": {full scrape_config}} name their jobs."""
    if isinstance(scrape_targets, Mapping):
        jobs = scrape_targets.items()
    else:
        jobs = [("trainguard", scrape_targets)]
    configs = []
    for job, spec in jobs:
        if isinstance(spec, Mapping):
            configs.append({"job_name": job, **spec})
        else:
            configs.append({"job_name": job, "static_configs": [{"targets": list(spec)}]})
    return configs


def start_prometheus(tmp_path: Path, scrape_targets: Sequence[str] | Mapping[str, Sequence[str] | Mapping],
                     rule_files: Iterable[str | os.PathLike] = (), alertmanager_url: str | None = None,
                     scrape_interval: str = "1s", eval_interval: str = "1s", timeout: float = 60.0,
                     extra_args: Sequence[str] = (), extra_config: Mapping | None = None,
                     wait: bool = True) -> Server:
    """A real Prometheus on a free loopback port with its data under tmp_path; returns its URL (a :class:`Server`).

    `wait=False`: started, not yet ready; call ``.wait_ready(timeout)`` (to start other servers meanwhile).

    `extra_config`: top-level keys merged into prometheus.yml (remote_write, global external_labels ...).

    `scrape_targets`: ``["127.0.0.1:9655"]`` (job ``trainguard``) or ``{"job": ["host:port"], ...}``.
    Use as ``with start_prometheus(...) as url:`` to stop it at the end of the block.
    """
    binary = require_binary("prometheus")
    home = _fresh_dir(Path(tmp_path), "prometheus")
    config: dict = {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": eval_interval,
                   "scrape_timeout": scrape_interval if _seconds(scrape_interval) < 10 else "10s"},
        "rule_files": [str(Path(f).resolve()) for f in rule_files],
        "scrape_configs": _scrape_configs(scrape_targets),
    }
    if alertmanager_url:
        target = alertmanager_url.split("://", 1)[-1].rstrip("/")
        config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [target]}]}]}
    for key, value in (extra_config or {}).items():
        config[key] = {**config[key], **value} if isinstance(config.get(key), dict) else value
    (home / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [binary, f"--config.file={home / 'prometheus.yml'}", f"--storage.tsdb.path={home / 'data'}",
           f"--web.listen-address=127.0.0.1:{port}", "--web.enable-lifecycle", *extra_args]
    server = spawn(cmd, url=url, ready_url=url + "/-/ready", log_path=home / "prometheus.log")
    return server.wait_ready(timeout) if wait else server


def _seconds(duration: str) -> float:
    units = {"ms": 1e-3, "s": 1, "m": 60, "h": 3600}
    for suffix in ("ms", "s", "m", "h"):
        if duration.endswith(suffix):
            return float(duration[: -len(suffix)]) * units[suffix]
    return float(duration)


def start_alertmanager(tmp_path: Path, config_yaml: str | Mapping, timeout: float = 60.0,
                       extra_args: Sequence[str] = (), wait: bool = True) -> Server:
    """A real Alertmanager on a free loopback port (clustering off), config given as YAML text or a mapping;
    `wait=False` as for :func:`start_prometheus`."""
    binary = require_binary("prometheus-alertmanager", "alertmanager")
    home = _fresh_dir(Path(tmp_path), "alertmanager")
    text = config_yaml if isinstance(config_yaml, str) else yaml.safe_dump(dict(config_yaml), sort_keys=False)
    (home / "alertmanager.yml").write_text(text)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [binary, f"--config.file={home / 'alertmanager.yml'}", f"--storage.path={home / 'data'}",
           f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=", *extra_args]
    server = spawn(cmd, url=url, ready_url=url + "/-/ready", log_path=home / "alertmanager.log")
    return server.wait_ready(timeout) if wait else server


def start_node_exporter(tmp_path: Path, args: Sequence[str] = (), timeout: float = 30.0) -> Server:
    """A real prometheus-node-exporter on a free loopback port; `args` adds flags (e.g. ``--path.procfs=...``)."""
    binary = require_binary("prometheus-node-exporter", "node_exporter")
    home = _fresh_dir(Path(tmp_path), "node_exporter")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [binary, f"--web.listen-address=127.0.0.1:{port}", *args]
    return start(cmd, url=url, ready_url=url + "/metrics", log_path=home / "node_exporter.log", timeout=timeout)


def promtool_check_metrics(exposition: bytes | str) -> subprocess.CompletedProcess:
    """`promtool check metrics` over an exposition (stdin); the result's returncode and output tell the verdict."""
    binary = require_binary("promtool")
    data = exposition.encode() if isinstance(exposition, str) else exposition
    return subprocess.run([binary, "check", "metrics"], input=data, capture_output=True, timeout=60)


def prometheus_query(url: str, expr: str, timeout: float = 10.0) -> list[dict]:
    """The `result` list of an instant query against a started Prometheus."""
    import json
    from urllib.parse import urlencode

    status, _, body = http_get(f"{url}/api/v1/query?{urlencode({'query': expr})}", timeout=timeout)
    payload = json.loads(body)
    if status != 200 or payload.get("status") != "success":
        raise RuntimeError(f"query {expr!r} failed ({status}): {payload}")
    return payload["data"]["result"]


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.1, message: str = "condition"):
    """Poll `predicate` until it returns something truthy (and return it); raise TimeoutError naming `message`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{message} not met within {timeout:.0f}s")
        time.sleep(interval)


# ---------------------------------------------------------------------------------- the agent, in-process

@contextlib.contextmanager
def agent_server(config=None, registry=None, **config_fields) -> Iterator[tuple[object, str]]:
    """A trainguard agent (runner.Agent + server.AgentServer) in this process on a free loopback port.

    Yields (agent, base_url); collectors run in their threads until the block ends. `registry` limits the
    collector classes (name -> class); `config_fields` set AgentConfig fields (run_dir=..., procfs=...).
    """
    from dataclasses import replace

    from trainguard.agent import collectors  # noqa: F401 - registers the collectors
    from trainguard.agent.config import AgentConfig
    from trainguard.agent.runner import Agent
    from trainguard.agent.server import AgentServer

    config = replace(config or AgentConfig(), **config_fields)
    agent = Agent(config, registry=registry)
    server = AgentServer(agent, "127.0.0.1", 0)
    agent.start()
    server.start()
    try:
        yield agent, server.url
    finally:
        server.stop()
        agent.stop(timeout=2.0)


@contextlib.contextmanager
def tmpfs(target: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of `size` mounted on `target` (made here) for the block: a small disk to fill up."""
    target.mkdir(parents=True, exist_ok=True)
    mount_or_skip(["-t", "tmpfs", "-o", f"size={size}", "tmpfs"], target)
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True, timeout=30)


def fill_disk(directory: Path) -> Path:
    """Write `directory/filler` until the filesystem says ENOSPC, to the last byte; returns the filler."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as handle:
        for size in (2**16, 512, 1):
            try:
                while True:
                    handle.write(b"\0" * size)
            except OSError:
                pass
    return filler
