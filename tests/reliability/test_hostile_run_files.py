"""One safe way to read a file from the run directory: what a stranger who can write RUN puts
under a name trainguard reads (a FIFO, /dev/zero, a 2 GB line, a decompression bomb, an alias bomb, a
garbage manifest) is refused, named, and never waited on.

Every command runs in a subprocess with a timeout, so a hang fails its test rather than the suite; each of
these hung (or read until memory ran out, or crashed) before trainguard/safe_read.py.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainguard import safe_read, tls

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 120        # generous on a loaded machine; a FIFO read would wait for ever


def trainguard(*argv, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-m", "trainguard.cli", *map(str, argv)], capture_output=True,
                              text=True, timeout=timeout, cwd=ROOT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"trainguard {' '.join(map(str, argv))} hung for {timeout} s (a FIFO or a device read?)")


def python(code: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                              cwd=ROOT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"hung for {timeout} s:\n{code}")


COMMANDS = """
import contextlib, io, json, sys
from trainguard.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    results.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def trainguard_many(*commands, timeout: float = TIMEOUT) -> list[tuple[int, str, str]]:
    """Several commands in one child (one import of torch on a loaded machine): (code, stdout, stderr) each."""
    argv = json.dumps([[str(a) for a in command] for command in commands])
    try:
        done = subprocess.run([sys.executable, "-c", COMMANDS, argv], capture_output=True, text=True,
                              timeout=timeout, cwd=ROOT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"one of {commands} hung for {timeout} s (a FIFO or a device read?)")
    assert done.returncode == 0, done.stderr[-3000:]
    return [tuple(result) for result in json.loads(done.stdout.splitlines()[-1])]


def _steps(n: int, start: int = 1) -> str:
    return "".join(json.dumps({"timestamp": 1_700_000_000 + i, "step": i, "rank": 0,
                               "metrics": {"loss": 2.0, "grad_norm": 1.0}}) + "\n" for i in range(start, start + n))


# --------------------------------------------------------------------------- the reader itself

def test_the_reader_refuses_a_fifo_a_device_a_directory_and_too_large_naming_the_file(tmp_path):
    fifo = tmp_path / "incident.json"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")
    big = tmp_path / "big.json"
    big.write_bytes(b" " * 2048)
    for path, words in ((fifo, "is a FIFO"), (zero, "is a device"), (tmp_path, "is a directory"),
                        (big, "more than the 1024 bytes")):
        with pytest.raises(safe_read.RunFileError, match=words) as caught:
            safe_read.read_bytes(path, 1024, "verdict")
        assert str(caught.value).startswith(str(path))
    with pytest.raises(FileNotFoundError):
        safe_read.read_bytes(tmp_path / "missing", 1024)
    good = tmp_path / "ok.json"
    good.write_text('{"a": 1}')
    assert safe_read.read_json(good, 1024) == {"a": 1}


# ------------------------------------------------------------------- High 3: incident.json

@pytest.fixture
def incident_run(tmp_path) -> tuple[Path, str]:
    incident_id = "20261201T192300Z-hang-3fa2"
    (tmp_path / "incidents" / incident_id).mkdir(parents=True)
    return tmp_path, incident_id


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_incidents_lists_a_fifo_or_dev_zero_incident_json_as_a_problem_and_ends(incident_run, kind):
    run, incident_id = incident_run
    verdict = run / "incidents" / incident_id / "incident.json"
    os.mkfifo(verdict) if kind == "fifo" else verdict.symlink_to("/dev/zero")
    done = trainguard("incidents", run)
    assert incident_id in done.stdout
    assert ("is a FIFO" if kind == "fifo" else "is a device") in done.stdout + done.stderr
    assert "Traceback" not in done.stderr


def test_the_agents_verdict_read_does_not_block_on_a_fifo(incident_run):
    """Both agents blocked here (agent/culprit.py read_verdict): no verdict, no restore, the run hung."""
    run, incident_id = incident_run
    os.mkfifo(run / "incidents" / incident_id / "incident.json")
    done = python("from pathlib import Path\nfrom trainguard.agent.culprit import read_verdict\n"
                  f"print(read_verdict(Path({str(run)!r}), {incident_id!r}))", timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "None", done.stderr


def test_the_agents_evidence_reads_do_not_block_on_fifos(incident_run):
    run, incident_id = incident_run
    directory = run / "incidents" / incident_id
    os.mkfifo(directory / "rank-0.fr.json")
    os.mkfifo(directory / "rank-0.stack.txt")
    (directory / "rank-1.stack.txt").symlink_to("/dev/zero")
    done = python("from pathlib import Path\nfrom trainguard.agent import evidence\n"
                  f"d = Path({str(directory)!r})\n"
                  "print(evidence._json(d / 'rank-0.fr.json'), evidence._bytes(d / 'rank-0.stack.txt'), "
                  "evidence._bytes(d / 'rank-1.stack.txt'))", timeout=60)
    assert done.returncode == 0 and done.stdout.split() == ["None", "None", "None"], done.stderr


# ------------------------------------------------------------------ High 4: manifest.json, extra.pt

@pytest.fixture
def checkpointed(tmp_path) -> tuple[Path, Path]:
    """A run with step_1 and step_2 (DCP format: extra.pt beside the shards), signed with its own key."""
    import torch

    from trainguard.runtime.checkpoint import CheckpointManager

    key = tmp_path / "keys" / "checkpoint.key"
    run = tmp_path / "run"
    manager = CheckpointManager(run, key_file=key, keep_last=5)
    for step in (1, 2):
        manager.save(step, {"model": {"w": torch.full((100,), float(step))}, "step": step}, stable=True)
    (run / "tls").mkdir()
    (run / "tls" / "rank-0.jsonl").write_text(_steps(3))
    return run, key


def test_a_fifo_named_manifest_json_is_refused_by_every_command_that_reads_it(checkpointed, tmp_path):
    run, key = checkpointed
    manifest = run / "checkpoints" / "step_2" / "manifest.json"
    manifest.unlink()
    os.mkfifo(manifest)
    listed, verified, status, report, restored = trainguard_many(
        ("checkpoint", "list", run, "--key-file", key), ("checkpoint", "verify", run, "--key-file", key),
        ("status", run, "--json"), ("report", run, "-o", tmp_path / "report.html", "--no-goodput"),
        ("checkpoint", "restore", run, "--key-file", key, "--json"))
    assert listed[0] == 0 and "manifest.json: is a FIFO" in listed[1], listed[2]
    assert verified[0] == 1 and "step_2: FAILED: unreadable manifest: manifest.json: is a FIFO" in verified[1]
    assert status[0] == 0 and json.loads(status[1])["last_checkpoint"] == "step_1"
    assert report[0] == 0, report[2]
    assert "manifest.json: is a FIFO, not a manifest" in (tmp_path / "report.html").read_text()
    assert restored[0] == 0 and json.loads(restored[1])["step"] == 1


def test_a_fifo_in_place_of_a_listed_file_is_refused_and_the_older_checkpoint_restored(checkpointed):
    run, key = checkpointed
    extra = run / "checkpoints" / "step_2" / "extra.pt"
    extra.unlink()
    os.mkfifo(extra)
    verified, restored = trainguard_many(("checkpoint", "verify", run, "--key-file", key, "--step", 2),
                                         ("checkpoint", "restore", run, "--key-file", key, "--json"))
    assert verified[0] == 1 and "extra.pt is listed in the manifest but is a FIFO" in verified[1]
    assert restored[0] == 0 and json.loads(restored[1])["step"] == 1


def test_train_does_not_hang_before_its_ranks_start_on_a_fifo_manifest(checkpointed):
    """`trainguard train` read every manifest (the key check) before any rank started: a FIFO froze it, and
    every restart after it. The check now reads through safe_read and goes on."""
    run, key = checkpointed
    manifest = run / "checkpoints" / "step_2" / "manifest.json"
    manifest.unlink()
    os.mkfifo(manifest)
    done = python("from pathlib import Path\nfrom trainguard.trainer import cli, config as cfg\n"
                  "c = cfg.TrainConfig()\n"
                  f"c.run.key_file = {str(key)!r}\n"
                  f"print(cli._check_checkpoint_key(c, Path({str(run)!r}), False))", timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "None", done.stderr


# ------------------------------------------------------------------ unbounded memory: logs

def test_a_sparse_2_gb_rank_log_without_a_newline_is_refused_naming_the_line(tmp_path):
    """`replay` and `status` read the whole line; now a line past safe_read.MAX_LINE_BYTES is an error
    naming the file and the line, and neither holds more than the bound (the children run under a 1.5 GiB
    address-space limit: reading the 2 GB line would fail there)."""
    run = tmp_path / "run"
    (run / "tls").mkdir(parents=True)
    log = run / "tls" / "rank-0.jsonl"
    with open(log, "wb") as handle:
        handle.truncate(2 << 30)          # sparse: no disk used, 2 GB of zeros to read
    limit = "import resource; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n"
    replay = python(limit + f"import sys\nfrom trainguard.cli import main\nsys.exit(main(['replay', {str(run)!r}]))")
    assert replay.returncode == 2, replay.stderr[-2000:]
    assert f"{log}: line 1 longer than 64.0 MiB" in replay.stderr
    status = python(limit + f"import sys\nfrom trainguard.cli import main\nsys.exit(main(['status', {str(run)!r}, "
                            "'--json']))")
    assert status.returncode == 0, status.stderr[-2000:]
    assert any("longer than" in error for error in json.loads(status.stdout)["errors"])


def test_a_line_past_the_bound_is_named_by_number_on_every_path(tmp_path, monkeypatch):
    monkeypatch.setattr(safe_read, "MAX_LINE_BYTES", 1 << 16)
    log = tmp_path / "rank-0.jsonl"
    log.write_bytes(_steps(3).encode() + b'{"timestamp": 1, "x": "' + b"a" * (1 << 17) + b'"}\n' + _steps(2).encode())
    with pytest.raises(safe_read.RunFileError, match=r"line 4 longer than 64 KiB|line 4 longer than 65536 bytes"):
        list(tls.iter_lines(log))
    from trainguard.replay import source
    with pytest.raises(safe_read.RunFileError, match="line 4 longer than"):
        list(source.Stream([log]))


def test_a_gzip_bomb_is_refused_once_it_expands_past_the_bound(tmp_path, monkeypatch):
    """A 6.5 MB gzip of 1.5 GB of zeros (`replay`, `report`) in small: the bound is MAX_EXPANSION times the
    compressed size, at least MIN_DECOMPRESSED (256 MiB; 256 KiB here)."""
    monkeypatch.setattr(safe_read, "MIN_DECOMPRESSED", 256 << 10)
    bomb = tmp_path / "rank-0.jsonl.gz"
    bomb.write_bytes(gzip.compress(_steps(2).encode() + b" " * (8 << 20), compresslevel=1))
    assert bomb.stat().st_size * safe_read.MAX_EXPANSION < 8 << 20
    with pytest.raises(safe_read.RunFileError, match="decompresses to more than"):
        list(tls.iter_lines(bomb))
    from trainguard.replay import source
    with pytest.raises(safe_read.RunFileError, match="decompresses to more than"):
        list(source.Stream([bomb]))
    plain = tmp_path / "ok.jsonl.gz"
    plain.write_bytes(gzip.compress(_steps(1000).encode()))
    assert sum(1 for line in tls.iter_lines(plain) if line.record) == 1000


# ------------------------------------------------------------------ Medium: YAML alias bomb

BOMB = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{n}: &{n} [{','.join('*' + p for _ in range(9))}]\n" for p, n in zip("abcdefgh", "bcdefghi"))


def test_a_yaml_alias_bomb_is_refused_while_composed_everywhere_yaml_is_read(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB)
    assert len(BOMB) < 1024
    from trainguard import policy
    from trainguard.replay import expect
    from trainguard.trainer import config as cfg

    began = time.monotonic()
    with pytest.raises(policy.PolicyError, match="aliases") as caught:
        policy.load(bomb)
    assert len(str(caught.value)) < 300
    with pytest.raises(ValueError, match="aliases"):
        policy.read_yaml(bomb, "config file")        # the agent's config comes through here
    with pytest.raises(expect.ExpectError, match="aliases"):
        expect.load(bomb)
    with pytest.raises(cfg.ConfigError, match="aliases"):
        cfg.load_file(cfg.TrainConfig(), str(bomb))
    assert time.monotonic() - began < 30
    assert safe_read.load_yaml("a: &x {b: [1, 2]}\nc: *x\n") == {"a": {"b": [1, 2]}, "c": {"b": [1, 2]}}


def test_the_policy_checker_shows_a_bounded_value_in_its_error():
    """The checker put the whole value in its message: repr of a shared-node structure is exponential."""
    from trainguard import policy

    value: list = ["x"] * 9
    for _ in range(12):
        value = [value] * 9          # 9**13 leaves when written out; a few hundred objects in memory
    with pytest.raises(policy.PolicyError) as caught:
        policy.from_mapping({"cost": {"price_per_gpu_hour": value}})
    assert len(str(caught.value)) < 500


def test_replay_with_an_alias_bomb_policy_exits_2_at_once(tmp_path):
    """The bomb inside a key the checker knows: its message wrote the whole value out (9**9 leaves)."""
    levels = ["&a [x, x, x, x, x, x, x, x, x]"] + [f"&{n} [{', '.join('*' + p for _ in range(9))}]"
                                                    for p, n in zip("abcdefgh", "bcdefghi")]
    bomb = tmp_path / "policy.yaml"
    bomb.write_text("cost: {price_per_gpu_hour: [" + ", ".join(levels) + "]}\n")
    assert bomb.stat().st_size < 1024
    log = tmp_path / "rank-0.jsonl"
    log.write_text(_steps(3))
    done = trainguard("replay", log, "--policy", bomb, timeout=60)
    assert done.returncode == 2 and "aliases" in done.stderr and len(done.stderr) < 1000


# ------------------------------------------------- Medium: a garbage manifest is no checkpoint

def test_a_garbage_manifest_is_not_the_latest_checkpoint_for_status_or_the_agent(checkpointed):
    run, _ = checkpointed
    garbage = run / "checkpoints" / "step_12345"
    garbage.mkdir()
    (garbage / "manifest.json").write_text('{"anything": 1}')
    status = trainguard("status", run, "--json")
    assert json.loads(status.stdout)["last_checkpoint"] == "step_2", status.stderr
    from trainguard.agent.collectors import training
    newest = training._newest_checkpoint(run / "checkpoints")
    assert newest is not None and newest[1] == 2
    (garbage / "manifest.json").write_text(json.dumps({"format": "trainguard-checkpoint/2", "step": 99,
                                                       "signature": {"value": "0" * 64}, "files": {}}))
    assert training._newest_checkpoint(run / "checkpoints")[1] == 2      # its step is not its directory's


# ------------------------------------------------------------------ a read-only run directory

@pytest.fixture
def read_only_dir(tmp_path):
    """A real read-only filesystem (a tmpfs mounted ro): root writes through a chmod, not through this."""
    target = tmp_path / "ro"
    target.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(target)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        if os.environ.get("CI") == "true" and os.geteuid() == 0:
            pytest.fail(f"mount failed as root under CI: {mounted.stderr}")
        pytest.skip(f"mounting a tmpfs needs root: {mounted.stderr.strip()}")
    yield target
    subprocess.run(["umount", str(target)], check=False)


def test_a_read_only_run_directory_is_refused_by_the_agent_and_the_trainer(read_only_dir):
    """Before: the agent started on it and served (recording nothing, acting on nothing)."""
    token = read_only_dir.parent / "webhook.token"       # configured outside RUN: the agent would start
    token.write_text("a-token-of-the-agents-own-32-bytes-or-so\n")
    token.chmod(0o600)
    agent = trainguard("agent", "--run-dir", read_only_dir, "--listen", "127.0.0.1:0",
                       "--webhook-token-file", token, timeout=60)
    assert agent.returncode == 2 and "not writable" in agent.stderr + agent.stdout
    train = trainguard("train", "--run-dir", read_only_dir, "--steps", 1, timeout=60)
    assert train.returncode == 2 and "not writable" in train.stderr
