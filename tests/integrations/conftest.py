"""Every library test gets a checkpoint key of its own (never the user's real one)."""

import pytest


@pytest.fixture(autouse=True)
def _key_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_KEY", str(tmp_path / "keys" / "checkpoint.key"))
