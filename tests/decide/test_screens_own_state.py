"""A rule's speed lives with the rule: replay's driver (trainguard/decide/batch.py) calls the rules' and
the meter's own screens and writes none of their state, so a rule's state is written in one module."""

from __future__ import annotations

import ast
from pathlib import Path

from trainguard.decide import batch, guard

BATCH = Path(batch.__file__)


def test_batch_assigns_no_attribute_but_its_own_columns():
    """Every attribute batch.py assigns is `self.<x>` inside its own `Rows` (the block's columns): a rule's,
    the guard's or the meter's state written from here would be the old seam back."""
    tree = ast.parse(BATCH.read_text(encoding="utf-8"))
    writes = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for each in ast.walk(target):
                if isinstance(each, ast.Attribute) and not (isinstance(each.value, ast.Name) and each.value.id == "self"):
                    writes.append(f"line {each.lineno}: {ast.unparse(each)}")
    assert writes == []
    owners = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    assert owners <= {"Block", "Rows"}, "batch.py holds no screen classes: a rule's screen is its own method"


def test_every_rule_of_the_default_guard_has_its_own_screen():
    """Each product rule screens itself (a rule without one is correct but makes replay go step by step)."""
    unscreened = [type(rule).__name__ for rule in guard.Guard().rules
                  if not (callable(getattr(rule, "screen", None)) and callable(getattr(rule, "screens", None)))]
    assert unscreened == []
