"""Shared by every test directory: the repository root on sys.path, so ``tests.servers`` and other
helpers import the same way under ``pytest`` and ``python -m pytest``."""

import sys
from pathlib import Path

import pytest
import structlog

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


SHARED_SCOPES = ("session", "package", "module", "class")


@pytest.hookimpl(tryfirst=True)     # before xdist's own, which reads the groups when it runs
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`-n 2 --dist loadgroup`, the README's command) each worker makes its own session-
    and module-scoped fixtures: a module's real run (tests/e2e/test_two_nodes.py's two-node job, the `hung_run`
    session) would be made once per worker that gets one of its tests. A test using such a fixture joins the
    fixture's `xdist_group`, so the tests sharing one run go to one worker and the run is made once.
    A test's own `@pytest.mark.xdist_group` wins."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None and (group := _shared_fixture_group(item)):
            item.add_marker(pytest.mark.xdist_group(group))
        if getattr(config.option, "loadgroup", False):     # set on each worker by xdist under --dist loadgroup
            _group_in_node_id(item)


def _group_in_node_id(item) -> None:
    """What xdist's `--dist loadgroup` does on a worker, done where pytest 9 reads it: the groups appended to
    the node id (`<id>@<group>`), which the controller schedules by. xdist 3.8 writes `item._nodeid`;
    pytest 9 keeps a node's id in `item._id` (a NodeId) and reads `_nodeid` no more, so no test was grouped:
    every module- or session-scoped run was made again on each worker that got one of its tests (measured:
    tests/e2e/test_fail_slow.py's two-rank run set up on both workers, 52 s and 40 s). On a pytest that still
    reads `_nodeid` xdist's own hook does it and this does nothing."""
    groups = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                     for mark in item.iter_markers("xdist_group")})
    node_id = getattr(item, "_id", None)
    if not groups or node_id is None or isinstance(node_id, str) or not hasattr(type(node_id), "parse") \
            or "@" in item.nodeid:
        return
    item._id = type(node_id).parse(f"{item.nodeid}@{'_'.join(groups)}")


def _shared_fixture_group(item) -> str | None:
    """The group of the widest-scoped fixture of ours (tests/...) the test uses; None if it uses none."""
    info = getattr(item, "_fixtureinfo", None)
    ours = [defs[-1] for defs in (info.name2fixturedefs.values() if info else ())
            if defs and defs[-1].scope in SHARED_SCOPES
            and getattr(defs[-1].func, "__module__", "").startswith("tests")]
    if not ours:
        return None
    widest = min(ours, key=lambda fixture: SHARED_SCOPES.index(fixture.scope))
    if widest.scope in ("session", "package"):
        return widest.argname                        # one run for the whole session: its users, wherever they are
    return item.nodeid.split("::")[0]                # module or class scope: the module's tests together


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
