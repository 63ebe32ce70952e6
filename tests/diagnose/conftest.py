"""Diagnose tests call `trainguard.cli.main`, which points structlog at capsys's stream: reset it after."""

import pytest
import structlog


@pytest.fixture(autouse=True)
def _fresh_logging():
    yield
    structlog.reset_defaults()
