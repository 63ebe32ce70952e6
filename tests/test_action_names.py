"""Action names are spelled once, in the action table (trainguard/actions.py): every other product module
imports them, so one search finds every place that decides, carries out, records or reads an action.

The scan (tests/test_vocabulary.py's `stray_literals`): every string constant in product code equal to an
action's name, outside trainguard/actions.py, except prose (docstrings, log messages, an option's help) and
the few `ALLOWED` places where the same word names something else.
"""

from __future__ import annotations

import ast

from tests.test_vocabulary import stray_literals
from trainguard import actions

OWNER = "trainguard/actions.py"

# (file, word): the same word in another vocabulary, owned there. Each entry says which.
ALLOWED = {
    # the cost meter's tier names (warn, throttle, stop): a tier, not the guard's stop action
    ("trainguard/decide/cost.py", "stop"),
    ("trainguard/metrics/training.py", "stop"),
    ("trainguard/report/html.py", "stop"),
    ("dashboards/build.py", "stop"),
    # subcommand names of the command line (`trainguard cordon`, `trainguard checkpoint restore`)
    ("trainguard/cli.py", "cordon"),
    ("runtime/checkpoint/cli.py", "restore"),
    # the run directory's folder of cordon files, RUN/control/cordon/ (rundir owns its paths)
    ("trainguard/rundir.py", "cordon"),
    # what a file is, in an error message (safe_read's `what`): "cordon: too large"
    ("trainguard/cordon/__init__.py", "cordon"),
    # the report's marker kinds, named after what they mark (a rollback, a restart from a checkpoint)
    ("trainguard/report/html.py", "rollback"),
    ("trainguard/report/html.py", "restore"),
    ("trainguard/report/charts.py", "rollback"),
    ("trainguard/report/charts.py", "restore"),
    ("trainguard/report/data.py", "rollback"),
    ("trainguard/report/data.py", "restore"),
    # a field of an incident's record and of replay's replica verdict: the hosts cordoned
    ("trainer/replica_check.py", "cordon"),
    ("trainguard/replay/replica.py", "cordon"),
    # a part of an in-process restart's time (teardown, reform, restore: docs/recovery.md, "The books"), a label
    ("trainguard/metrics/training_state.py", "restore"),
    ("dashboards/build.py", "restore"),
}


def stray_names(names: set[str]) -> list[str]:
    """tests/test_vocabulary.py's scanner (docstrings, log messages and an option's help are prose), less the
    allowances."""
    return [found for found in stray_literals(OWNER, names) if _place(found) not in ALLOWED]


def _place(found: str) -> tuple[str, str]:
    path, _, text = found.split(":", 2)
    return path, ast.literal_eval(text.strip())


def test_no_product_module_spells_an_action_name():
    stray = stray_names(set(actions.BY_NAME))
    assert not stray, "import the name from trainguard/actions.py instead:\n" + "\n".join(stray)


def test_every_allowed_place_still_spells_its_word():
    """An allowance nothing needs any more is removed, so the list stays the reasoned minimum."""
    words = {word for _, word in ALLOWED}
    needed = {_place(found) for found in stray_literals(OWNER, words)} & ALLOWED
    assert needed == ALLOWED, sorted(ALLOWED - needed)


def test_the_scan_finds_a_planted_name_and_leaves_docstrings_alone(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('"""A rollback module: "rollback" in prose."""\n\ndef f(event):\n    """restore"""\n'
                       '    return event.get("type") == "rollback"\n')
    assert stray_literals(OWNER, set(actions.BY_NAME), files=[planted], root=tmp_path) == ["planted.py:5: 'rollback'"]
