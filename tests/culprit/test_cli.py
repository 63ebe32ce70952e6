"""`trainguard incidents`, `trainguard uncordon` and the multi-node flags of `trainguard train`: bad input
is a clear error naming the file or flag, exit status 2, no traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from tests.culprit.cluster import TRAINGUARD
from trainguard.agent import evict

RECORDED = Path(__file__).parent / "recorded"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([TRAINGUARD, *args], capture_output=True, text=True, timeout=120)


def run_here(capfd, *args: str) -> tuple[int, str]:
    """(exit status, stderr) of a command in this process: argparse's errors exit, ours return 2; anything
    else that escapes (a traceback in a process) fails the test here."""
    from trainguard.cli import main

    try:
        code = main(list(args))
    except SystemExit as exc:
        code = exc.code
    return code, capfd.readouterr().err


def test_list_and_show_a_recorded_incident_with_the_two_ranks_stacks_side_by_side():
    listed = run("incidents", str(RECORDED / "hang-evict"))
    assert listed.returncode == 0 and "rank 1 on n2" in listed.stdout and "evict" in listed.stdout
    incident_id = next((RECORDED / "hang-evict" / "incidents").iterdir()).name
    for words in (("show", str(RECORDED / "hang-evict"), incident_id), (str(RECORDED / "hang-evict"), "show", incident_id)):
        shown = run("incidents", *words)
        assert shown.returncode == 0, shown.stderr
        assert "rank 1 (culprit)" in shown.stdout and "rank 0 (healthy)" in shown.stdout
        assert "process_faults" in shown.stdout and "behind the wavefront" in shown.stdout
    as_json = json.loads(run("incidents", "show", str(RECORDED / "hang-evict"), incident_id, "--json").stdout)
    assert as_json["culprit"]["node"] == "n2" and "rank-1.fr.json" in as_json["evidence"]


def test_bad_input_is_exit_2_naming_what_is_wrong(tmp_path, capfd):
    done = run("incidents", str(tmp_path / "nope"))                    # one through the installed command
    assert done.returncode == 2 and "no such run directory" in done.stderr and "Traceback" not in done.stderr
    for args, says in [                                                 # the others in this process
        (("incidents", str(tmp_path / "nope")), "no such run directory"),
        (("incidents", "show", str(RECORDED / "hang-evict"), "no-such-id"), "no such incident"),
        (("incidents", "show", str(RECORDED / "hang-evict"), "../etc"), "letters, digits"),
        (("incidents", "show", str(RECORDED / "hang-evict")), "usage"),
        (("uncordon", str(tmp_path), "n9"), "n9 is not cordoned"),
        (("uncordon", str(tmp_path), "../x"), "not a node name"),
        (("train", "--run-dir", str(tmp_path / "r"), "--nnodes", "2:1"), "1 <= MIN <= MAX"),
        (("train", "--run-dir", str(tmp_path / "r"), "--nnodes", "1:2"), "--rdzv-endpoint"),
        (("train", "--run-dir", str(tmp_path / "r"), "--nnodes", "1:2", "--rdzv-endpoint", "h:1",
          "--rdzv-conf", "novalue"), "KEY=VALUE"),
    ]:
        code, err = run_here(capfd, *args)
        assert code == 2, (args, err)
        assert says in err and "Traceback" not in err, (args, err)


def test_a_tampered_verdict_is_reported_not_trusted(tmp_path):
    shutil.copytree(RECORDED / "hang-evict", tmp_path / "run")
    [incident] = (tmp_path / "run" / "incidents").iterdir()
    data = json.loads((incident / "incident.json").read_text())
    (incident / "incident.json").write_text(json.dumps({**data, "confidence": 7}))
    listed = run("incidents", str(tmp_path / "run"))
    assert listed.returncode == 1 and "confidence" in listed.stderr


def test_uncordon_removes_the_cordon_and_the_launcher_may_join_again(tmp_path):
    evict.cordon(tmp_path, "n2", incident="x", reason="test", by="test")
    assert set(evict.cordoned(tmp_path)) == {"n2"}
    done = run("uncordon", str(tmp_path), "n2")
    assert done.returncode == 0 and "n2 uncordoned" in done.stdout
    assert evict.cordoned(tmp_path) == {}
