"""Shared by every test directory: the repository root on sys.path, so ``tests.servers`` and other
helpers import the same way under ``pytest`` and ``python -m pytest``."""

import resource
import sys
from pathlib import Path

import pytest
import structlog

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


SHARED_SCOPES = ("session", "package", "module", "class")
CPU_PROPERTY = "cpu_seconds"


def pytest_addoption(parser):
    parser.addoption("--cpu-durations", type=int, default=None, metavar="N",
                     help="list the N tests that used the most CPU (0: all): user+system seconds of the test's "
                          "process and of the subprocesses it waited for, setup and teardown included; unlike "
                          "--durations' wall times, about the same on a quiet machine and a loaded one")


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _count_cpu(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _count_cpu(item, "call")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield from _count_cpu(item, "teardown")


def _count_cpu(item, phase: str):
    """The phase's CPU seconds, put in the item's user_properties before its report is made: the report
    carries them to the controller under xdist, where `pytest_terminal_summary` lists them."""
    if item.config.getoption("cpu_durations") is None:
        yield
        return
    before = _cpu_seconds()
    yield
    item.user_properties.append((CPU_PROPERTY, (phase, _cpu_seconds() - before)))


def pytest_terminal_summary(terminalreporter, config):
    count = config.getoption("cpu_durations")
    if count is None:
        return
    per_test: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) != "teardown":      # the last report holds every phase's
                continue
            phases = dict(value for name, value in report.user_properties if name == CPU_PROPERTY)
            per_test[report.nodeid] = sum(phases.values())
    ranked = sorted(per_test.items(), key=lambda entry: -entry[1])
    terminalreporter.write_sep("=", f"CPU seconds per test (total {sum(per_test.values()):.1f})")
    for nodeid, seconds in ranked[:count or None]:
        terminalreporter.write_line(f"{seconds:8.2f}s  {nodeid}")


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


@pytest.fixture
def key_file(tmp_path, monkeypatch):
    """The run's checkpoint key, where trainer, launcher, agent and CLI all look for it (a module whose key
    lives elsewhere defines its own: tests/checkpoint/conftest.py)."""
    from trainguard.runtime.checkpoint import keys

    path = tmp_path / "keys" / "checkpoint.key"
    monkeypatch.setenv(keys.ENV_VAR, str(path))
    keys.load_key(path, create=True)
    return path


@pytest.fixture(scope="session")
def hung_run(tmp_path_factory):
    """One real run with a rollback and a hang, shared by the tests that read it (tests/report/test_hang_story.py,
    tests/reliability/test_restore_needs_a_restart.py): two ranks of the bundled trainer under
    `trainguard train --nproc 2` with its default flags and `trainguard agent` beside them; NaNs at steps
    15-17 make the guard roll back to step 10; a hang at step 40 is seen by the agent's embedded stall
    watchdog, which restores (ends the ranks; the launcher starts them again from step 30)."""
    from tests.hung_run import run_with_a_hang

    return run_with_a_hang(tmp_path_factory.mktemp("hang") / "run")
