"""Shared by every test directory: the repository root on sys.path, so ``tests.servers`` and other
helpers import the same way under ``pytest`` and ``python -m pytest``."""

import sys
from pathlib import Path

import pytest
import structlog

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(autouse=True)
def _fresh_logging():
    """`trainguard.cli.main` points structlog at the stream of the moment (capsys's, closed afterwards)."""
    yield
    structlog.reset_defaults()


@pytest.fixture(scope="session")
def hung_run(tmp_path_factory):
    """One real run with a rollback and a hang, shared by the tests that read it (tests/report/test_hang_story.py,
    tests/reliability/test_restore_needs_a_restart.py): two ranks of the bundled trainer under
    `trainguard train --nproc 2` with its default flags and `trainguard agent` beside them; NaNs at steps
    15-17 make the guard roll back to step 10; a hang at step 40 is seen by the agent's embedded stall
    watchdog, which restores (ends the ranks; the launcher starts them again from step 30)."""
    from tests.hung_run import run_with_a_hang

    return run_with_a_hang(tmp_path_factory.mktemp("hang") / "run")
