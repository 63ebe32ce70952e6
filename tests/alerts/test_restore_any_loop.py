"""A loop on trainguard.protect (a user's script under torchrun, `accelerate launch`, `fabric run`) is proven
as this run's rank with no agent configuration: the kernel shows it holding RUN/tls/rank-<r>.jsonl open for
writing (agent/restore.py `holds_rank_log`). What would point that proof at another process's file (a
symlinked tls/, a hard link, a reader) proves nothing."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from tests.alerts.ranks import Ranks, alive
from tests.alerts.test_restore_proof import restore_now
from trainguard.agent import restore


@pytest.fixture
def ranks():
    launched = Ranks()
    yield launched
    launched.stop()


def copy_rank_file(rank: dict, run_dir) -> None:
    (run_dir / "control" / "ranks").mkdir(parents=True)
    (run_dir / "control" / "ranks" / "rank-0.json").write_text(json.dumps(rank))


def test_a_user_script_under_torchrun_holding_its_log_is_proven_without_configuration(tmp_path, ranks):
    [rank] = ranks.start(tmp_path, hold_log=True)
    _, action = restore_now(tmp_path)                 # no restore_entry_points: STANDIN is a user's script
    assert action["refused"] == [] and [e["rank"] for e in action["ended"]] == [0]


def test_a_rank_holding_another_runs_log_is_refused(tmp_path, ranks):
    [rank] = ranks.start(tmp_path / "A", hold_log=True)
    copy_rank_file(rank, tmp_path / "B")
    (tmp_path / "B" / "tls").mkdir()
    (tmp_path / "B" / "tls" / "rank-0.jsonl").write_text("")
    _, action = restore_now(tmp_path / "B")
    assert [r["reason"] for r in action["refused"]] == ["not_a_worker"] and alive(rank["pid"])


@pytest.mark.parametrize("planted", ["symlinked tls", "hard link"])
def test_a_planted_link_to_another_runs_log_proves_nothing(planted, tmp_path, ranks):
    [rank] = ranks.start(tmp_path / "A", hold_log=True)
    copy_rank_file(rank, tmp_path / "B")
    if planted == "symlinked tls":
        (tmp_path / "B" / "tls").symlink_to(tmp_path / "A" / "tls")
    else:
        (tmp_path / "B" / "tls").mkdir()
        os.link(tmp_path / "A" / "tls" / "rank-0.jsonl", tmp_path / "B" / "tls" / "rank-0.jsonl")
    _, action = restore_now(tmp_path / "B")
    assert [r["reason"] for r in action["refused"]] == ["not_a_worker"] and alive(rank["pid"])


def test_only_a_descriptor_open_for_writing_counts(tmp_path):
    log = tmp_path / "tls" / "rank-3.jsonl"
    log.parent.mkdir()
    log.write_text("")
    assert not restore.holds_rank_log(os.getpid(), tmp_path, 3)
    with open(log) as reader:
        assert not restore.holds_rank_log(os.getpid(), tmp_path, 3)
    with open(log, "a") as writer:
        assert restore.holds_rank_log(os.getpid(), tmp_path, 3) and not restore.holds_rank_log(os.getpid(), tmp_path, 2)
        assert writer and reader


@pytest.mark.parametrize("tool", ["accelerate", "fabric"])
def test_accelerate_launch_and_fabric_run_are_launchers(tool, tmp_path, ranks):
    """Both run a single CPU process without restarts (accelerate's simple launcher; fabric passes
    --max-restarts 0 to torch's): the rank is proven and its launcher found, so the restore pages a
    human rather than end a run nothing would start again (it is not refused as `no_launcher`)."""
    program = shutil.which(tool, path=os.path.dirname(sys.executable))
    if program is None:
        pytest.skip(f"{tool} is not installed")
    launcher = {"accelerate": [program, "launch", "--cpu", "--num_processes", "1", "--num_machines", "1",
                               "--mixed_precision", "no", "--dynamo_backend", "no"],
                "fabric": [program, "run", "--accelerator", "cpu", "--devices", "1"]}[tool]
    [rank] = ranks.start(tmp_path, hold_log=True, launcher=launcher)
    _, action = restore_now(tmp_path)
    assert action["refused"] == [] and action["outcome"] == "paged" and alive(rank["pid"])


def test_the_launching_subcommands_are_read_from_the_programs_place():
    launchers = restore.BUNDLED_LAUNCHERS
    assert restore.is_launcher(["/v/bin/python", "/v/bin/accelerate", "launch", "--cpu", "train.py"], launchers)
    assert restore.is_launcher(["/v/bin/python", "/v/bin/fabric", "run", "--devices", "2", "train.py"], launchers)
    assert restore.is_launcher(["python", "-m", "accelerate.commands.launch", "train.py"], launchers)
    assert not restore.is_launcher(["/v/bin/python", "/v/bin/accelerate", "config"], launchers)
    assert not restore.is_launcher(["/v/bin/python", "/v/bin/fabric", "consolidate", "ckpt"], launchers)
    assert not restore.is_launcher(["/v/bin/python", "train.py", "accelerate", "launch"], launchers)
