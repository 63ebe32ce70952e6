"""The policy's keys are declared beside their components (trainguard/config.py); docs/policy.md is made
from those declarations, and one number per concept: an older key is an alias of the one it meant.

These hold the doc to the code (a key added without its row, a default or range changed in one place
only) and the aliases to their contract (accepted, the same number everywhere, refused when they disagree).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from alerts import rules
from trainguard import policy as policy_mod
from trainguard.config import declared, leaves

DOC = Path(__file__).resolve().parents[2] / "docs" / "policy.md"


def doc_rows() -> dict[str, list[str]]:
    """docs/policy.md's table rows by key: [key cell, default, values, what]."""
    rows = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 4:
            rows[cells[0].split("`")[1]] = cells
    return rows


def test_every_declared_key_is_documented_with_its_default_and_range():
    rows = doc_rows()
    missing, wrong = [], []
    for name, default, declaration in leaves(policy_mod.Policy()):
        row = rows.get(name)
        if row is None:
            missing.append(name)
        elif row[1] != f"`{default!r}`" or row[2] != declaration.describe():
            wrong.append(f"{name}: doc says {row[1:3]}, code {default!r}, {declaration.describe()}")
    assert missing == [] and wrong == [], (
        f"regenerate: .venv/bin/python -m trainguard.policy > docs/policy.md\nmissing: {missing}\n" + "\n".join(wrong))
    assert set(rows) == {name for name, _, _ in leaves(policy_mod.Policy())}, "docs/policy.md names a key no one declares"


def test_the_doc_is_the_generated_reference():
    assert DOC.read_text(encoding="utf-8") == policy_mod.reference(), \
        "regenerate: .venv/bin/python -m trainguard.policy > docs/policy.md"


def test_every_field_of_every_section_is_declared_with_a_range_and_a_doc():
    def walk(section, where):
        for field in dataclasses.fields(section):
            value = getattr(section, field.name)
            name = f"{where}.{field.name}" if where else field.name
            if declared(field) is None and dataclasses.is_dataclass(value):
                yield from walk(value, name)
            elif declared(field) is None or not declared(field).doc:
                yield name

    assert list(walk(policy_mod.Policy(), "")) == []


def load(tmp_path, text):
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    return path, policy_mod.load(path)


@pytest.mark.parametrize("alias, key, value", [
    ("alerts.loss_spike_sigma", "spike_sigma", 4.5),
    ("alerts.grad_explode_factor", "grad_explode_factor", 12.0),
])
def test_an_older_key_is_an_alias_of_the_one_number(tmp_path, alias, key, value):
    section, name = alias.split(".")
    _, by_alias = load(tmp_path, f"{section}:\n  {name}: {value}\n")
    _, by_key = load(tmp_path, f"guard:\n  {key}: {value}\n")
    assert getattr(by_alias.guard, key) == getattr(by_key.guard, key) == value
    assert rules.render(by_alias) == rules.render(by_key)       # the alert rules read the same number
    _, both = load(tmp_path, f"{section}:\n  {name}: {value}\nguard:\n  {key}: {value}\n")
    assert getattr(both.guard, key) == value


def test_an_alias_and_its_key_that_disagree_are_refused_naming_both(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text("alerts:\n  loss_spike_sigma: 5\nguard:\n  spike_sigma: 6\n")
    with pytest.raises(policy_mod.PolicyError) as caught:
        policy_mod.load(path)
    assert str(caught.value).startswith(f"{path}: alerts.loss_spike_sigma: an alias of guard.spike_sigma")


def test_a_bad_value_under_an_alias_names_the_alias(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text("alerts:\n  grad_explode_factor: 0.5\n")
    with pytest.raises(policy_mod.PolicyError) as caught:
        policy_mod.load(path)
    assert str(caught.value) == f"{path}: alerts.grad_explode_factor: must be > 1, got 0.5"


def test_the_alert_rules_take_the_guards_sigma_and_factor():
    guard = dataclasses.replace(policy_mod.Policy().guard, spike_sigma=7.5, grad_explode_factor=13.0)
    training = rules.render(policy_mod.Policy(guard=guard))["training.rules.yml"]
    assert "+ 7.5 * trainguard:training_loss:robust_stddev" in training
    assert "> 13 * trainguard:training_grad_norm:median" in training
