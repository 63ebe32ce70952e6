"""The suite's shared runs are made once under `pytest -n 2` (the README's and CI's command): tests sharing a
module- or session-scoped fixture go to one worker (tests/conftest.py). With pytest 9 and xdist 3.8 no test
was grouped at all (xdist wrote the group where pytest 9 no longer reads a node id), and every such run was
made on both workers; this runs a module of four tests sharing one fixture on two workers and counts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CONFTEST = ("from tests.conftest import (  # noqa: F401 - the hooks under test\n"
            "    pytest_addoption, pytest_collection_modifyitems, pytest_runtest_call, pytest_runtest_setup,\n"
            "    pytest_runtest_teardown, pytest_terminal_summary)\n")
MODULE = '''
import os
import subprocess
import sys
import pytest

@pytest.fixture(scope="module")
def shared():
    with open(os.environ["SETUPS"], "a") as log:
        log.write(f"{os.getpid()}\\n")
    return 1

def test_a(shared): pass
def test_b(shared): pass
def test_c(shared): pass
def test_d(shared): subprocess.run([sys.executable, "-c", "sum(range(10**7))"], check=True)
'''


def test_a_module_fixture_is_made_once_under_two_workers_and_cpu_durations_reach_the_summary(tmp_path):
    """The same run also lists --cpu-durations (tests/conftest.py): each test's CPU seconds travel from the
    worker in its report; the one that waited for a busy subprocess leads."""
    package = tmp_path / "tests_grouping"          # a fixture of ours is one from a module under tests*
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "conftest.py").write_text(CONFTEST)
    (package / "test_shared.py").write_text(MODULE)
    setups = tmp_path / "setups.log"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                           "--dist", "loadgroup", "--cpu-durations=0", "--rootdir", str(tmp_path), str(package)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "SETUPS": str(setups), "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "4 passed" in done.stdout
    assert len(setups.read_text().splitlines()) == 1, "the module's fixture was made on more than one worker"
    listed = done.stdout.split("CPU seconds per test", 1)[1].splitlines()[1:5]
    assert [line.split("::")[1].split("@")[0] for line in listed][0] == "test_d", done.stdout[-3000:]
    assert sorted(line.split("::")[1].split("@")[0] for line in listed) == ["test_a", "test_b", "test_c", "test_d"]
