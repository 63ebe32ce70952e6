"""`trainguard cordon RUN HOST --reason`: a human keeps a node out with a cordon the launcher honours
(signed with the run's key), since a cordon file written by hand is no longer honoured."""

from __future__ import annotations

import pytest

from trainguard import cli, cordon


@pytest.fixture
def run(tmp_path):
    path = tmp_path / "run"
    path.mkdir()
    return path


def test_a_cordon_by_hand_is_signed_honoured_and_lifted_by_uncordon(run, tmp_path, capsys, monkeypatch):
    from trainguard.runtime.checkpoint import keys

    key_file = tmp_path / "checkpoint.key"
    keys.load_key(key_file, create=True)          # the run's key, as `trainguard train` made it
    assert cli.main(["cordon", str(run), "n7", "--reason", "flaky HCA", "--key-file", str(key_file)]) == 0
    assert "n7 cordoned" in capsys.readouterr().out

    found = cordon.read_one(run, "n7", keys.load_key(key_file))
    assert found is not None and found.honoured
    assert found.record["reason"] == "flaky HCA" and found.record["by"].startswith("human:")
    assert cordon.read_one(run, "n7", b"another key of thirty-two bytes!!").honoured is False
    assert cli.main(["cordon", str(run), "n7", "--reason", "again", "--key-file", str(key_file)]) == 0
    assert "already cordoned: flaky HCA" in capsys.readouterr().out
    monkeypatch.setenv(keys.ENV_VAR, str(key_file))
    assert cli.main(["uncordon", str(run), "n7"]) == 0
    assert "n7 uncordoned: its launcher may join" in capsys.readouterr().out


@pytest.mark.parametrize("argv, says", [
    (["cordon", "{run}", "../n7", "--reason", "x"], "not a node name"),
    (["cordon", "{missing}", "n7", "--reason", "x"], "missing"),
    (["cordon", "{run}", "n7", "--reason", "x", "--key-file", "{fifo}"], "fifo"),
])
def test_bad_input_is_exit_2_naming_what_is_wrong(run, tmp_path, capsys, argv, says):
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    argv = [a.format(run=run, missing=tmp_path / "missing", fifo=fifo) for a in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("trainguard cordon: ") and says in err.lower() and "Traceback" not in err
    assert not (run / "control" / "cordon" / "n7").exists()
