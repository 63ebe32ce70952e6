"""Every trainer test gets a checkpoint key of its own (never the user's real one), and torch uses one
thread: the tiny model gains nothing from more, and on a shared machine spinning threads only slow it."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _key_in_tmp(tmp_path, monkeypatch):
    """No test may read or create the user's real checkpoint key."""
    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_KEY", str(tmp_path / "keys" / "checkpoint.key"))


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")        # subprocesses (the launcher keeps a value it finds)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                           # in-process runs
    yield
    torch.set_num_threads(threads)
